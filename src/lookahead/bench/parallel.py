"""Lookahead parallelism benchmark: the same prompts decoded by 1..K local worker processes at one fixed
(W, N, G), tokens/s and steps/s side by side; and a cost model that predicts the speedup of K devices
from a measured forward cost curve T(k)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import LookaheadConfig
from ..costs import CostCurve
from ..models import load_model
from ..parallel import parallel_generate, run_workers


@dataclass(frozen=True)
class ParallelRun:
    workers: int
    threads: int  # torch threads per worker
    prompts: int
    new_tokens: int
    steps: int
    seconds: float  # decoding only, summed over the prompts (rank 0's clock)
    rows_per_step: float  # rows rank 0 fed per step (its share, plus tokens it caught up on)
    identical: bool | None  # every output equals the 1-worker run's (None for the 1-worker run itself)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps


def _decode_all(model: str | None, gguf_file: str | None, dtype: str, prompts: list[list[int]],
                max_new_tokens: int, config: LookaheadConfig) -> list[tuple[list[int], int, float, int]]:
    """One worker's part: each prompt's new tokens, steps, seconds and rows fed (after one warm-up), greedy
    whatever the generation config says (the outputs are compared token for token)."""
    lm, _ = load_model(model, gguf_file=gguf_file, dtype=dtype)
    parallel_generate(lm, prompts[0], 4, config, do_sample=False)
    results = []
    for prompt in prompts:
        out = parallel_generate(lm, prompt, max_new_tokens, config, do_sample=False)
        results.append((out.sequences[0, len(prompt):].tolist(), out.stats.steps, out.stats.seconds,
                        out.stats.tokens_fed))
    return results


def parallel_runs(model: str | None, gguf_file: str | None, dtype: str, prompts: list[list[int]],
                  worker_counts: Sequence[int], threads: int, max_new_tokens: int, config: LookaheadConfig,
                  on_run: Callable[[ParallelRun], None] | None = None) -> list[ParallelRun]:
    runs, first = [], None
    for workers in worker_counts:
        results = run_workers(workers, _decode_all, model, gguf_file, dtype, prompts, max_new_tokens, config,
                              threads=threads)
        outputs = [tokens for tokens, *_ in results]
        first = first or outputs
        steps = sum(r[1] for r in results)
        run = ParallelRun(workers, threads, len(prompts), sum(map(len, outputs)), steps, sum(r[2] for r in results),
                          sum(r[3] for r in results) / steps, None if workers == worker_counts[0] else outputs == first)
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return runs


def share_rows(rows: float, config: LookaheadConfig, workers: int) -> float:
    """Rows per worker when a step of `rows` rows is shared out among `workers` as `core.split` does, the
    load balanced: every worker runs row 0, and the level-0 columns up to its block's end (half the
    window on average beyond its own block), so the workers run (workers - 1) * (1 + W / 2) rows more
    than the step has."""
    return (rows + (workers - 1) * (1 + config.window / 2)) / workers


def predicted_speedups(curve: CostCurve, rows: float, config: LookaheadConfig, max_workers: int = 8
                       ) -> list[tuple[int, float, float]]:
    """(K, rows per worker, predicted speedup over one worker) for K = 1..max_workers: tokens per step do
    not change with K (the same tokens are committed), so the speedup is T(rows) / T(rows per worker),
    ignoring the exchange of token ids and the tokens a worker catches up on."""
    return [(k, share_rows(rows, config, k), curve(rows) / curve(share_rows(rows, config, k)))
            for k in range(1, max_workers + 1)]


def parallel_table(runs: Sequence[ParallelRun]) -> str:
    base = runs[0]
    lines = ["| workers | threads each | tokens/s | steps/s | tokens/step | rows/step (rank 0) | vs 1 worker | "
             "identical |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        same = "–" if r.identical is None else ("yes" if r.identical else "no")
        lines.append(f"| {r.workers} | {r.threads} | {r.tokens_per_second:.1f} | {r.steps_per_second:.2f} | "
                     f"{r.tokens_per_step:.2f} | {r.rows_per_step:.1f} | "
                     f"{r.tokens_per_second / base.tokens_per_second:.2f}x | {same} |")
    return "\n".join(lines)


def prediction_table(predictions: list[tuple[int, float, float]], measured: Sequence[ParallelRun]) -> str:
    by_workers = {r.workers: r for r in measured}
    base = by_workers.get(1)
    lines = ["| devices K | rows per device | predicted speedup | measured |", "|---|---|---|---|"]
    for k, rows, speedup in predictions:
        run = by_workers.get(k)
        seen = "–" if run is None or base is None else f"{run.tokens_per_second / base.tokens_per_second:.2f}x"
        lines.append(f"| {k} | {rows:.1f} | {speedup:.2f}x | {seen} |")
    return "\n".join(lines)


def curve_from_points(points: list[dict]) -> CostCurve:
    """A cost curve from `lookahead bench cost --out`'s cost.json points."""
    return CostCurve([p["tokens"] for p in points], [p["seconds"] for p in points])



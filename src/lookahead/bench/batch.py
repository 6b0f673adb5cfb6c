"""Batch benchmark: the same prompts decoded B at a time by transformers' batched `generate`, our plain
engine and lookahead on the engine, in one process; throughput and per-sequence latency per batch size."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..config import AUTO_CONFIG, LookaheadConfig
from ..engine import eos_ids, pad_id
from ..generation import generate

PLAIN = LookaheadConfig(window=0, guesses=0)
METHODS = ("transformers", "plain", "lookahead")


@dataclass(frozen=True)
class BatchRun:
    """One method on all the prompts, `batch_size` at a time."""

    method: str
    batch_size: int
    sequences: int
    new_tokens: int
    seconds: float
    latency: float  # mean seconds from a sequence's start to its last token
    steps: int | None  # ours: engine steps (forwards after the prefill)
    identical: bool | None  # lookahead: every output equals our plain engine's at the same batch size

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens per step per sequence."""
        return self.new_tokens / self.steps / self.batch_size if self.steps else None


def _transformers_batch(model: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int
                        ) -> tuple[list[list[int]], float, list[float]]:
    """transformers' batched greedy `generate`, left-padded as it expects: outputs, seconds, latencies."""
    pad = pad_id(model)
    stops = eos_ids(model, None)
    width = max(p.numel() for p in prompts)
    input_ids = torch.stack([torch.cat([torch.full((width - p.numel(),), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.numel()), torch.ones(p.numel())]) for p in prompts]).long()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad, eos_token_id=sorted(stops) or None)
    seconds = time.perf_counter() - start
    outputs = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        outputs.append(row[:end])
    return outputs, seconds, [seconds] * len(prompts)


def _ours(model: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int, config: LookaheadConfig
          ) -> tuple[list[list[int]], float, list[float], int]:
    start = time.perf_counter()
    out = generate(model, list(prompts), max_new_tokens=max_new_tokens, config=config)
    seconds = time.perf_counter() - start
    outputs = [row[p.numel(): p.numel() + s.new_tokens].tolist()
               for row, p, s in zip(out.sequences, prompts, out.stats.per_sequence)]
    return outputs, seconds, [s.seconds for s in out.stats.per_sequence], out.stats.steps


def batch_runs(model: PreTrainedModel, prompts: Sequence[torch.Tensor], batch_sizes: Sequence[int],
               max_new_tokens: int, config: LookaheadConfig = AUTO_CONFIG,
               on_run: Callable[[BatchRun], None] | None = None) -> list[BatchRun]:
    """For each batch size, every prompt once per method, the methods taking turns on each batch (so that
    a drift of the machine's speed touches them alike)."""
    runs = []
    for size in batch_sizes:
        totals = {m: {"tokens": 0, "seconds": 0.0, "latency": 0.0, "steps": 0} for m in METHODS}
        identical = True
        for first in range(0, len(prompts), size):
            chunk = prompts[first: first + size]
            results = {"transformers": (*_transformers_batch(model, chunk, max_new_tokens), None),
                       "plain": _ours(model, chunk, max_new_tokens, PLAIN),
                       "lookahead": _ours(model, chunk, max_new_tokens, config)}
            identical &= results["lookahead"][0] == results["plain"][0]
            for method, (outputs, seconds, latencies, steps) in results.items():
                total = totals[method]
                total["tokens"] += sum(map(len, outputs))
                total["seconds"] += seconds
                total["latency"] += sum(latencies)
                total["steps"] += steps or 0
        for method in METHODS:
            total = totals[method]
            run = BatchRun(method, size, len(prompts), total["tokens"], total["seconds"],
                           total["latency"] / len(prompts), total["steps"] or None,
                           identical if method == "lookahead" else None)
            runs.append(run)
            if on_run is not None:
                on_run(run)
    return runs


def batch_table(runs: Sequence[BatchRun]) -> str:
    by = {(r.method, r.batch_size): r for r in runs}
    lines = ["| batch | method | tokens/s | latency per sequence (s) | tokens/step/sequence | vs plain engine | "
             "vs transformers | identical to plain |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        plain, theirs = by[("plain", r.batch_size)], by[("transformers", r.batch_size)]
        per_step = "–" if r.tokens_per_step is None else f"{r.tokens_per_step:.2f}"
        same = "–" if r.identical is None else ("yes" if r.identical else "no")
        lines.append(f"| {r.batch_size} | {r.method} | {r.tokens_per_second:.1f} | {r.latency:.2f} | {per_step} | "
                     f"{r.tokens_per_second / plain.tokens_per_second:.2f}x | "
                     f"{r.tokens_per_second / theirs.tokens_per_second:.2f}x | {same} |")
    return "\n".join(lines)

"""Benchmark outputs: results.json, report.md and PNG plots."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..costs import CostPoint  # noqa: E402
from .batch import METHODS, BatchRun, batch_table  # noqa: E402
from .sweep import SweepPoint  # noqa: E402
from .parallel import ParallelRun, parallel_table, prediction_table  # noqa: E402
from .serve import LoadRun, load_table  # noqa: E402
from .runner import Run, Summary  # noqa: E402


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def summary_table(rows: list[Summary], baseline: str = "greedy") -> str:
    """`baseline`: the method the speedups are against (`summarize`'s)."""
    lines = [
        f"| method | category | runs | tokens/step | tokens/s | speedup vs {baseline} (total) | (geomean) | vs plain | "
        "identical | overhead |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.category} | {r.runs} | {r.tokens_per_step:.2f} | {r.tokens_per_second:.1f} | "
            f"{_fmt(r.speedup_total, suffix='x')} | {_fmt(r.speedup_geomean, suffix='x')} | "
            f"{_fmt(r.speedup_vs_plain, suffix='x')} | {_fmt(r.identical_rate)} | "
            f"{_fmt(None if r.overhead_fraction is None else 100 * r.overhead_fraction, 1, '%')} |"
        )
    return "\n".join(lines)


PHASES = ("forward", "inputs", "plan", "verify", "commit", "prefill", "other")


def profile_line(row: Summary, runs: list[Run]) -> str:
    """Where one method's time went (its overall summary row and its runs), per step and by phase
    (`GenerationStats.phase_seconds`), and "set-up" for the rest of the call (the engine made, the request
    checked), outside the phases: the shares add up to 100%."""
    totals = {phase: sum((r.phase_seconds or {}).get(phase, 0.0) for r in runs) for phase in PHASES}
    totals["set-up"] = max(row.seconds - sum(totals.values()), 0.0)
    shares = ", ".join(f"{phase} {100 * seconds / row.seconds:.1f}%" for phase, seconds in totals.items())
    return (
        f"profile {row.method}: {1000 * row.seconds / row.steps:.1f} ms/step, "
        f"model forward {1000 * totals['forward'] / row.steps:.1f} ms/step; "
        f"{shares}; outside the model {100 * row.overhead_fraction:.1f}%"
    )


def drafts_line(method: str, runs: list[Run]) -> str:
    """What one of our methods fed and where its accepted guess tokens came from."""
    steps = sum(r.steps for r in runs)
    sources: dict[str, int] = {}
    for r in runs:
        for source, count in (r.accepted_by_source or {}).items():
            sources[source] = sources.get(source, 0) + count
    accepted = sum(sources.values())
    shares = ", ".join(f"{s} {100 * n / accepted:.0f}%" for s, n in sorted(sources.items(), key=lambda i: -i[1]))
    windows = sorted({r.window for r in runs if r.window is not None})
    return (f"drafts {method}: fed {sum(r.tokens_fed or 0 for r in runs) / steps:.1f} tokens/step, window "
            f"{'/'.join(map(str, windows))} columns; accepted guess tokens {accepted / steps:.2f}/step"
            + (f" by source: {shares}" if accepted else ""))


def divergence_table(runs: list[Run]) -> str:
    """Every output that differs from transformers' `generate`, with how close to a tie it diverged."""
    if all(r.identical is None for r in runs):
        return "Outputs were not compared token for token (sampling, or no `greedy` baseline)."
    compared = [r for r in runs if r.identical is not None and r.method != "greedy"]  # not `generate` with itself
    diverged = [r for r in compared if r.identical is False]
    if not diverged:
        return "Every output was token-identical to transformers' `generate`."
    lines = [
        f"{len(diverged)} of {len(compared)} outputs differ from transformers' "
        "`generate`. At the first difference, |gap| is the logit difference between the two chosen tokens; "
        "the median gap is that of the top two tokens over the whole output (float32 forward of the same weights); "
        "spacing, the step between neighbouring values of the model's dtype at that logit.",
        "",
        "| method | prompt | turn | first difference | |gap| there | spacing there | median top-2 gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in diverged:
        lines.append(
            f"| {r.method} | {r.prompt_id} | {r.turn} | {r.first_difference} | {_fmt(r.tie_gap, 3)} | "
            f"{_fmt(r.dtype_spacing, 4)} | {_fmt(r.median_gap, 3)} |"
        )
    return "\n".join(lines)


def _write_results(out: Path, title: str, command: str, env: dict, results: dict, body: str) -> list[Path]:
    """results.json (the command, the environment and `results`) and report.md (`body` under the same header)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "environment": env, **results}, indent=1))
    env_lines = "\n".join(f"- {key}: {value}" for key, value in env.items())
    (out / "report.md").write_text(f"# {title}\n\n`{command}`\n\n{env_lines}\n\n{body}")
    return [out / "results.json", out / "report.md"]


def write_benchmark(out: Path, runs: list[Run], rows: list[Summary], env: dict, command: str,
                    baseline: str = "greedy") -> list[Path]:
    results = {"summary": [r.as_dict() for r in rows], "runs": [{**asdict(r), "tokens_per_step": r.tokens_per_step} for r in runs]}
    with_speedups = any(r.speedup_total is not None for r in rows)  # not without the baseline's runs
    body = (f"{summary_table(rows, baseline)}\n\n"
            "Speedup (total) is the ratio of total times per new token (of total times where the outputs are "
            "identical); geomean, the geometric mean of per-prompt ratios; "
            "overhead, the share of our time spent outside the model's forward.\n\n"
            f"## Divergences\n\n{divergence_table(runs)}\n\n"
            + ("![speedup](speedup.png)\n\n" if with_speedups else "") + "![tokens per step](tokens_per_step.png)\n")
    plots = [_bars(out / "speedup.png", rows, "speedup_total", f"speedup vs {baseline}")] if with_speedups else []
    return [*_write_results(out, "Benchmark", command, env, results, body), *plots,
            _bars(out / "tokens_per_step.png", rows, "tokens_per_step", "tokens per step")]


def _bars(path: Path, rows: list[Summary], field: str, label: str) -> Path:
    methods = list(dict.fromkeys(r.method for r in rows))
    categories = list(dict.fromkeys(r.category for r in rows))
    values = {(r.method, r.category): getattr(r, field) for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * max(1, len(methods)) / 2), 4))
    width = 0.8 / max(1, len(methods))
    x = np.arange(len(categories))
    for index, method in enumerate(methods):
        heights = [values.get((method, c)) or 0.0 for c in categories]
        ax.bar(x + index * width, heights, width, label=method)
    ax.set_xticks(x + width * (len(methods) - 1) / 2, categories, rotation=20, ha="right")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
    return _save(fig, ax, path)


def write_cost(out: Path, curves: dict[str, list[CostPoint]], env: dict) -> list[Path]:
    """cost.json (each curve's points; "points": the last, the path decoding takes) and cost.png (ms per step)."""
    out.mkdir(parents=True, exist_ok=True)
    points = list(curves.values())[-1]
    (out / "cost.json").write_text(json.dumps({"environment": env, "points": [asdict(p) for p in points],
                                               "curves": {name: [asdict(p) for p in c] for name, c in curves.items()}},
                                              indent=1))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        ax.plot([p.tokens for p in curve], [1000 * p.seconds for p in curve], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens per forward (k)")
    ax.set_ylabel("ms per forward")
    ax.legend()
    return [out / "cost.json", _save(fig, ax, out / "cost.png")]


def _as_dicts(runs, *properties: str) -> list[dict]:
    """Each run's fields and the named derived properties, for results.json."""
    return [{**asdict(r), **{name: getattr(r, name) for name in properties}} for r in runs]


def write_batch(out: Path, runs: list[BatchRun], env: dict, command: str) -> list[Path]:
    results = {"runs": _as_dicts(runs, "tokens_per_second", "tokens_per_step")}
    body = (f"{batch_table(runs)}\n\n"
            "tokens/s: new tokens of all sequences over the wall time; latency: mean seconds from a sequence's "
            "start (for our engine: its admission to a slot) to its last token (transformers returns every "
            "sequence at the end of its batch).\n\n![throughput](batch.png)\n")
    written = _write_results(out, "Batch benchmark", command, env, results, body)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        points = [(r.batch_size, r.tokens_per_second) for r in runs if r.method == method]
        ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (all sequences)")
    ax.legend()
    return [*written, _save(fig, ax, out / "batch.png")]


def write_serve(out: Path, runs: list[LoadRun], env: dict, command: str) -> list[Path]:
    results = {"runs": _as_dicts(runs, "tokens_per_second", "tokens_per_step")}
    body = (f"{load_table(runs)}\n\n"
            "tokens/s: tokens of all replies over the wall time of the mode; TTFT: from sending a request to its "
            "first token; ITL: time between a reply's tokens, a step's tokens sharing the step's interval; "
            "same reply as off: greedy replies equal to the same prompt's reply with lookahead off.\n\n"
            "![load](serve.png)\n")
    written = _write_results(out, "Server load benchmark", command, env, results, body)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    modes = [r.mode for r in runs]
    left.bar(modes, [r.tokens_per_second for r in runs], color=["C0", "C1"][: len(runs)])
    left.set_ylabel("tokens/s (all clients)")
    left.set_title(f"{runs[0].clients} streaming clients")
    left.grid(alpha=0.3)
    labels = ("TTFT p50", "TTFT p99", "ITL p50 x10", "ITL p99 x10")
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        values = (r.first_token_p50, r.first_token_p99, 10 * r.inter_token_p50, 10 * r.inter_token_p99)
        right.bar(np.arange(len(labels)) + i * width, values, width, label=f"lookahead {r.mode}")
    right.set_xticks(np.arange(len(labels)) + width * (len(runs) - 1) / 2, labels)
    right.set_ylabel("seconds")
    right.legend()
    return [*written, _save(fig, right, out / "serve.png")]


def write_parallel(out: Path, runs: list[ParallelRun], predictions: list[tuple[int, float, float]], env: dict,
                   command: str) -> list[Path]:
    results = {"runs": _as_dicts(runs, "tokens_per_second", "steps_per_second", "tokens_per_step"),
               "predictions": [{"devices": k, "rows_per_device": rows, "speedup": speedup}
                               for k, rows, speedup in predictions]}
    body = (f"{parallel_table(runs)}\n\n## Cost model\n\n{prediction_table(predictions, runs)}\n\n"
            "Predicted speedup: T(rows of the whole step) / T(rows per device, the load balanced), from the cost curve "
            "named above; the tokens committed per step do not change with the number of devices.\n\n"
            "![speedup](parallel.png)\n")
    written = _write_results(out, "Lookahead parallelism benchmark", command, env, results, body)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([k for k, _, _ in predictions], [s for _, _, s in predictions], marker="o", label="predicted")
    base = runs[0].tokens_per_second
    ax.plot([r.workers for r in runs], [r.tokens_per_second / base for r in runs], marker="s", label="measured")
    ax.set_xlabel("workers (devices)")
    ax.set_ylabel("speedup over one worker")
    ax.legend()
    return [*written, _save(fig, ax, out / "parallel.png")]


def fit_log_line(points: list[SweepPoint]) -> tuple[float, float] | None:
    """Least-squares fit tokens/step = a + b * ln(tokens fed per step); None where the points feed fewer than two
    different numbers of tokens a step (no slope to fit: numpy had made one up, with a RankWarning)."""
    if len({p.tokens_fed_per_step for p in points}) < 2:
        return None
    x = np.log([p.tokens_fed_per_step for p in points])
    slope, intercept = np.polyfit(x, [p.tokens_per_step for p in points], 1)
    return float(intercept), float(slope)


def write_sweep(out: Path, points: list[SweepPoint], env: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    fit = fit_log_line(points)
    (out / "sweep.json").write_text(  # no fit: null (NaN is no JSON)
        json.dumps({"environment": env, "fit": None if fit is None else {"intercept": fit[0], "slope": fit[1]},
                    "points": [asdict(p) for p in points]}, indent=1)
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    fed = [p.tokens_fed_per_step for p in points]
    ax.scatter(fed, [p.tokens_per_step for p in points])
    for p in points:
        ax.annotate(f"{p.window},{p.ngram},{p.guesses}", (p.tokens_fed_per_step, p.tokens_per_step), fontsize=6)
    if fit is not None:
        grid = np.linspace(min(fed), max(fed), 50)
        intercept, slope = fit
        ax.plot(grid, intercept + slope * np.log(grid), color="C1", label=f"{intercept:.2f} + {slope:.2f}·ln(fed)")
        ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel("tokens fed per step (log scale, ~ FLOPs per step)")
    ax.set_ylabel("tokens per step")
    return [out / "sweep.json", _save(fig, ax, out / "sweep.png")]


def _save(fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

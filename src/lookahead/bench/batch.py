"""Batch benchmark: the same prompts decoded B at a time by transformers' batched `generate` (static
batches, left-padded), and by our engine with B slots (continuous batching: a finished sequence's slot
takes the next prompt at once), plain and with lookahead, in one process; throughput and per-sequence
latency per batch size. The machines we measure on drift by up to 2x within minutes, so the methods run in
rounds, each round in the reverse order of the one before: over two rounds a drift linear in time costs each
method alike (the first and the last method each run first once and last once; the middle one, plain, runs in
the middle both times)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..config import AUTO_CONFIG, PLAIN_CONFIG, LookaheadConfig
from ..engine import Engine, RequestParams, eos_ids, pad_id

METHODS = ("transformers", "plain", "lookahead")


@dataclass(frozen=True)
class BatchRun:
    """One method on all the prompts, `batch_size` at a time."""

    method: str
    batch_size: int
    sequences: int  # decoded over all rounds (the prompts, once a round)
    new_tokens: int
    seconds: float
    latency: float  # mean seconds from a sequence's start to its last token
    steps: int | None  # ours: the steps each request took part in, summed
    identical: bool | None  # lookahead: every output equals our plain engine's at the same batch size

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens per step of a sequence."""
        return self.new_tokens / self.steps if self.steps else None


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


def _engine(model: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int, config: LookaheadConfig,
            batch_size: int, compile: bool = False) -> tuple[list[list[int]], float, list[float], int]:
    """Every prompt queued on one engine of `batch_size` slots: outputs, seconds, latencies (from a request's
    admission to its last token), and the steps of the requests summed."""
    start = time.perf_counter()
    engine = Engine(model, max_batch=batch_size, max_length=max(p.numel() for p in prompts) + max_new_tokens,
                    compile=compile)
    params = RequestParams(max_new_tokens=max_new_tokens, config=config)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    stats = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] += output.tokens
            if output.finished:
                stats[output.request_id] = output.stats
    seconds = time.perf_counter() - start
    return [outputs[i] for i in ids], seconds, [stats[i].seconds for i in ids], sum(stats[i].steps for i in ids)


def batch_runs(model: PreTrainedModel, prompts: Sequence[torch.Tensor], batch_sizes: Sequence[int],
               max_new_tokens: int, config: LookaheadConfig = AUTO_CONFIG,
               on_run: Callable[[BatchRun], None] | None = None, compile: bool = False, rounds: int = 2
               ) -> list[BatchRun]:
    """For each batch size, every prompt once per method and round, the methods of a round one after another
    in the reverse order of the round before. `compile`: our engines compile their steps, the step shapes
    compiled before anything is timed."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    Engine(model, max_batch=max(batch_sizes), compile=compile)  # measures the cost curves of every batch size, once
    runs = []
    for size in batch_sizes:
        Engine(model, max_batch=size, compile=compile).warm_up()  # compiled: one slot is a shape apart from several
        _transformers_batch(model, prompts[:size], 2)  # and transformers' at this size, as ours, before any timing
        decode = {"transformers": lambda: [(*_transformers_batch(model, prompts[i: i + size], max_new_tokens), None)
                                           for i in range(0, len(prompts), size)],
                  "plain": lambda: [_engine(model, prompts, max_new_tokens, PLAIN_CONFIG, size, compile)],
                  "lookahead": lambda: [_engine(model, prompts, max_new_tokens, config, size, compile)]}
        totals = {m: {"tokens": 0, "seconds": 0.0, "latency": 0.0, "steps": 0} for m in METHODS}
        identical = True
        for round_ in range(rounds):
            results = {method: decode[method]() for method in (METHODS[::-1] if round_ % 2 else METHODS)}
            identical &= results["lookahead"][0][0] == results["plain"][0][0]
            for method, parts in results.items():
                for outputs, seconds, latencies, steps in parts:
                    total = totals[method]
                    total["tokens"] += sum(map(len, outputs))
                    total["seconds"] += seconds
                    total["latency"] += sum(latencies)
                    total["steps"] += steps or 0
        for method in METHODS:
            total = totals[method]
            run = BatchRun(method, size, len(prompts) * rounds, total["tokens"], total["seconds"],
                           total["latency"] / (len(prompts) * rounds), total["steps"] or None,
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

"""Forward cost T(k) of k new tokens per step over a cached context, and the (W, N, G) sweep."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..config import LookaheadConfig
from ..generation import generate
from ..hf import HFModelRunner


@dataclass(frozen=True)
class CostPoint:
    tokens: int
    seconds: float  # median over repeats
    relative: float  # seconds / seconds at k = 1


def forward_cost(
    model: PreTrainedModel,
    context: int = 256,
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128),
    repeats: int = 5,
    packed_linear: bool | None = None,
) -> list[CostPoint]:
    """Median time of one forward of k tokens (causal among themselves, logits for all k) on top of a
    `context`-token cache, through the same path lookahead steps take."""
    runner = HFModelRunner(model, packed_linear=packed_linear)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    cache = runner.new_cache()
    runner.prefill(cache, torch.randint(vocab, (context,), generator=generator))
    medians = {}
    for k in sizes:
        tokens = torch.randint(vocab, (k,), generator=generator)
        allowed = torch.ones(k, k, dtype=torch.bool).tril()
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            runner.logits(cache, tokens, context + torch.arange(k), allowed, torch.arange(k))
            times.append(time.perf_counter() - start)
            runner.commit(cache, context, torch.zeros(0, dtype=torch.long))
        medians[k] = statistics.median(times[1:])
    base = medians[sizes[0]]
    return [CostPoint(k, medians[k], medians[k] / base) for k in sizes]


@dataclass(frozen=True)
class SweepPoint:
    window: int
    ngram: int
    guesses: int
    tokens_fed_per_step: float
    tokens_per_step: float
    seconds: float


def sweep(
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
    windows: list[int],
    ngrams: list[int],
    guesses: list[int],
    max_new_tokens: int,
) -> list[SweepPoint]:
    points = []
    for window, ngram, guess in itertools.product(windows, ngrams, guesses):
        config = LookaheadConfig(window=window, ngram=ngram, guesses=guess)
        new = steps = fed = 0
        seconds = 0.0
        for input_ids in prompts:
            stats = generate(model, input_ids, max_new_tokens=max_new_tokens, config=config).stats
            new, steps, fed, seconds = new + stats.new_tokens, steps + stats.steps, fed + stats.tokens_fed, seconds + stats.seconds
        points.append(SweepPoint(window, ngram, guess, fed / steps, new / steps, seconds))
    return points

"""The (W, N, G) sweep: tokens per step against tokens fed per step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..config import LookaheadConfig
from ..generation import generate


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
            stats = generate(model, input_ids, max_new_tokens=max_new_tokens, config=config, do_sample=False).stats
            new, steps, fed, seconds = new + stats.new_tokens, steps + stats.steps, fed + stats.tokens_fed, seconds + stats.seconds
        points.append(SweepPoint(window, ngram, guess, fed / steps, new / steps, seconds))
    return points

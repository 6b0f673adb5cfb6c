"""Per-sequence lookahead state: plans each step's input and turns the model's predictions into tokens.

Framework-free: the caller runs the model on `StepPlan.tokens` at `last_position + layout.offsets` with
`layout.allowed` as attention, and hands back the argmax at `layout.logit_rows`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..config import LookaheadConfig
from .layout import StepLayout, step_layout
from .pool import NGramPool
from .verify import Verdict, verify_greedy
from .window import LookaheadWindow


@dataclass(frozen=True)
class StepPlan:
    tokens: torch.Tensor  # [q] long, in layout row order
    layout: StepLayout
    guesses: torch.Tensor  # [G, M] long


@dataclass(frozen=True)
class StepResult:
    tokens: list[int]  # committed this step, in order
    kept_rows: torch.Tensor  # rows of the step whose KV entries belong to the committed sequence


class LookaheadDecoder:
    def __init__(self, config: LookaheadConfig, prompt: list[int]) -> None:
        self.config = config
        self.pool = NGramPool(config.ngram, config.guesses)
        if config.seed_from_prompt:
            self.pool.add_all(prompt)
        rng = random.Random(config.seed)
        self.window = LookaheadWindow(rng.choices(prompt, k=config.window), config.levels)

    def plan(self, last_token: int) -> StepPlan:
        continuations = self.pool.continuations(last_token)[: self.config.guesses]
        guess_len = self.config.ngram - 1
        guesses = torch.tensor(continuations, dtype=torch.long).view(len(continuations), guess_len)
        layout = step_layout(len(self.window.levels), self.window.width, len(continuations), guess_len)
        tokens = torch.cat([torch.tensor([last_token] + self.window.tokens), guesses.flatten()])
        return StepPlan(tokens, layout, guesses)

    def update(self, plan: StepPlan, predictions: torch.Tensor) -> StepResult:
        """predictions: argmax at `plan.layout.logit_rows`, in that order."""
        width = plan.layout.window_rows.numel()
        values = predictions.tolist()
        guess_predictions = predictions[1 + width :].view_as(plan.guesses)
        verdict: Verdict = verify_greedy(values[0], plan.guesses, guess_predictions)
        if width:
            for ngram in self.window.advance(values[1 : 1 + width]):
                self.pool.add(ngram)
        kept = torch.zeros(1, dtype=torch.long)
        if verdict.matched:
            kept = torch.cat([kept, plan.layout.guess_rows[verdict.guess, : verdict.matched]])
        return StepResult(verdict.tokens, kept)

"""Per-sequence lookahead state: plans each step's input and turns the model's predictions into tokens.

Framework-free: the caller runs the model on `StepPlan.tokens` at `last_position + layout.offsets` with
`layout.allowed` as attention, and hands back the argmax at `layout.logit_rows`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..config import LookaheadConfig
from .layout import GuessTree, StepLayout, build_guess_tree, step_layout
from .pool import NGramPool
from .verify import Verdict, verify_greedy
from .window import LookaheadWindow


@dataclass(frozen=True)
class StepPlan:
    tokens: torch.Tensor  # [q] long, in layout row order
    layout: StepLayout
    guesses: torch.Tensor  # [G, M] long
    tree: GuessTree


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
        self.sequence = list(prompt)  # committed so far, for the n-grams of the output
        rng = random.Random(config.seed)
        self.window = LookaheadWindow(rng.choices(prompt, k=config.window), config.levels)

    def plan(self, last_token: int) -> StepPlan:
        continuations = self.pool.continuations(last_token)[: self.config.guesses]
        guess_len = self.config.ngram - 1
        guesses = torch.tensor(continuations, dtype=torch.long).view(len(continuations), guess_len)
        tree = build_guess_tree(continuations, guess_len)
        layout = step_layout(len(self.window.levels), self.window.width, tree)
        tokens = torch.tensor([last_token] + self.window.tokens + tree.tokens)
        return StepPlan(tokens, layout, guesses, tree)

    def update(self, plan: StepPlan, predictions: torch.Tensor) -> StepResult:
        """predictions: argmax at `plan.layout.logit_rows`, in that order."""
        width = plan.layout.window_rows.numel()
        values = predictions.tolist()
        guess_predictions = predictions[1 + width :][plan.tree.paths]
        verdict: Verdict = verify_greedy(values[0], plan.guesses, guess_predictions)
        if width:
            for ngram in self.window.advance(values[1 : 1 + width]):
                self.pool.add(ngram)
        self._learn_from_output(verdict.tokens)
        kept = torch.zeros(1, dtype=torch.long)
        if verdict.matched:
            kept = torch.cat([kept, plan.layout.guess_rows[verdict.guess, : verdict.matched]])
        return StepResult(verdict.tokens, kept)

    def _learn_from_output(self, committed: list[int]) -> None:
        """Pool the n-grams that end in the newly committed tokens (repetitions within the output)."""
        self.sequence.extend(committed)
        if not self.config.learn_from_output:
            return
        n, end = self.config.ngram, len(self.sequence)
        for stop in range(max(n, end - len(committed) + 1), end + 1):
            self.pool.add(self.sequence[stop - n : stop])

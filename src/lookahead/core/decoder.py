"""Per-sequence lookahead state: plans each step's input and turns the model's outputs into tokens.

Framework-free: the caller runs the model on `StepPlan.tokens` at `last_position + layout.offsets` with
`layout.allowed` as attention, and hands back the logits at `layout.logit_rows`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import LookaheadConfig
from .layout import GuessTree, StepLayout, build_guess_tree, step_layout
from .pool import NGramPool
from .verify import ROOT, ChooseRule, greedy_choice, verify_greedy, walk_tree
from .window import LookaheadWindow

# Scores a node's logits given the token ids before it ([1, L], [1, V] -> [1, V]), like a transformers
# LogitsProcessor; None leaves the logits as they are.
LogitsTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepPlan:
    tokens: torch.Tensor  # [q] long, in layout row order
    layout: StepLayout
    tree: GuessTree


@dataclass(frozen=True)
class StepResult:
    tokens: list[int]  # committed this step, in order
    kept_rows: torch.Tensor  # rows of the step whose KV entries belong to the committed sequence


class LookaheadDecoder:
    """choose: how a node's next token is picked (None: argmax); transform: applied to each node's logits
    first, with the committed tokens before that node (None: none)."""

    def __init__(
        self,
        config: LookaheadConfig,
        prompt: list[int],
        choose: ChooseRule | None = None,
        transform: LogitsTransform | None = None,
    ) -> None:
        self.config = config
        self.choose = choose
        self.transform = transform
        self.pool = NGramPool(config.ngram, config.guesses)
        if config.seed_from_prompt:
            self.pool.add_all(prompt)
        self.sequence = list(prompt)  # committed so far, for the n-grams of the output
        rng = random.Random(config.seed)
        self.window = LookaheadWindow(rng.choices(prompt, k=config.window), config.levels)

    def plan(self) -> StepPlan:
        """The next step's input: the last committed token, the window, and the guesses for what follows."""
        last_token = self.sequence[-1]
        continuations = self.pool.continuations(self.sequence)
        tree = build_guess_tree(continuations, self.config.ngram - 1)
        layout = step_layout(len(self.window.levels), self.window.width, tree)
        tokens = torch.tensor([last_token] + self.window.tokens + tree.tokens)
        return StepPlan(tokens, layout, tree)

    def update(self, plan: StepPlan, logits: torch.Tensor) -> StepResult:
        """logits: [len(plan.layout.logit_rows), vocab], the model's outputs at those rows in order."""
        width = plan.layout.window_rows.numel()
        if self.choose is None and self.transform is None:
            predictions = logits.argmax(dim=-1)
            verdict = verify_greedy(plan.tree, int(predictions[0]), predictions[1 + width :])
            window_outputs = predictions[1 : 1 + width].tolist()
        else:
            verdict = walk_tree(plan.tree, lambda node, accepted: self._scores(logits, width, node, accepted),
                                self.choose or greedy_choice)
            window_outputs = logits[1 : 1 + width].argmax(dim=-1).tolist()  # the window runs greedy Jacobi
        if width:
            for ngram in self.window.advance(window_outputs):
                self.pool.add(ngram)
        self._learn_from_output(verdict.tokens)
        kept = torch.tensor([0] + [plan.layout.tree_start + node for node in verdict.nodes], dtype=torch.long)
        return StepResult(verdict.tokens, kept)

    def _scores(self, logits: torch.Tensor, width: int, node: int, accepted: list[int]) -> torch.Tensor:
        row = logits[0 if node == ROOT else 1 + width + node]
        if self.transform is None:
            return row
        context = torch.tensor(self.sequence + accepted, device=logits.device).view(1, -1)
        return self.transform(context, row.view(1, -1))[0]

    def _learn_from_output(self, committed: list[int]) -> None:
        """Pool the n-grams that end in the newly committed tokens (repetitions within the output)."""
        self.sequence.extend(committed)
        if not self.config.learn_from_output:
            return
        n, end = self.config.ngram, len(self.sequence)
        for stop in range(max(n, end - len(committed) + 1), end + 1):
            self.pool.add_at(self.sequence, stop - n)

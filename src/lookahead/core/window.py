"""The 2-D lookahead window: W columns, up to N-1 levels of Jacobi iterations."""

from __future__ import annotations

from collections.abc import Sequence


class LookaheadWindow:
    """Levels of guessed tokens; level l, column i sits l + i + 1 positions after the last committed token.

    The model's output at the newest level's column i predicts the token one level further along that
    column. While the window fills up, each step's outputs become a new level. Once it holds N-1 levels,
    each column plus its output is an n-gram, the oldest level is dropped and the outputs are appended.
    """

    def __init__(self, first_level: Sequence[int], max_levels: int) -> None:
        self.width = len(first_level)
        self.max_levels = max_levels
        self.levels: list[list[int]] = [list(first_level)] if self.width else []

    @property
    def tokens(self) -> list[int]:
        """All window tokens, level by level."""
        return [token for level in self.levels for token in level]

    def advance(self, outputs: Sequence[int]) -> list[tuple[int, ...]]:
        """Take the outputs at the newest level; return the n-grams they complete (none while filling)."""
        outputs = list(outputs)
        if len(self.levels) < self.max_levels:
            self.levels.append(outputs)
            return []
        ngrams = [tuple(column) + (output,) for column, output in zip(zip(*self.levels), outputs)]
        self.levels = self.levels[1:] + [outputs]
        return ngrams

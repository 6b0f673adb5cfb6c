"""Recycled predictions: every row a step feeds yields the model's likeliest next tokens after that row's
token, whether or not the row is accepted (Token Recycling, Luo et al., 2024). Kept per token, the latest
prediction drafts continuations where no earlier text matches: a bonus token followed by the tokens the
model last predicted after it, and after those."""

from __future__ import annotations

from collections.abc import Sequence

from .drafts import Draft

# The deepest recycled draft: each token of a chain follows from a prediction made in another context,
# so acceptance falls fast with depth (docs/benchmarks.md).
RECYCLED_DEPTH = 8


class SuccessorTable:
    """token -> the tokens the model last ranked likeliest after it, best first. At most one entry per
    vocabulary token, so its memory is bounded by the vocabulary."""

    def __init__(self) -> None:
        self._next: dict[int, tuple[int, ...]] = {}

    def learn(self, tokens: Sequence[int], predicted: Sequence[Sequence[int]]) -> None:
        """`predicted[i]`: the likeliest tokens after `tokens[i]` in one forward, best first (later rows win)."""
        for token, successors in zip(tokens, predicted):
            self._next[token] = tuple(successors)

    def successors(self, token: int) -> tuple[int, ...]:
        return self._next.get(token, ())

    def chain(self, first: int, length: int) -> tuple[int, ...]:
        """`first`, then the likeliest successor of each token in turn, `length` tokens at most."""
        path = [first]
        while len(path) < length:
            following = self._next.get(path[-1])
            if not following:
                break
            path.append(following[0])
        return tuple(path)

    def clear(self) -> None:
        self._next.clear()

    def __len__(self) -> int:
        return len(self._next)


class RecycleProposer:
    """Drafts from a successor table, as a tree: the likeliest chain after the text's last token; the same
    first token followed by its runners-up (`branches` - 2 of them); then each runner-up of the first token
    (`branches` - 1), every draft continued by the likeliest successor chain. The table learns from every
    fed row's logits (see `learn`). Branching at the second token too measured 2.36 against 2.27 tokens per
    step where up to 64 nodes were fed (docs/benchmarks.md)."""

    name = "recycle"

    def __init__(self, table: SuccessorTable, branches: int) -> None:
        self.table = table
        self.branches = branches

    def propose(self, text: Sequence[int], limit: int) -> list[Draft]:
        depth = min(limit, RECYCLED_DEPTH)
        firsts = self.table.successors(text[-1])[: self.branches]
        if not firsts:
            return []
        best = firsts[0]
        paths = [self.table.chain(best, depth)]
        paths += [(best, *self.table.chain(second, depth - 1))
                  for second in self.table.successors(best)[1 : self.branches - 1] if depth > 1]
        paths += [self.table.chain(first, depth) for first in firsts[1:]]
        return [Draft(path, self.name) for path in paths]

    def observe(self, text: Sequence[int], new: int) -> None:
        """Committed text teaches it nothing the model's predictions (`learn`) do not."""

    def learn(self, tokens: Sequence[int], predicted: Sequence[Sequence[int]]) -> None:
        self.table.learn(tokens, predicted)

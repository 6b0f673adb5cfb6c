"""The n-gram pool: continuations keyed by their first token, most recent first."""

from __future__ import annotations

from collections.abc import Sequence


class NGramPool:
    """Keeps at most `capacity` distinct continuations (the N-1 tokens after the key) per first token."""

    def __init__(self, ngram: int, capacity: int) -> None:
        self.ngram = ngram
        self.capacity = capacity
        self._by_first: dict[int, list[tuple[int, ...]]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        if self.capacity == 0:
            return
        first, continuation = ngram[0], tuple(ngram[1:])
        entries = self._by_first.setdefault(first, [])
        if continuation in entries:
            entries.remove(continuation)
        entries.insert(0, continuation)
        del entries[self.capacity :]

    def add_all(self, tokens: Sequence[int]) -> None:
        """Add every n-gram of a token sequence, in order (later ones end up first)."""
        for start in range(len(tokens) - self.ngram + 1):
            self.add(tokens[start : start + self.ngram])

    def continuations(self, first: int) -> list[tuple[int, ...]]:
        return self._by_first.get(first, [])

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_first.values())

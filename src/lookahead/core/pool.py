"""The n-gram pool: continuations keyed by their first token, ranked by how much context they share
with the text being generated, then by recency."""

from __future__ import annotations

from collections.abc import Sequence

from .drafts import Draft

Continuation = tuple[int, ...]


class NGramPool:
    """Keeps at most `capacity` distinct continuations (the N-1 tokens after the first) per key.

    An n-gram seen in a text is filed under its first token and also under that token together with
    the up to `context - 1` tokens before it. A lookup with the text's last tokens takes the
    continuations of the longest matching key first (a longer shared context makes them likelier),
    then those of shorter keys, most recent first at each length. Window n-grams come without context
    and are filed under their first token only.
    """

    def __init__(self, ngram: int, capacity: int, context: int = 3) -> None:
        self.ngram = ngram
        self.capacity = capacity
        self.context = context
        self._by_key: dict[tuple[int, ...], list[Continuation]] = {}

    def add(self, ngram: Sequence[int], before: Sequence[int] = ()) -> None:
        """File an n-gram; `before`: the tokens that preceded it in its text, if any."""
        if self.capacity == 0:
            return
        first, continuation = ngram[0], tuple(ngram[1:])
        history = tuple(before[max(len(before) - self.context + 1, 0) :])
        for length in range(len(history) + 1):
            entries = self._by_key.setdefault(history[len(history) - length :] + (first,), [])
            if continuation in entries:
                entries.remove(continuation)
            entries.insert(0, continuation)
            del entries[self.capacity :]

    def add_at(self, text: Sequence[int], start: int) -> None:
        """File the n-gram of a text that begins at `start`, with the tokens before it as its context."""
        self.add(text[start : start + self.ngram], text[max(0, start - self.context + 1) : start])

    def add_ending_in(self, text: Sequence[int], new: int) -> None:
        """File the n-grams of a text that end in its last `new` tokens, with their context, in order."""
        for start in range(max(0, len(text) - new - self.ngram + 1), len(text) - self.ngram + 1):
            self.add_at(text, start)

    def continuations(self, text: Sequence[int]) -> list[Continuation]:
        """Up to `capacity` continuations of the text's last token, best-matching context first."""
        return [continuation for continuation, _ in self.ranked(text)]

    def ranked(self, text: Sequence[int]) -> list[tuple[Continuation, int]]:
        """`continuations`, each with the length of the key it was found under (1 + shared context)."""
        found: dict[Continuation, int] = {}
        for length in range(min(self.context, len(text)), 0, -1):
            for continuation in self._by_key.get(tuple(text[len(text) - length :]), ()):
                if continuation not in found:
                    found[continuation] = length
                    if len(found) == self.capacity:
                        return list(found.items())
        return list(found.items())

    def __len__(self) -> int:
        """Distinct (first token, continuation) pairs held."""
        return sum(len(entries) for key, entries in self._by_key.items() if len(key) == 1)


class PoolProposer:
    """The n-gram pool as a draft source: the continuations filed under the text's last tokens; it files
    the n-grams that end in newly committed tokens."""

    name = "pool"

    def __init__(self, pool: NGramPool) -> None:
        self.pool = pool

    def propose(self, text: Sequence[int], limit: int) -> list[Draft]:
        return [Draft(continuation[:limit], self.name, context) for continuation, context in self.pool.ranked(text)]

    def observe(self, text: Sequence[int], new: int) -> None:
        self.pool.add_ending_in(text, new)

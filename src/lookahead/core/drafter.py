"""The drafter: merges every source's drafts into one token tree and keeps the nodes worth their cost.

Each node's chance of being accepted is estimated online, per source, matched-context length and depth;
a step of k fed tokens costs T(k) (the forward cost curve of the model on this device). The tree keeps
the k likeliest nodes that maximise (1 + expected accepted tokens) / T(k): a step is cheap where extra
rows are nearly free (a GPU) and lean where they are not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .drafts import Draft
from .layout import GuessTree, build_guess_tree


def _context_bucket(context: int) -> int:
    """1, 2, 4, 8 or 16: matched-context lengths binned by powers of two."""
    return min(1 << (max(context, 1).bit_length() - 1), 16)


def _ranked(drafts: Sequence[Draft]) -> list[tuple[Draft, int]]:
    """Each draft with its rank among its source's drafts (sources list their best first), capped at 3."""
    seen: dict[str, int] = {}
    ranked = []
    for draft in drafts:
        rank = seen.get(draft.source, 0)
        seen[draft.source] = rank + 1
        ranked.append((draft, min(rank, 3)))
    return ranked


class AcceptanceStats:
    """P(the model agrees with a draft's d-th token | it agreed with the d-1 before), per (source, rank
    among that source's drafts, matched-context bin, depth), counted from every draft of every step
    against what was committed."""

    def __init__(self, prior_accepted: float = 1.0, prior_offered: float = 2.0) -> None:
        self._prior = (prior_accepted, prior_offered)
        self._counts: dict[tuple[str, int, int, int], list[float]] = {}

    def rate(self, draft: Draft, depth: int, rank: int = 0) -> float:
        key = (draft.source, rank, _context_bucket(draft.context), depth)
        accepted, offered = self._counts.get(key, (0.0, 0.0))
        return (accepted + self._prior[0]) / (offered + self._prior[1])

    def record(self, drafts: Sequence[Draft], committed: Sequence[int]) -> None:
        """`committed`: the tokens the step committed (the model's own choices), so each draft is scored
        as deep as they reach, whether or not its tokens were fed. `drafts` in the order they were
        proposed, as given to `merge_drafts`."""
        for draft, rank in _ranked(drafts):
            key = (draft.source, rank, _context_bucket(draft.context))
            for depth, (guessed, actual) in enumerate(zip(draft.tokens, committed), start=1):
                counts = self._counts.setdefault((*key, depth), [0.0, 0.0])
                counts[1] += 1
                if guessed != actual:
                    break
                counts[0] += 1


@dataclass(frozen=True)
class DraftTree:
    tree: GuessTree
    sources: tuple[str, ...]  # per node: the source of the likeliest draft through it
    expected: float  # expected accepted guess tokens (the bonus token not counted)


def merge_drafts(
    drafts: Sequence[Draft],
    stats: AcceptanceStats,
    cost: Callable[[int], float] | None,
    fixed_rows: int,
    max_nodes: int | None,
) -> DraftTree:
    """One token tree from the drafts: every node when `cost` is None, else the likeliest nodes that maximise
    expected tokens per unit of step cost; at most `max_nodes` (None: no cap). `fixed_rows`: rows the step
    feeds anyway (the last token and the window)."""
    probability: dict[tuple[int, ...], float] = {}  # node (the prefix that ends in it) -> best estimate
    source: dict[tuple[int, ...], str] = {}
    for draft, rank in _ranked(drafts):
        chance = 1.0
        for depth in range(1, len(draft.tokens) + 1):
            chance *= stats.rate(draft, depth, rank)
            prefix = draft.tokens[:depth]
            if chance > probability.get(prefix, -1.0):
                probability[prefix], source[prefix] = chance, draft.source
    # Likeliest first; a node is never likelier than its parent, and ties put the shallower first, so any
    # leading run of this order is a tree (every node's parent comes before it).
    order = sorted(probability, key=lambda prefix: (-probability[prefix], len(prefix)))[:max_nodes]
    if cost is not None:
        best_value, best_count, expected = 1.0 / cost(fixed_rows), 0, 1.0
        for count, prefix in enumerate(order, start=1):
            expected += probability[prefix]
            value = expected / cost(fixed_rows + count)
            if value > best_value:
                best_value, best_count = value, count
        order = order[:best_count]
    # Each kept node is given as the prefix that ends in it: the tree's nodes come in this same order.
    return DraftTree(build_guess_tree(order), tuple(source[p] for p in order), sum(probability[p] for p in order))


# The window's rows must be nearly free to be worth it: it feeds the pool rather than the step's output.
WINDOW_COST_TOLERANCE = 1.1


def window_width(cost: Callable[[int], float], max_width: int, levels: int) -> int:
    """The widest window (at most `max_width` columns of `levels` rows) whose rows are nearly free: a step
    of the last token and the window costs at most WINDOW_COST_TOLERANCE times a one-token step."""
    return max(w for w in range(max_width + 1) if cost(1 + w * levels) <= WINDOW_COST_TOLERANCE * cost(1))

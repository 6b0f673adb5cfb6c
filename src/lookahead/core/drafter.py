"""The drafter: merges every source's drafts into one token tree and keeps the nodes worth their cost.

Each node's chance of being accepted is estimated online, per source, matched-context length and depth;
a step of B sequences padded to h rows each costs T(B, h) (the forward cost of the model on this device).
Every sequence keeps its h likeliest rows, with h maximising (expected tokens of the batch) / T(B, h): a
step is wide where extra rows are nearly free (a GPU, a small batch) and lean where they are not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

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
    against what was committed. Counts are halved once a kind has been offered `memory` times, so the
    estimates follow a workload that changes (the stats outlive a request: see `engine.acceptance_stats`)."""

    def __init__(self, prior_accepted: float = 1.0, prior_offered: float = 2.0, memory: float = 1000.0) -> None:
        self._prior = (prior_accepted, prior_offered)
        self._memory = memory
        self._counts: dict[tuple[str, int, int, int], list[float]] = {}
        self._top_expected = self._top_accepted = 0.0

    @property
    def calibration(self) -> float:
        """How often the likeliest node of a step was right, over how often `rate` said it would be: the
        ranking favours the drafts whose estimates came out highest, which overstates them, and rarely
        seen kinds of drafts start at the prior; the budget scales its estimates by this factor. It is
        learnt whether or not the node was fed, so a budget that stopped feeding can start again."""
        return (self._top_accepted + 1.0) / (self._top_expected + 1.0)

    def record_top(self, probability: float, accepted: bool) -> None:
        """A step's likeliest node: its estimated chance, and whether the committed text began with it."""
        self._top_expected += probability
        self._top_accepted += accepted
        if self._top_expected >= self._memory:
            self._top_expected /= 2
            self._top_accepted /= 2

    def rate(self, draft: Draft, depth: int, rank: int = 0) -> float:
        key = (draft.source, rank, _context_bucket(draft.context), depth)
        accepted, offered = self._counts.get(key, (0.0, 0.0))
        return (accepted + self._prior[0]) / (offered + self._prior[1])

    def record(self, drafts: Sequence[Draft], committed: Sequence[int]) -> None:
        """`committed`: the tokens the step committed (the model's own choices), so each draft is scored
        as deep as they reach, whether or not its tokens were fed. `drafts` in the order they were
        proposed, as given to `rank_nodes`."""
        for draft, rank in _ranked(drafts):
            key = (draft.source, rank, _context_bucket(draft.context))
            for depth, (guessed, actual) in enumerate(zip(draft.tokens, committed), start=1):
                counts = self._counts.setdefault((*key, depth), [0.0, 0.0])
                if counts[1] >= self._memory:
                    counts[0] /= 2
                    counts[1] /= 2
                counts[1] += 1
                if guessed != actual:
                    break
                counts[0] += 1


@dataclass(frozen=True)
class DraftTree:
    tree: GuessTree
    sources: tuple[str, ...]  # per node: the source of the likeliest draft through it
    expected: float  # expected accepted guess tokens (the bonus token not counted)


@dataclass(frozen=True)
class RankedNodes:
    """Every node the drafts offer, likeliest first: any leading run of them is a tree."""

    prefixes: list[tuple[int, ...]]  # each node as the prefix that ends in it
    probabilities: list[float]  # estimated chance that the node is accepted
    sources: list[str]  # the source of the likeliest draft through each node

    def tree(self, count: int) -> DraftTree:
        """The tree of the `count` likeliest nodes; its nodes come in this same order."""
        kept = self.prefixes[:count]
        return DraftTree(build_guess_tree(kept), tuple(self.sources[:count]), sum(self.probabilities[:count]))


def rank_nodes(drafts: Sequence[Draft], stats: AcceptanceStats, max_nodes: int | None) -> RankedNodes:
    """The drafts' nodes, merged (drafts that share a prefix share its nodes) and ranked by estimated
    acceptance; at most `max_nodes` (None: no cap)."""
    probability: dict[tuple[int, ...], float] = {}  # node (the prefix that ends in it) -> best estimate
    source: dict[tuple[int, ...], str] = {}
    for draft, rank in _ranked(drafts):
        chance = 1.0
        for depth in range(1, len(draft.tokens) + 1):
            chance *= stats.rate(draft, depth, rank)
            prefix = draft.tokens[:depth]
            if chance > probability.get(prefix, -1.0):
                probability[prefix], source[prefix] = chance, draft.source
    # A node is never likelier than its parent, and ties put the shallower first, so any leading run of
    # this order is a tree (every node's parent comes before it).
    order = sorted(probability, key=lambda prefix: (-probability[prefix], len(prefix)))[:max_nodes]
    return RankedNodes(order, [probability[p] for p in order], [source[p] for p in order])


@dataclass(frozen=True)
class RowDemand:
    """What one sequence asks of a step: `base` rows it feeds anyway (the last token, the window), then
    candidate nodes with acceptance chances `gains` (likeliest first); at most `most` rows in all."""

    base: int
    gains: Sequence[float]
    flexible: bool  # the budget may feed fewer nodes (False: feed every node, an unbudgeted config)
    most: int

    def nodes_within(self, height: int) -> int:
        return max(0, min(len(self.gains), min(height, self.most) - self.base))


def node_counts(demands: Sequence[RowDemand], cost: Callable[[int], float] | None) -> list[int]:
    """How many nodes each sequence of a step feeds. The step is one forward of every sequence padded to a
    common height h, costing `cost(h)` (the batch's T(B, h), relative) whatever each one uses: h maximises
    the batch's expected tokens (one per sequence plus its accepted nodes) per unit of cost, and every
    sequence fills its h rows with its likeliest nodes. Unbudgeted sequences feed all their nodes. Where a
    larger batch makes rows dearer, the tree shrinks towards plain decoding. `cost` None: every node."""
    if not demands:
        return []
    tallest = max(min(d.most, d.base + len(d.gains)) for d in demands)
    floor = max(min(d.most, d.base + (0 if d.flexible else len(d.gains))) for d in demands)
    height = tallest
    if cost is not None and any(d.flexible for d in demands):
        best_value = -1.0
        gained = [list(accumulate(d.gains, initial=0.0)) for d in demands]  # gained[b][n]: its first n nodes'
        for h in range(floor, tallest + 1):
            expected = sum(1.0 + sums[d.nodes_within(h)] for d, sums in zip(demands, gained))
            value = expected / cost(h)
            if value > best_value:
                best_value, height = value, h
    return [d.nodes_within(height) for d in demands]


# The window's rows must be nearly free to be worth it: it feeds the pool rather than the step's output.
WINDOW_COST_TOLERANCE = 1.1


def window_width(cost: Callable[[int], float], max_width: int, levels: int) -> int:
    """The widest window (at most `max_width` columns of `levels` rows) whose rows are nearly free: a step
    whose sequences each feed their last token and the window costs at most WINDOW_COST_TOLERANCE times a
    step of one token each (`cost`: relative cost of a step by its height)."""
    return max(w for w in range(max_width + 1) if cost(1 + w * levels) <= WINDOW_COST_TOLERANCE * cost(1))

"""The drafter: acceptance statistics, the merge of drafts into one tree, and the budget it keeps to."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.core.drafter import (
    WINDOW_COST_TOLERANCE,
    AcceptanceStats,
    RowDemand,
    node_counts,
    rank_nodes,
    window_width,
)
from lookahead.core.drafts import Draft


def merged_tree(drafts, stats, cost, fixed_rows, max_nodes):
    """One sequence's tree as a step of its own: its ranked nodes, as many as the budget keeps."""
    ranked = rank_nodes(drafts, stats, max_nodes)
    demand = RowDemand(fixed_rows, ranked.probabilities, cost is not None, fixed_rows + len(ranked.prefixes))
    return ranked.tree(node_counts([demand], cost)[0])


def test_stats_score_each_draft_as_deep_as_the_committed_tokens_reach():
    stats = AcceptanceStats()
    draft = Draft((5, 6, 7, 8), "suffix", context=3)
    stats.record([draft], [5, 6, 9])  # agrees twice, then differs at depth 3; depth 4 is never scored
    assert stats.rate(draft, 1) == pytest.approx((1 + 1) / (1 + 2))
    assert stats.rate(draft, 3) == pytest.approx((0 + 1) / (1 + 2))
    assert stats.rate(draft, 4) == pytest.approx(0.5)  # the prior alone
    assert stats.rate(Draft((5,), "suffix", context=2), 1) == pytest.approx(2 / 3)  # contexts 2 and 3 share a bin
    assert stats.rate(Draft((5,), "suffix", context=4), 1) == pytest.approx(0.5)  # another bin
    assert stats.rate(Draft((5,), "pool", context=3), 1) == pytest.approx(0.5)  # another source
    assert stats.rate(draft, 1, rank=1) == pytest.approx(0.5)  # another rank within the source
    stats.record([Draft((1, 2), "pool"), Draft((3, 4), "pool")], [3])  # the second-ranked draft was right
    assert stats.rate(Draft((1, 2), "pool"), 1) == pytest.approx(1 / 3)
    assert stats.rate(Draft((1, 2), "pool"), 1, rank=1) == pytest.approx(2 / 3)


def test_stats_follow_a_workload_that_changes():
    """Counts are halved past `memory` offers, so a kind of draft that stops being accepted loses its
    estimate within a few hundred offers, where counts kept for good would still rate it high."""
    draft = Draft((5,), "suffix", context=1)
    forgetting, lasting = AcceptanceStats(memory=50), AcceptanceStats(memory=float("inf"))
    for stats in (forgetting, lasting):
        for _ in range(500):
            stats.record([draft], [5])
        for _ in range(100):
            stats.record([draft], [6])
    assert forgetting.rate(draft, 1) < 0.2
    assert lasting.rate(draft, 1) == pytest.approx(501 / 602)


def test_without_a_cost_every_node_is_kept_and_shared_prefixes_are_merged():
    drafts = [Draft((1, 2, 3), "pool"), Draft((1, 2, 4, 5), "suffix", 4), Draft((6,), "pool")]
    merged = merged_tree(drafts, AcceptanceStats(), None, fixed_rows=1, max_nodes=None)
    nodes = {tuple(merged.tree.tokens[n] for n in _path(merged.tree.parents, node)) for node in range(len(merged.tree.tokens))}
    assert nodes == {(1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 2, 4, 5), (6,)}
    assert all(parent < node for node, parent in enumerate(merged.tree.parents))
    assert merged.expected == pytest.approx(0.5 + 0.25 + 0.125 + 0.125 + 0.0625 + 0.5)


def test_a_linear_cost_keeps_only_the_nodes_that_pay():
    drafts = [Draft((1, 2, 3), "pool")]  # prior rates 0.5: nodes accepted with 0.5, 0.25, 0.125
    cheap = merged_tree(drafts, AcceptanceStats(), lambda k: 1 + 0.25 * (k - 1), fixed_rows=1, max_nodes=64)
    assert cheap.tree.tokens == [1]  # 1.5 / 1.25 = 1.2 beats 1.75 / 1.5 and 1 / 1
    free = merged_tree(drafts, AcceptanceStats(), lambda k: 1.0, fixed_rows=1, max_nodes=2)
    assert free.tree.tokens == [1, 2]  # everything pays; the cap stops it
    dear = merged_tree(drafts, AcceptanceStats(), lambda k: float(k), fixed_rows=1, max_nodes=64)
    assert dear.tree.tokens == [] and dear.expected == 0


def _path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


drafts_strategy = st.lists(
    st.builds(Draft, st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple), st.sampled_from(["a", "b"]),
              st.integers(1, 6)),
    min_size=1, max_size=4,
)


@given(drafts=drafts_strategy, slope=st.floats(0.0, 1.5), outcomes=st.lists(st.integers(0, 2), max_size=4))
@settings(max_examples=150)
def test_the_kept_tree_is_the_best_of_all_subtrees(drafts, slope, outcomes):
    """Brute force: no prefix-closed set of nodes has a higher (1 + expected) / cost than the one kept."""
    stats = AcceptanceStats()
    stats.record(drafts, outcomes)  # some learned rates, so that sources and depths differ

    def cost(k):
        return 1 + slope * (k - 1)

    merged = merged_tree(drafts, stats, cost, fixed_rows=1, max_nodes=None)
    chance = {}
    ranks: dict[str, int] = {}
    for draft in drafts:
        rank = min(ranks.get(draft.source, 0), 3)
        ranks[draft.source] = ranks.get(draft.source, 0) + 1
        p = 1.0
        for depth in range(1, len(draft.tokens) + 1):
            p *= stats.rate(draft, depth, rank)
            chance[draft.tokens[:depth]] = max(chance.get(draft.tokens[:depth], 0.0), p)
    best = 1.0 / cost(1)
    nodes = list(chance)
    for size in range(1, len(nodes) + 1):
        for subset in itertools.combinations(nodes, size):
            if all(len(n) == 1 or n[:-1] in subset for n in subset):
                best = max(best, (1 + sum(chance[n] for n in subset)) / cost(1 + size))
    kept = (1 + merged.expected) / cost(1 + len(merged.tree.tokens))
    assert kept == pytest.approx(best)


def test_window_width_follows_the_cost_of_its_rows():
    assert window_width(lambda k: 1.0, 5, 3) == 5  # free rows: the widest window
    assert window_width(lambda k: float(k), 5, 3) == 0  # every row costs: none
    # 2% per extra row: a column of 3 rows adds 6%; within 10% of a one-token step only one column fits
    assert window_width(lambda k: 1 + 0.02 * (k - 1), 5, 3) == 1


def test_stats_bin_matched_contexts_by_powers_of_two():
    bins = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 7: 2, 8: 3, 15: 3, 16: 4, 31: 4, 32: 4, 100: 4}  # 1 | 2-3 | 4-7 | 8-15 | 16+
    for recorded in bins:
        stats = AcceptanceStats()
        stats.record([Draft((5,), "s", recorded)], [5])
        for asked in bins:
            shared = stats.rate(Draft((5,), "s", asked), 1) != pytest.approx(0.5)
            assert shared == (bins[recorded] == bins[asked]), (recorded, asked)


def test_stats_share_one_estimate_for_ranks_past_the_third():
    stats = AcceptanceStats()
    stats.record([Draft((token,), "s") for token in range(6)], [3])  # ranks 0..5; only rank 3 is right
    assert stats.rate(Draft((0,), "s"), 1, rank=3) == pytest.approx((1 + 1) / (3 + 2))  # ranks 3, 4 and 5
    assert stats.rate(Draft((0,), "s"), 1, rank=4) == pytest.approx(0.5)  # never recorded apart


def test_stats_accumulate_over_steps():
    stats = AcceptanceStats()
    draft = Draft((5, 6), "s")
    for committed in ([5, 6], [5, 7], [5, 6]):
        stats.record([draft], committed)
    assert stats.rate(draft, 1) == pytest.approx((3 + 1) / (3 + 2))
    assert stats.rate(draft, 2) == pytest.approx((2 + 1) / (3 + 2))


def test_a_node_keeps_the_likeliest_source_and_the_first_on_ties():
    stats = AcceptanceStats()
    stats.record([Draft((9,), "b")], [8])  # b's first tokens were wrong once: rate 1/3 against a's prior 1/2
    for drafts in ([Draft((1,), "a"), Draft((1,), "b")], [Draft((1,), "b"), Draft((1,), "a")]):
        merged = merged_tree(drafts, stats, None, fixed_rows=1, max_nodes=None)
        assert merged.sources == ("a",) and merged.expected == pytest.approx(0.5)
    tie = merged_tree([Draft((1, 2), "a"), Draft((1, 3), "c")], AcceptanceStats(), None, fixed_rows=1, max_nodes=None)
    assert tie.tree.tokens == [1, 2, 3] and tie.sources == ("a", "a", "c")


def test_a_node_that_only_breaks_even_is_not_fed():
    # one node accepted with 1/2: (1 + 0.5) / 1.5 == 1 / 1, the value of feeding nothing
    merged = merged_tree([Draft((1,), "a")], AcceptanceStats(), lambda k: 1.0 if k == 1 else 1.5, fixed_rows=1,
                          max_nodes=64)
    assert merged.tree.tokens == []


def test_the_choices_do_not_depend_on_the_cost_unit():
    drafts = [Draft((1, 2, 3), "pool"), Draft((4,), "pool")]
    costs = [lambda k: 1.0, lambda k: 1 + 0.25 * (k - 1), lambda k: 1 + 0.02 * (k - 1), lambda k: float(k)]
    for cost in costs:
        def scaled(k, cost=cost):
            return 3.0 * cost(k)
        for fixed_rows in (1, 3):
            kept = merged_tree(drafts, AcceptanceStats(), cost, fixed_rows, max_nodes=64).tree.tokens
            assert merged_tree(drafts, AcceptanceStats(), scaled, fixed_rows, max_nodes=64).tree.tokens == kept
        assert window_width(scaled, 5, 3) == window_width(cost, 5, 3)
    assert merged_tree(drafts, AcceptanceStats(), lambda k: 3.0, 3, max_nodes=64).tree.tokens == [1, 4, 2, 3]
    assert window_width(lambda k: 3.0, 5, 3) == 5


def test_window_rows_costing_exactly_the_tolerance_still_fit():
    def cost(k):  # one column of 3 rows costs exactly WINDOW_COST_TOLERANCE times a one-token step
        return 1.0 if k == 1 else WINDOW_COST_TOLERANCE if k <= 4 else 2.0
    assert window_width(cost, 5, 3) == 1


def _best_height(demands, cost):
    """Brute force: the height with the most expected tokens per unit of cost (the lowest such)."""
    tallest = max(min(d.most, d.base + len(d.gains)) for d in demands)
    floor = max(min(d.most, d.base + (0 if d.flexible else len(d.gains))) for d in demands)
    value = {h: sum(1 + sum(d.gains[: d.nodes_within(h)]) for d in demands) / cost(h) for h in range(floor, tallest + 1)}
    return min(h for h in value if value[h] == max(value.values()))


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(1, 4), st.lists(st.floats(0.01, 1.0), max_size=8), st.booleans(),
                          st.integers(1, 12)), min_size=1, max_size=5),
       st.floats(0.0, 0.5))
def test_node_counts_pad_every_sequence_to_the_best_common_height(raw, slope):
    demands = [RowDemand(base, sorted(gains, reverse=True), flexible, max(most, base))
               for base, gains, flexible, most in raw]

    def cost(h):
        return 1 + slope * (h - 1)

    counts = node_counts(demands, cost)
    if any(d.flexible for d in demands):
        height = _best_height(demands, cost)
    else:  # nothing to choose: every node of every sequence, within its cap
        height = max(min(d.most, d.base + len(d.gains)) for d in demands)
    assert counts == [d.nodes_within(height) for d in demands]
    for d, count in zip(demands, counts):
        assert d.base + count <= max(d.most, d.base) and count <= len(d.gains)


def test_a_dearer_batch_feeds_fewer_nodes_and_an_unbudgeted_sequence_sets_the_floor():
    gains = [0.6, 0.4, 0.3, 0.2]
    flexible = RowDemand(1, gains, True, 10)
    cheap = node_counts([flexible] * 8, lambda h: 1 + 0.05 * (h - 1))
    dear = node_counts([flexible] * 8, lambda h: 1 + 0.5 * (h - 1))
    assert cheap == [4] * 8 and dear == [1] * 8  # 0.6 pays for a 1.5x step, 0.4 more does not pay 2x
    assert node_counts([flexible] * 8, None) == [4] * 8
    fixed = RowDemand(1, [0.1] * 6, False, 10)  # an unbudgeted sequence feeds all 6 nodes: 7 rows for all
    assert node_counts([fixed, flexible], lambda h: float(h)) == [6, 4]  # the padding is free: filled


def test_calibration_scales_the_budget_by_how_often_the_likeliest_node_was_right():
    stats = AcceptanceStats()
    assert stats.calibration == 1.0  # no evidence: the estimates are taken as they are
    for accepted in (True, False, False, False):
        stats.record_top(0.5, accepted)
    assert stats.calibration == pytest.approx(2 / 3)  # (1 + 1) / (2 + 1)
    for _ in range(4):
        stats.record_top(0.25, True)  # under-estimates raise it
    assert stats.calibration == pytest.approx(6 / 4)


def test_stats_halve_a_kinds_counts_when_it_has_been_offered_memory_times():
    """A kind's counts are halved, accepted and offered alike, just before the offer that would take it past
    `memory` (here 3): [3, 3] becomes [1.5, 1.5], then the fourth offer, rejected, makes it [1.5, 2.5]."""
    stats = AcceptanceStats(memory=3.0)
    draft = Draft((5,), "s")
    for _ in range(3):
        stats.record([draft], [5])
    assert stats.rate(draft, 1) == pytest.approx((3 + 1) / (3 + 2))  # not halved before it is due
    stats.record([draft], [7])
    assert stats.rate(draft, 1) == pytest.approx((1.5 + 1) / (2.5 + 2))


def test_stats_remember_a_thousand_offers_by_default():
    stats = AcceptanceStats()
    draft = Draft((5,), "s")
    for _ in range(1000):
        stats.record([draft], [5])
    assert stats.rate(draft, 1) == pytest.approx((1000 + 1) / (1000 + 2))
    stats.record([draft], [5])  # [1000, 1000] halved to [500, 500], then counted
    assert stats.rate(draft, 1) == pytest.approx((501 + 1) / (501 + 2))


def test_calibration_halves_its_sums_once_the_expected_count_reaches_memory():
    """Expected 1.5 + 1.5 reaches `memory` (3): both sums are halved, to 1.5 expected and 1 accepted."""
    stats = AcceptanceStats(memory=3.0)
    stats.record_top(1.5, True)
    assert stats.calibration == pytest.approx((1 + 1) / (1.5 + 1))  # not halved before it is due
    stats.record_top(1.5, True)
    assert stats.calibration == pytest.approx((1 + 1) / (1.5 + 1))
    stats.record_top(1.0, False)
    assert stats.calibration == pytest.approx((1 + 1) / (2.5 + 1))

"""The framework-free pieces: step layout and mask, n-gram pool, window, verification."""

from __future__ import annotations

import itertools
import re

import numpy as np

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.config import LookaheadConfig
from lookahead.core.decoder import MAX_TREE_NODES, LookaheadDecoder
from test_drafter import merged_tree
from lookahead.core.drafter import AcceptanceStats
from lookahead.core.drafts import Draft
from lookahead.core.layout import build_guess_tree, step_layout
from lookahead.core.pool import NGramPool, PoolProposer
from lookahead.core.suffix import Corpus
from lookahead.core.verify import (
    ROOT, Verdict, _mix, greedy_choice, gumbel_noise, sample_choice, top_tokens, verify_greedy, walk_tree,
)
from lookahead.core.window import LookaheadWindow


def slow_layout(levels: int, width: int, guesses: list[tuple[int, ...]]):
    """Rows described one by one, written plainly, then every pair checked. A guess token is identified
    by the guess prefix that ends in it; equal prefixes are one row."""
    rows = [("last", 0, 0)]
    rows += [("window", level, column) for level in range(levels) for column in range(width)]
    for guess in guesses:
        for t in range(len(guess)):
            if ("guess", guess[: t + 1], 0) not in rows:
                rows.append(("guess", guess[: t + 1], 0))
    offsets, allowed = [], []
    for kind, a, b in rows:
        offsets.append(0 if kind == "last" else a + b + 1 if kind == "window" else len(a))
        line = []
        for c, (ckind, ca, cb) in enumerate(rows):
            if c == 0 or (kind, a, b) == (ckind, ca, cb):
                line.append(True)
            elif kind == "window" and ckind == "window":
                line.append((ca == 0 and cb <= b) or (cb == b and 1 <= ca <= a))
            elif kind == "guess" and ckind == "guess":
                line.append(a[: len(ca)] == ca)
            else:
                line.append(False)
        allowed.append(line)
    paths = [[rows.index(("guess", guess[: t + 1], 0)) for t in range(len(guess))] for guess in guesses]
    return offsets, allowed, paths


guess_lists = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6).map(tuple), max_size=5)  # ragged


@given(levels=st.integers(0, 4), width=st.integers(0, 5), guesses=guess_lists)
@settings(max_examples=80, deadline=None)
def test_layout_matches_plain_reference(levels, width, guesses):
    if levels == 0 or width == 0:
        levels = width = 0
    tree = build_guess_tree(guesses)
    layout = step_layout(levels, width, tree)
    offsets, allowed, paths = slow_layout(levels, width, guesses)
    assert layout.offsets.tolist() == offsets
    assert layout.allowed.tolist() == allowed
    rows = [[layout.tree_start + node for node in path if node >= 0] for path in tree.paths.tolist()]
    assert rows == paths and all(node == -1 for path in tree.paths.tolist() for node in path[len(path) - path.count(-1):])
    assert layout.size == 1 + levels * width + len({g[: t + 1] for g in guesses for t in range(len(g))})
    newest = list(range(1 + (levels - 1) * width, 1 + levels * width)) if levels else []
    assert layout.window_rows.tolist() == newest
    assert layout.logit_rows.tolist() == [0] + newest + list(range(1 + levels * width, layout.size))


def test_every_row_context_is_a_contiguous_chain():
    """What each row sees, sorted by position, must be positions 0..own position with no gap or repeat:
    that is what makes its prediction the same as a plain left-to-right pass would give."""
    tree = build_guess_tree([(1, 2, 3), (1, 2, 4), (5, 6, 7)])
    layout = step_layout(3, 4, tree)
    for row in range(layout.size):
        seen = sorted(layout.offsets[layout.allowed[row]].tolist())
        assert seen == list(range(int(layout.offsets[row]) + 1))


def test_shared_prefixes_are_fed_once():
    tree = build_guess_tree([(1, 2, 3), (1, 2, 4), (1, 5, 6)])
    assert tree.tokens == [1, 2, 3, 4, 5, 6]
    assert tree.parents == (-1, 0, 1, 1, 0, 4)
    assert tree.paths.tolist() == [[0, 1, 2], [0, 1, 3], [0, 4, 5]]


def test_pool_keeps_most_recent_distinct_continuations():
    pool = NGramPool(ngram=3, capacity=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([1, 2, 3])  # seen again: moves to the front, not duplicated
    assert pool.continuations([1]) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])
    assert pool.continuations([8, 1]) == [(6, 7), (2, 3)]
    assert pool.continuations([9]) == []
    assert len(pool) == 2


def test_pool_ranks_continuations_with_longer_shared_context_first():
    pool = NGramPool(ngram=3, capacity=3, context=3)
    pool.add_ending_in([7, 8, 1, 2, 3], 5)  # 1 -> (2, 3) after 7, 8
    pool.add_ending_in([5, 1, 4, 4], 4)  # 1 -> (4, 4) after 5
    pool.add([1, 6, 6])  # 1 -> (6, 6), from the window: no context
    assert pool.continuations([0, 0, 1]) == [(6, 6), (4, 4), (2, 3)]  # recency alone
    assert pool.continuations([0, 5, 1]) == [(4, 4), (6, 6), (2, 3)]
    assert pool.continuations([7, 8, 1]) == [(2, 3), (6, 6), (4, 4)]
    assert pool.continuations([9, 8, 1]) == [(2, 3), (6, 6), (4, 4)]  # shares two tokens
    assert len(pool) == 6  # every n-gram of both texts, once


def test_pool_keeps_all_the_context_a_short_text_has():
    """An n-gram near the start of a text, with fewer tokens before it than the pool's context takes, is filed
    under every shorter context it has (a negative slice start once cut the two tokens before it to one)."""
    pool = NGramPool(ngram=2, capacity=3, context=4)
    pool.add((7, 8), before=(1, 2))
    pool.add((7, 5), before=(0, 2))  # later, and sharing only the token before 7 with the text below
    assert pool.continuations([1, 2, 7]) == [(8,), (5,)]
    assert pool.continuations([3, 2, 7]) == [(5,), (8,)]  # recency where both share as much


def test_pool_from_sequence_and_zero_capacity():
    pool = NGramPool(ngram=2, capacity=3)
    pool.add_ending_in([5, 6, 5, 7], 4)
    assert pool.continuations([5]) == [(7,), (6,)]
    empty = NGramPool(ngram=2, capacity=0)
    empty.add_ending_in([5, 6, 5, 7], 4)
    assert len(empty) == 0


def test_window_fills_then_emits_ngrams_and_shifts():
    window = LookaheadWindow([10, 11, 12], max_levels=3)
    assert window.advance([20, 21, 22]) == []
    assert window.advance([30, 31, 32]) == []
    assert window.tokens == [10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert window.advance([40, 41, 42]) == [(10, 20, 30, 40), (11, 21, 31, 41), (12, 22, 32, 42)]
    assert window.levels == [[20, 21, 22], [30, 31, 32], [40, 41, 42]]


def test_verify_takes_longest_matching_prefix_plus_next_prediction():
    tree = build_guess_tree([(5, 9, 9), (5, 6, 7), (4, 6, 7)])  # nodes: 5, 9, 9', 6, 7, 4, 6', 7'
    # the model says 5 after the last token, and after each node:
    node_predictions = torch.tensor([6, 1, 1, 8, 3, 6, 7, 2])
    verdict = verify_greedy(tree, 5, node_predictions)
    assert verdict.tokens == [5, 6, 8] and verdict.nodes == [0, 3]


def test_verify_without_match_or_guesses_commits_one_token():
    assert verify_greedy(build_guess_tree([(4, 5)]), 3, torch.tensor([5, 6])).tokens == [3]
    assert verify_greedy(build_guess_tree([]), 3, torch.zeros(0, dtype=torch.long)) == Verdict([3], [])


def test_verify_over_guesses_of_different_lengths():
    tree = build_guess_tree([(5,), (5, 6, 7, 8, 9), (4, 1)])  # nodes: 5, 6, 7, 8, 9, 4, 1
    assert tree.paths.tolist() == [[0, -1, -1, -1, -1], [0, 1, 2, 3, 4], [5, 6, -1, -1, -1]]
    # the model agrees with 5, 6, 7 and then says 3
    verdict = verify_greedy(tree, 5, torch.tensor([6, 7, 3, 0, 0, 0, 0]))
    assert verdict.tokens == [5, 6, 7, 3] and verdict.nodes == [0, 1, 2]
    # a one-token guess fully accepted gets the model's next token after it
    short = verify_greedy(build_guess_tree([(5,), (4, 1, 2)]), 5, torch.tensor([2, 0, 0, 0]))
    assert short.tokens == [5, 2] and short.nodes == [0]


def test_verify_full_match_commits_guess_and_bonus_token():
    verdict = verify_greedy(build_guess_tree([(1, 2, 3)]), 1, torch.tensor([2, 3, 4]))
    assert verdict.tokens == [1, 2, 3, 4] and verdict.nodes == [0, 1, 2]


def test_greedy_walk_equals_vectorised_greedy():
    """The per-node walk (used when logits processors are on) agrees with the vectorised path."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(1, 6, (4,), generator=generator).tolist()  # ragged guesses
        guesses = [tuple(torch.randint(0, 3, (length,), generator=generator).tolist()) for length in lengths]
        tree = build_guess_tree(guesses)
        logits = torch.randn(1 + len(tree.tokens), 3, generator=generator)
        predictions = logits.argmax(dim=-1)
        fast = verify_greedy(tree, int(predictions[0]), predictions[1:])
        walked = walk_tree(tree, lambda node, accepted: logits[0 if node == ROOT else 1 + node], greedy_choice)
        assert fast == walked


# Pinned down by the mutation run (docs/mutation.md): cases the tests above leave open.


def test_pool_default_context_is_the_first_token_and_two_before_it():
    pool = NGramPool(ngram=2, capacity=2)
    pool.add_ending_in([9, 7, 8, 1, 2], 5)
    pool.add_ending_in([5, 7, 8, 1, 3], 5)
    # both 1s follow 7, 8; what came before that (9 or 5) is not looked at: recency decides
    assert pool.continuations([9, 7, 8, 1]) == [(3,), (2,)]
    assert pool.continuations([5, 7, 8, 1]) == [(3,), (2,)]


def test_pool_three_token_context_beats_two_token_context():
    direct, from_text = NGramPool(ngram=3, capacity=3), NGramPool(ngram=3, capacity=3)
    direct.add([1, 2, 3], before=[7, 8])
    direct.add([1, 4, 4], before=[9, 8])
    from_text.add_ending_in([7, 8, 1, 2, 3], 5)
    from_text.add_ending_in([9, 8, 1, 4, 4], 5)
    for pool in (direct, from_text):
        assert pool.continuations([7, 8, 1]) == [(2, 3), (4, 4)]  # 7, 8 shared: ahead of the more recent
        assert pool.continuations([9, 8, 1]) == [(4, 4), (2, 3)]
        assert pool.continuations([0, 8, 1]) == [(4, 4), (2, 3)]  # only 8 shared: recency


def test_pool_of_capacity_one_keeps_the_latest():
    pool = NGramPool(ngram=2, capacity=1)
    pool.add([1, 2])
    assert pool.continuations([1]) == [(2,)]
    pool.add([1, 3])
    assert pool.continuations([1]) == [(3,)] and len(pool) == 1


def test_empty_guess_tree_paths_index_like_a_long_tensor():
    tree = build_guess_tree([])
    assert tree.paths.dtype == torch.long and tree.paths.shape == (0, 0)
    assert torch.tensor([4, 5])[tree.paths].shape == (0, 0)


def test_layout_offsets_are_integer_positions():
    for levels, width, guesses in [(0, 0, []), (2, 3, []), (0, 0, [(1, 2)]), (3, 2, [(1, 2), (1, 3)])]:
        assert step_layout(levels, width, build_guess_tree(guesses)).offsets.dtype == torch.long


def test_window_without_rows_adds_nothing_to_the_layout():
    """Zero levels or zero columns: the same layout as no window at all, whatever the other dimension."""
    tree = build_guess_tree([(1, 2), (1, 3), (4, 5)])
    plain = step_layout(0, 0, tree)
    assert plain.window_rows.tolist() == [] and plain.logit_rows.tolist() == [0, 1, 2, 3, 4, 5]
    for levels, width in [(0, 4), (3, 0)]:
        layout = step_layout(levels, width, tree)
        assert layout.window_rows.tolist() == []
        assert layout.logit_rows.tolist() == plain.logit_rows.tolist()
        assert layout.offsets.tolist() == plain.offsets.tolist() and layout.tree_start == 1
        assert torch.equal(layout.allowed, plain.allowed)


def test_walk_scores_each_node_with_the_tokens_accepted_before_it():
    tree = build_guess_tree([(5, 6, 7), (5, 8, 9)])  # nodes: 5, 6, 7, 8, 9
    best = {ROOT: 5, 0: 8, 3: 9, 4: 2}  # the walk goes root -> 5 -> 8 -> 9, then 2 is new
    calls = []

    def scores_at(node, accepted):
        calls.append((node, list(accepted)))
        return torch.nn.functional.one_hot(torch.tensor(best[node]), 10).float()

    assert walk_tree(tree, scores_at, greedy_choice) == Verdict([5, 8, 9, 2], [0, 3, 4])
    assert calls == [(ROOT, []), (0, [5]), (3, [5, 8]), (4, [5, 8, 9])]


def test_the_noise_key_is_splitmix64():
    """Seeded samples must stay the same across versions: the (seed, position) key is splitmix64's output
    function, whose stream from state 0 starts e220a8397b1dcdaf, 6e789e6aa1b965f4, 06c45d188009454f
    (the published reference values); seed s and position p take state s * golden + p + 1."""
    assert [_mix(n, -1) for n in (1, 2, 3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert _mix(0, 0x9E3779B97F4A7C15 - 1) == 0xE220A8397B1DCDAF  # the same state reached by the position


def test_sampled_token_depends_on_seed_and_position_only():
    """The token drawn at a position is the same whatever the children offered and whatever the global RNG
    holds; a child is accepted exactly when it holds that token; other positions or seeds draw anew."""
    scores = torch.tensor([0.0, 0.2, -0.3, 0.1, 0.0])
    global_seeds = itertools.count()

    def draw(seed, position, candidates):
        torch.manual_seed(next(global_seeds))  # a new global state each call: it must not matter
        return sample_choice(scores, candidates, gumbel_noise(seed, position, 5))

    for seed in range(3):
        for position in range(20):
            token, node = draw(seed, position, [])
            assert node is None
            assert draw(seed, position, [(token, 7)]) == (token, 7)
            assert draw(seed, position, [((token + 1) % 5, 7), ((token + 2) % 5, 8)]) == (token, None)
    tokens = [draw(0, position, [])[0] for position in range(40)]
    assert set(tokens) == set(range(5))  # every token turns up
    assert tokens != [draw(1, position, [])[0] for position in range(40)]  # another seed, other tokens


VOCAB = 10


def _logits(highest: list[int], lowest: list[int] | None = None) -> torch.Tensor:
    """One row per entry: noise in [0, 1), with 5 on the `highest` token and -5 on the `lowest` one."""
    logits = torch.rand(len(highest), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(highest)), torch.tensor(highest)] = 5.0
    if lowest is not None:
        logits[torch.arange(len(lowest)), torch.tensor(lowest)] = -5.0
    return logits


# Prompt 5 6 7 5 6 8 5: its n-grams give the last token 5 the guesses (6, 8) and (6, 7), merged into the
# tree 6 -> {8, 7} (nodes 0, 1, 2). A window of 2 columns starts with one level: rows 0 | 1 2 | 3 4 5.
PROMPT = [5, 6, 7, 5, 6, 8, 5]
SMALL = LookaheadConfig(window=2, ngram=3, guesses=2)


def test_decoder_plans_last_token_window_and_guess_tree():
    decoder = LookaheadDecoder(SMALL, PROMPT)
    plan = decoder.plan()
    assert plan.tree.tokens == [6, 8, 7] and plan.tree.parents == (-1, 0, 0)
    assert plan.tokens[0] == 5 and plan.tokens[3:].tolist() == [6, 8, 7]
    assert set(plan.tokens[1:3].tolist()) <= set(PROMPT)
    assert plan.layout.logit_rows.tolist() == [0, 1, 2, 3, 4, 5] and plan.layout.tree_start == 3


def test_decoder_window_starts_with_seeded_prompt_tokens():
    prompt = list(range(20, 60))
    config = LookaheadConfig(window=8, ngram=3, guesses=2, seed=4)
    window = LookaheadDecoder(config, prompt).window
    assert window.width == 8 and len(window.levels) == 1 and set(window.tokens) <= set(prompt)
    assert LookaheadDecoder(config, prompt).window.tokens == window.tokens  # the seed fixes them
    others = {tuple(LookaheadDecoder(LookaheadConfig(window=8, seed=s), prompt).window.tokens) for s in range(4)}
    assert len(others) == 4


def _transform_decoder():
    """A decoder whose transform records what it is given and moves the best token to a planned one."""
    calls = []
    planned = {7: 6, 8: 7, 9: 9}  # by context length: after the prompt 6, then 7, then 9

    def transform(context, scores):
        calls.append((context.tolist(), scores.tolist()))
        out = scores.clone()
        out[0, planned[context.shape[1]]] = 100.0
        return out

    return LookaheadDecoder(SMALL, PROMPT, transform=transform), calls


def test_decoder_transform_scores_each_node_with_its_own_prefix():
    decoder, calls = _transform_decoder()
    plan = decoder.plan()
    logits = _logits([1, 3, 4, 2, 2, 2])  # untransformed, root and nodes all say something else
    result = decoder.update(plan, logits)
    assert result.tokens == [6, 7, 9]  # 6 and 7 are guesses (nodes 0 and 2), 9 the new token
    assert result.kept_rows.tolist() == [0, 3, 5]
    assert calls == [
        ([PROMPT], [logits[0].tolist()]),
        ([PROMPT + [6]], [logits[3].tolist()]),
        ([PROMPT + [6, 7]], [logits[5].tolist()]),
    ]
    assert decoder.sequence == PROMPT + [6, 7, 9]
    assert decoder.window.levels[1] == [3, 4]  # the window takes the greedy outputs of its rows


def test_decoder_choose_rule_picks_the_tokens():
    def lowest(scores, candidates, position):
        token = int(scores.argmin())
        return token, next((node for candidate, node in candidates if candidate == token), None)

    decoder = LookaheadDecoder(SMALL, PROMPT, choose=lowest)
    plan = decoder.plan()
    logits = _logits([9, 3, 4, 9, 9, 9], lowest=[6, 0, 0, 8, 0, 0])  # lowest: 6 at the root, 8 after it, then 0
    result = decoder.update(plan, logits)
    assert result.tokens == [6, 8, 0] and result.kept_rows.tolist() == [0, 3, 4]
    assert decoder.window.levels[1] == [3, 4]  # the window stays greedy


@pytest.mark.parametrize("rule", ["greedy", "transform", "lowest"])
def test_rows_picked_apart_and_verified_together_commit_what_update_commits(rule):
    """What lookahead parallelism does: each process picks the tokens of some logit rows
    (`choices`), and the picks of all rows verified together (`update_from_choices`) must commit what
    one process's `update` commits."""
    def lowest(scores, candidates, position):
        token = int(scores.argmin())
        return token, next((node for candidate, node in candidates if candidate == token), None)

    def make():
        if rule == "transform":
            return _transform_decoder()[0]
        return LookaheadDecoder(SMALL, PROMPT, choose=lowest if rule == "lowest" else None)

    logits = {"greedy": _logits([6, 3, 4, 7, 2, 9]),  # 6, then node 2 (7), then 9
              "transform": _logits([1, 3, 4, 2, 2, 2]),  # the transform plans 6, 7, 9
              "lowest": _logits([9, 3, 4, 9, 9, 9], lowest=[6, 0, 0, 8, 0, 0])}[rule]  # 6, 8, 0
    alone, apart = make(), make()
    plan = alone.plan()
    expected = alone.update(plan, logits)
    picked = torch.full((6,), -1, dtype=torch.long)
    for places in (torch.tensor([0, 2, 4]), torch.tensor([5, 1, 3])):  # two processes' rows, in any order
        picked[places] = apart.choices(plan, logits[places], places)
    result = apart.update_from_choices(plan, picked)
    assert result.tokens == expected.tokens and torch.equal(result.kept_rows, expected.kept_rows)
    assert apart.sequence == alone.sequence and apart.window.levels == alone.window.levels
    assert len(result.tokens) > 1  # a guess was accepted, not only the root's token


def test_each_node_is_picked_at_its_own_position_after_its_own_prefix():
    """A rule's pick depends on the position the token takes (sampling keys its noise by it) and a transform
    on the text before it: `choices` must give each node both, as `update` does along the accepted path."""
    seen = []

    def rule(scores, candidates, position):
        seen.append(("rule", position))
        token = int(scores.argmax())
        return token, next((node for candidate, node in candidates if candidate == token), None)

    def transform(context, scores):
        seen.append(("context", context[0].tolist()))
        return scores

    decoder = LookaheadDecoder(SMALL, PROMPT, choose=rule, transform=transform)
    plan = decoder.plan()  # tree 6 -> {8, 7}: nodes 0, 1, 2 at rows 3, 4, 5
    logits = _logits([6, 3, 4, 7, 2, 9])
    decoder.choices(plan, logits[[0, 3, 4, 5]], torch.tensor([0, 3, 4, 5]))
    n = len(PROMPT)
    assert seen == [("context", PROMPT), ("rule", n), ("context", PROMPT + [6]), ("rule", n + 1),
                    ("context", PROMPT + [6, 8]), ("rule", n + 2), ("context", PROMPT + [6, 7]), ("rule", n + 2)]
    seen.clear()
    assert decoder.update(plan, logits).tokens == [6, 7, 9]
    assert seen == [("context", PROMPT), ("rule", n), ("context", PROMPT + [6]), ("rule", n + 1),
                    ("context", PROMPT + [6, 7]), ("rule", n + 2)]


@pytest.mark.parametrize("root, hits", [(6, 1.0), (1, 0.0)])
def test_the_likeliest_node_is_scored_against_the_first_committed_token(root, hits):
    decoder = LookaheadDecoder(SMALL, PROMPT)
    plan = decoder.plan()
    token, chance = plan.top
    assert token == 6 and 0 < chance < 1
    decoder.update(plan, _logits([root, 3, 4, 2, 2, 2]))
    assert decoder.stats.calibration == pytest.approx((hits + 1.0) / (chance + 1.0))


def test_the_window_pays_only_where_its_rows_are_nearly_free():
    def flat(k):
        return 1.0

    def steep(k):
        return float(k)

    assert LookaheadDecoder(SMALL, PROMPT).window_pays(steep)  # unbudgeted: the window is always fed
    budgeted = LookaheadDecoder(LookaheadConfig(window=2, ngram=3, guesses=2, budget=True), PROMPT, cost=flat)
    assert budgeted.window.width == 2
    assert budgeted.window_pays(flat) and not budgeted.window_pays(steep)


def test_decoder_greedy_update_commits_and_learns_only_output_ngrams():
    config = LookaheadConfig(window=0, ngram=2, guesses=2, seed_from_prompt=False)
    decoder = LookaheadDecoder(config, [1, 2, 3, 4, 5])
    plan = decoder.plan()
    assert plan.tokens.tolist() == [5]  # no window, empty pool: the last token alone
    result = decoder.update(plan, _logits([6]))
    assert result.tokens == [6] and result.kept_rows.tolist() == [0]
    assert len(decoder.pool) == 1 and decoder.pool.continuations([5]) == [(6,)]  # the prompt's n-grams stay out
    plan = decoder.plan()
    assert plan.tree.tokens == [] and decoder.update(plan, _logits([5])).tokens == [5]
    assert decoder.pool.continuations([5]) == [(6,)] and decoder.pool.continuations([6]) == [(5,)]
    assert decoder.plan().tree.tokens == [6]  # 5 was followed by 6: guessed again


def test_decoder_transform_gets_the_context_on_the_logits_device():
    """Logits processors index the scores with the context, so both must be on one device (on a GPU, the
    logits'). The meta device stands in for an accelerator; `update` would read the meta data back, so the
    scoring step is called on its own."""
    seen = []

    def transform(context, scores):
        seen.append((context.device, context.dtype, tuple(context.shape), scores.device, tuple(scores.shape)))
        return scores

    decoder = LookaheadDecoder(SMALL, PROMPT, transform=transform)
    logits = torch.empty(6, VOCAB, device="meta")
    assert decoder._scores(logits[3], [6]).device.type == "meta"  # node 0 of a step with a 2-column window
    meta = torch.device("meta")
    assert seen == [(meta, torch.long, (1, len(PROMPT) + 1), meta, (1, VOCAB))]


def test_processors_get_float32_scores_from_a_bfloat16_model():
    """As transformers' `generate` does, logits are read as float32 before the processors run: a repetition
    penalty of 1.3 on 10.0 gives 7.692 in float32, above 7.6875, where bfloat16 rounds it to a tie (and the
    first maximum, token 0, would win)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    seen: list[torch.dtype] = []
    penalty = RepetitionPenaltyLogitsProcessor(1.3)

    def transform(context, scores):
        seen.append(scores.dtype)
        return penalty(context, scores)

    decoder = LookaheadDecoder(LookaheadConfig(window=0, ngram=2, guesses=0), [1, 1], transform=transform)
    plan = decoder.plan()
    logits = torch.full((plan.layout.logit_rows.numel(), 2), -5.0, dtype=torch.bfloat16)
    logits[0] = torch.tensor([7.6875, 10.0])
    assert decoder.update(plan, logits).tokens == [1]
    assert seen == [torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_top_tokens_of_device_logits_are_on_the_host():
    """Trees are verified on the host: the picks of logits on a GPU are read back there."""
    logits = torch.randn(4, 50, device="cuda")
    picks = top_tokens(logits, 3)
    assert picks.device.type == "cpu" and torch.equal(picks[:, 0], logits.argmax(-1).cpu())


class _Recorder:
    """An extra draft source that proposes fixed drafts and records what it is asked and shown."""

    name = "extra"

    def __init__(self, drafts: list[tuple[int, ...]]) -> None:
        self.drafts = drafts
        self.limits: list[int] = []
        self.observed: list[tuple[list[int], int]] = []

    def propose(self, text, limit):
        self.limits.append(limit)
        return [Draft(tokens, self.name) for tokens in self.drafts]

    def observe(self, text, new):
        self.observed.append((list(text), new))


def test_pool_source_drafts_carry_its_name_and_matched_context():
    pool = NGramPool(4, 3)
    pool.add((3, 4, 5, 6), before=(1, 2))
    assert PoolProposer(pool).propose([0, 2, 3], 2) == [Draft((4, 5), "pool", 2)]  # found under the key (2, 3)


def test_budgeted_decoder_needs_a_cost_curve():
    with pytest.raises(ValueError, match=r"^a budgeted config needs the step cost curve \(cost=\)$"):
        LookaheadDecoder(LookaheadConfig(budget=True), [1, 2, 3])


def test_decoder_extra_proposers_observe_prompt_and_output_and_count_acceptances():
    for seed, learn in ((True, True), (False, False)):  # the pool's switches do not concern other sources
        config = LookaheadConfig(window=0, ngram=4, guesses=2, seed_from_prompt=seed, learn_from_output=learn)
        extra = _Recorder([(7, 8)])
        decoder = LookaheadDecoder(config, [1, 2, 3], proposers=[extra])
        assert [p.name for p in decoder.proposers] == ["pool", "extra"]
        assert extra.observed == [([1, 2, 3], 3)]
        plan = decoder.plan()
        assert extra.limits == [3]  # the longest draft: N - 1 (no suffix source)
        assert plan.tree.tokens == [7, 8] and plan.sources == ("extra", "extra")
        assert decoder.update(plan, _logits([7, 8, 9])).tokens == [7, 8, 9]
        assert decoder.accepted_by_source == {"extra": 2}
        assert extra.observed[1:] == [([1, 2, 3, 7, 8, 9], 3)]


def test_decoder_suffix_source_only_when_configured_and_with_the_corpus():
    corpus = Corpus()
    corpus.add([1, 2, 50, 51])
    prompt = [1, 2, 3, 4, 1, 2]
    off = LookaheadDecoder(LookaheadConfig(window=0, suffix=0), prompt, corpus=corpus)
    assert [p.name for p in off.proposers] == ["pool"]
    on = LookaheadDecoder(LookaheadConfig(window=0, suffix=8), prompt, corpus=corpus)
    assert [p.name for p in on.proposers] == ["pool", "suffix"]
    drafts = on.plan().drafts
    assert Draft((3, 4, 1, 2), "suffix", 2) in drafts  # from the prompt, which the suffix source observed
    assert Draft((50, 51), "corpus", 2) in drafts  # from the corpus


def test_budgeted_decoder_sizes_window_and_tree_by_the_cost_curve():
    def cost(k):  # up to 8 rows cost one step; each row more costs another
        return 1.0 if k <= 8 else float(k - 7)

    config = LookaheadConfig(window=5, ngram=4, guesses=2, seed_from_prompt=False, budget=True)
    extra = _Recorder([(100 + i,) for i in range(20)])
    decoder = LookaheadDecoder(config, list(range(20, 30)), cost=cost, proposers=[extra])
    assert decoder.window.width == 2  # 1 + 2 columns x 3 levels = 7 rows cost 1; a third column: 10 rows
    plan = decoder.plan()
    # 3 fixed rows (the last token, the window's first level): 5 nodes are free; a sixth doubles the step cost
    assert plan.tree.tokens == [100, 101, 102, 103, 104]
    assert plan.tree.tokens == merged_tree(plan.drafts, AcceptanceStats(), cost, 3, MAX_TREE_NODES).tree.tokens


def test_budget_caps_the_tree_and_an_unbudgeted_decoder_ignores_the_cost():
    prompt = list(range(20, 30))
    many = [(100 + i,) for i in range(70)]
    budgeted = LookaheadConfig(window=5, ngram=4, guesses=2, seed_from_prompt=False, budget=True)
    free = LookaheadDecoder(budgeted, prompt, cost=lambda k: 1.0, proposers=[_Recorder(many)])
    assert len(free.plan().tree.tokens) == MAX_TREE_NODES == 64  # every node pays; the cap stops it
    plain = LookaheadConfig(window=5, ngram=4, guesses=2, seed_from_prompt=False, budget=False)
    ignored = LookaheadDecoder(plain, prompt, cost=lambda k: float(k), proposers=[_Recorder(many)])
    assert ignored.window.width == 5 and len(ignored.plan().tree.tokens) == 70  # every draft, the whole window


def test_a_decoder_asks_for_rows_by_its_calibrated_estimates():
    config = LookaheadConfig(window=0, ngram=4, guesses=2, seed_from_prompt=False, budget=True)
    stats = AcceptanceStats()
    decoder = LookaheadDecoder(config, [1, 2, 3], cost=lambda k: 1.0, proposers=[_Recorder([(7, 8), (9,)])],
                               stats=stats)
    proposal = decoder.propose()
    raw = proposal.nodes.probabilities
    assert decoder.demand(proposal).gains == raw
    for _ in range(6):
        stats.record_top(0.5, False)  # the likeliest node was never right: (0 + 1) / (3 + 1)
    assert decoder.demand(proposal).gains == pytest.approx([p / 4 for p in raw])
    assert decoder.demand(proposal, most=2).most == 2 and decoder.demand(proposal).base == 1


def test_keep_scores_returns_each_committed_tokens_logits_and_scores():
    """With `keep_scores`, the result carries, per committed token, the float32 logits of the row it was picked
    from (the root's, then the accepted nodes') and those logits as the transform scored them, given the
    tokens before it; the tokens, the kept rows and the window are those of a step without it."""
    planned = {7: 6, 8: 7, 9: 9}  # by context length, as in _transform_decoder

    def transform(context, scores):
        out = scores.clone()
        out[0, planned[context.shape[1]]] = 100.0
        return out

    decoder = LookaheadDecoder(SMALL, PROMPT, transform=transform, keep_scores=True)
    plan = decoder.plan()  # rows 0 | 1 2 | 3 4 5: tree 6 -> {8, 7}
    logits = _logits([1, 3, 4, 2, 2, 2]).to(torch.bfloat16)
    result = decoder.update(plan, logits)
    assert result.tokens == [6, 7, 9] and result.kept_rows.tolist() == [0, 3, 5]
    expected = logits[[0, 3, 5]].float()
    assert result.logits.dtype == torch.float32 and torch.equal(result.logits, expected)
    scored = expected.clone()
    scored[0, 6] = scored[1, 7] = scored[2, 9] = 100.0
    assert torch.equal(result.scores, scored)
    assert decoder.sequence == PROMPT + [6, 7, 9]
    assert decoder.window.levels[1] == [3, 4]  # the greedy outputs of the window rows, as without keep_scores


def test_a_transform_that_writes_its_scores_leaves_the_callers_logits_alone():
    """Processors may write the scores they are handed (as in `generate`): they get a copy, so the logits the
    caller passed, and the logits a `keep_scores` result returns, are the model's."""
    def transform(context, scores):
        scores[0, {7: 6, 8: 7, 9: 9}[context.shape[1]]] = 100.0  # in place
        return scores

    decoder = LookaheadDecoder(SMALL, PROMPT, transform=transform, keep_scores=True)
    plan = decoder.plan()
    logits = _logits([1, 3, 4, 2, 2, 2])  # float32 already: a plain `.to(float32)` would not copy
    original = logits.clone()
    result = decoder.update(plan, logits)
    assert result.tokens == [6, 7, 9]
    assert torch.equal(logits, original)
    assert torch.equal(result.logits, original[[0, 3, 5]])


def test_update_from_choices_teaches_the_recycle_source_each_rows_picked_token():
    config = LookaheadConfig(window=2, ngram=3, guesses=2, recycle=2)
    decoder = LookaheadDecoder(config, PROMPT)
    plan = decoder.plan()  # rows 0 | 1 2 | 3 4 5, as with SMALL: the table is empty, nothing is recycled yet
    assert plan.tree.tokens == [6, 8, 7]
    picked = torch.tensor([6, 3, 4, 7, 2, 9])
    assert decoder.update_from_choices(plan, picked).tokens == [6, 7, 9]
    expected = {}
    for token, pick in zip(plan.tokens.tolist(), picked.tolist()):  # later rows win
        expected[token] = (pick,)
    table = decoder.recycle.table
    assert len(table) == len(expected)
    assert all(table.successors(token) == successors for token, successors in expected.items())


@pytest.mark.parametrize("recycle", [1, 3])
def test_the_recycle_source_learns_recycle_tokens_per_row(recycle):
    """`recycle` likeliest tokens per fed row, best first: no more (1), and not fewer where the step has fewer
    rows than that (3 tokens from a step of one row)."""
    config = LookaheadConfig(window=0, ngram=2, guesses=2, seed_from_prompt=False, recycle=recycle)
    decoder = LookaheadDecoder(config, [1, 2, 5])
    assert [p.name for p in decoder.proposers] == ["pool", "recycle"]
    plan = decoder.plan()
    assert plan.tokens.tolist() == [5]  # one row: the last token
    logits = _logits([6])
    assert decoder.update(plan, logits).tokens == [6]
    assert decoder.recycle.table.successors(5) == tuple(logits[0].topk(recycle).indices.tolist())


def test_the_context_limits_the_window_and_the_tree():
    """No row of a step lies at or past the model's context: the window (reaching 2 positions past the last
    token here) is fed only where its last row fits, and the tree has at most as many nodes as positions
    are left."""
    n = len(PROMPT)  # 7: the last token sits at position 6
    for context, fits, tokens in ((n + 1, False, [5, 6]), (n + 2, True, [5, 6, 8])):
        decoder = LookaheadDecoder(SMALL, PROMPT, context=context)
        assert decoder.window_fits() == fits
        plan = decoder.plan()
        assert plan.layout.window_rows.numel() == (2 if fits else 0)
        assert plan.tokens[:1].tolist() + plan.tree.tokens == tokens
        assert n - 1 + int(plan.layout.offsets.max()) < context
    assert LookaheadDecoder(SMALL, PROMPT, context=100).plan().tree.tokens == [6, 8, 7]


def test_a_step_without_the_window_asks_fewer_base_rows_and_leaves_them_to_the_tree():
    decoder = LookaheadDecoder(SMALL, PROMPT)  # the window starts with one level of 2 columns
    assert decoder.base_rows() == 3 and decoder.base_rows(False) == 1
    proposal = decoder.propose()
    assert decoder.demand(proposal).base == 3 and decoder.demand(proposal, False).base == 1
    plan = decoder.plan(window=False)
    assert plan.tokens.tolist() == [5, 6, 8, 7] and plan.layout.window_rows.numel() == 0
    assert plan.layout.tree_start == 1

    def cost(k):  # up to 8 rows cost one step; each row more costs another
        return 1.0 if k <= 8 else float(k - 7)

    config = LookaheadConfig(window=5, ngram=4, guesses=2, seed_from_prompt=False, budget=True)
    budgeted = LookaheadDecoder(config, list(range(20, 30)), cost=cost,
                                proposers=[_Recorder([(100 + i,) for i in range(20)])])
    assert len(budgeted.plan().tree.tokens) == 5  # 8 - 3 rows (the last token, 2 window columns)
    assert budgeted.plan(window=False).tree.tokens == [100 + i for i in range(7)]  # 8 - 1 rows


def test_calibrated_gains_are_capped_at_certainty():
    config = LookaheadConfig(window=0, ngram=4, guesses=2, seed_from_prompt=False, budget=True)
    stats = AcceptanceStats()
    for _ in range(6):
        stats.record_top(0.1, True)  # right every time at 0.1: calibration (6 + 1) / (0.6 + 1) = 4.375
    decoder = LookaheadDecoder(config, [1, 2, 3], cost=lambda k: 1.0, proposers=[_Recorder([(7, 8), (9,)])],
                               stats=stats)
    proposal = decoder.propose()
    assert stats.calibration == pytest.approx(4.375)
    assert proposal.nodes.probabilities == [0.5, 0.5, 0.25]
    assert decoder.demand(proposal).gains == [1.0, 1.0, 1.0]  # 2.19, 2.19 and 1.09 as chances: capped


def test_a_step_proposes_every_sources_drafts():
    decoder = LookaheadDecoder(SMALL, PROMPT, proposers=[_Recorder([(9,)])])
    proposal = decoder.propose()
    assert [d.source for d in proposal.drafts] == ["pool", "pool", "extra"]
    assert sorted(proposal.nodes.prefixes) == [(6,), (6, 7), (6, 8), (9,)]


class _Nameless:
    """A caller's draft source without a `name`: its errors name its class."""

    def __init__(self, tokens) -> None:
        self.tokens = tokens

    def propose(self, text, limit):
        return [Draft(tuple(self.tokens), "nameless")]

    def observe(self, text, new):
        pass


def _checked(tokens, vocabulary=10, source=None):
    source = source or _Recorder([tuple(tokens)])
    return LookaheadDecoder(SMALL, PROMPT, proposers=[source], vocabulary=vocabulary).propose().drafts[-1]


def test_a_callers_drafts_are_checked_token_ids_made_ints():
    draft = _checked([np.int64(3), 0, 9])  # numpy ints, and both ends of the vocabulary, are token ids
    assert draft.tokens == (3, 0, 9) and all(type(token) is int for token in draft.tokens)
    assert _checked([12], vocabulary=None).tokens == (12,)  # no vocabulary: not checked against one
    # Counted under the source's own name (that of its class where it has none), not the name its drafts give.
    assert _checked([], source=_Nameless([4])).source == "_Nameless"
    for token, kind in ((3.0, "float"), (True, "bool")):
        message = f"draft source 'extra' proposed {token!r} ({kind}), not a token id (an int)"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            _checked([4, token])
    with pytest.raises(ValueError, match=r"^draft source '_Nameless' proposed 2\.5 \(float\), not a token id \(an int\)$"):
        _checked([], source=_Nameless([2.5]))
    for token in (10, -1):
        message = f"draft source 'extra' proposed token id {token}, outside the model's vocabulary [0, 10)"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            _checked([4, token])


def test_top_tokens_gives_one_column_by_default_and_walk_tree_starts_at_position_0():
    """The defaults of the public helpers (every caller in the package passes them explicitly today)."""
    logits = _logits([3, 7, 1])
    assert top_tokens(logits).tolist() == [[3], [7], [1]]  # [rows, count], count 1
    positions = []

    def rule(scores, candidates, position):
        positions.append(position)
        return greedy_choice(scores, candidates)

    tree = build_guess_tree([(3, 7)])
    verdict = walk_tree(tree, lambda node, accepted: logits[0 if node == ROOT else 1 + node], rule)
    assert verdict == Verdict([3, 7, 1], [0, 1]) and positions == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_accelerator_branches_agree_with_the_host():
    """top_tokens' accelerator branch (argmax, then topk for the rest) gives what the host branch gives, every
    column, for each count; Gumbel noise drawn on the accelerator lies there, keyed by (seed, position) alone."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))  # no ties
    for count in (1, 2, 3):
        on_device = top_tokens(logits.cuda(), count)
        assert on_device.device.type == "cpu" and on_device.shape == (5, count)
        assert torch.equal(on_device, top_tokens(logits, count))
    noise = gumbel_noise(3, 7, 50, "cuda")
    assert noise.device.type == "cuda" and torch.equal(noise, gumbel_noise(3, 7, 50, "cuda"))
    assert not torch.equal(noise, gumbel_noise(3, 8, 50, "cuda"))  # another position
    assert not torch.equal(noise, gumbel_noise(4, 7, 50, "cuda"))  # another seed


def test_a_draft_sources_drafts_are_checked_and_their_tokens_made_ints():
    """`_checked_drafts`: what a caller's draft source returns, as the decoder keeps it (a survivor of a mutation
    run: only tests through `generate`, outside the mutation selection, had checked it)."""
    from lookahead.core.decoder import _checked_drafts

    kept = _checked_drafts([Draft(np.array([5, 6]), "mine", 0), Draft((np.int64(7),), "mine", 3)], "mine", 10)
    assert kept == [Draft((5, 6), "mine", 0), Draft((7,), "mine", 3)] and type(kept[0].tokens[0]) is int
    for proposed, error, message in [
        ([Draft((5,), "mine"), (5,)], TypeError,
         "draft source 'mine': propose\\(\\) must return a list of lookahead Drafts"),
        (Draft((5,), "mine"), TypeError, "must return a list of lookahead Drafts"),
        ([Draft(5, "mine")], TypeError, "draft source 'mine' proposed tokens=5, not a sequence of token ids"),
        ([Draft((5,), "mine", -1)], ValueError, "proposed a draft of context=-1: the number of the text's last tokens "
                                                "it matched must be an integer >= 0"),
        ([Draft((5,), "mine", None)], ValueError, "context=None"),
        ([Draft((5, 2.5), "mine")], ValueError, "proposed 2.5 \\(float\\), not a token id"),
        ([Draft((5, 10), "mine")], ValueError, "proposed token id 10, outside the model's vocabulary \\[0, 10\\)"),
    ]:
        with pytest.raises(error, match=message):
            _checked_drafts(proposed, "mine", 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top_tokens_read_any_float_rows_as_torchs_argmax_and_the_next_best(dtype):
    """bfloat16 rows are widened by their bits in numpy (torch's conversion woke its thread pool: up to
    milliseconds a call after a forward): the same float32 values, so the same picks, ties, infinities, NaN,
    negative zero and a non-contiguous view included; float32 rows are not written to."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=generator).to(dtype)
    logits[1, [3, 9]] = 5.0  # a tie: the first maximum
    logits[2, 7], logits[3, 11], logits[4, :] = float("inf"), float("nan"), -0.0
    logits[5, :] = float("-inf")
    for rows in (logits, logits[:, ::2]):
        before = rows.clone()
        picks = top_tokens(rows, 3)
        widened = rows.float().numpy()
        assert picks[:, 0].tolist() == widened.argmax(axis=-1).tolist()
        masked = widened.copy()
        masked[np.arange(len(masked)), picks[:, 0].numpy()] = -np.inf
        assert picks[:, 1].tolist() == masked.argmax(axis=-1).tolist()
        assert torch.equal(rows, before) or bool(before.isnan().any())


def test_a_steps_logit_rows_are_gathered_as_torch_indexes_them():
    """`StepLogits.of` gathers a sequence's rows in numpy, by their bits (torch's gather woke its thread pool)."""
    from lookahead.runtime.batch import StepLogits, _gathered

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = torch.randn(7, 30).to(dtype)
        index = torch.tensor([4, 0, 4, 6])
        gathered = _gathered(rows, index)
        assert gathered.dtype == dtype and torch.equal(gathered, rows[index])
        gathered[0] = 0  # a copy
        assert not torch.equal(rows[4], gathered[0]) or bool((rows[4] == 0).all())
        computed = rows.view(1, 7, 30)
        assert torch.equal(StepLogits(computed, None).of(0, torch.tensor([1, 5])), rows[[1, 5]])

"""The framework-free pieces: step layout and mask, n-gram pool, window, verification."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.core.layout import build_guess_tree, step_layout
from lookahead.core.pool import NGramPool
from lookahead.core.verify import ROOT, Verdict, greedy_choice, verify_greedy, walk_tree
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


guess_lists = st.integers(1, 4).flatmap(
    lambda m: st.lists(st.lists(st.integers(0, 3), min_size=m, max_size=m).map(tuple), max_size=5).map(lambda g: (m, g))
)


@given(levels=st.integers(0, 4), width=st.integers(0, 5), guesses=guess_lists)
@settings(max_examples=80, deadline=None)
def test_layout_matches_plain_reference(levels, width, guesses):
    guess_len, guesses = guesses
    if levels == 0 or width == 0:
        levels = width = 0
    tree = build_guess_tree(guesses, guess_len)
    layout = step_layout(levels, width, tree)
    offsets, allowed, paths = slow_layout(levels, width, guesses)
    assert layout.offsets.tolist() == offsets
    assert layout.allowed.tolist() == allowed
    assert (tree.paths + layout.tree_start).tolist() == paths
    assert layout.size == 1 + levels * width + len({g[: t + 1] for g in guesses for t in range(guess_len)})
    newest = list(range(1 + (levels - 1) * width, 1 + levels * width)) if levels else []
    assert layout.window_rows.tolist() == newest
    assert layout.logit_rows.tolist() == [0] + newest + list(range(1 + levels * width, layout.size))


def test_every_row_context_is_a_contiguous_chain():
    """What each row sees, sorted by position, must be positions 0..own position with no gap or repeat:
    that is what makes its prediction the same as a plain left-to-right pass would give."""
    tree = build_guess_tree([(1, 2, 3), (1, 2, 4), (5, 6, 7)], 3)
    layout = step_layout(3, 4, tree)
    for row in range(layout.size):
        seen = sorted(layout.offsets[layout.allowed[row]].tolist())
        assert seen == list(range(int(layout.offsets[row]) + 1))


def test_shared_prefixes_are_fed_once():
    tree = build_guess_tree([(1, 2, 3), (1, 2, 4), (1, 5, 6)], 3)
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
    pool.add_all([7, 8, 1, 2, 3])  # 1 -> (2, 3) after 7, 8
    pool.add_all([5, 1, 4, 4])  # 1 -> (4, 4) after 5
    pool.add([1, 6, 6])  # 1 -> (6, 6), from the window: no context
    assert pool.continuations([0, 0, 1]) == [(6, 6), (4, 4), (2, 3)]  # recency alone
    assert pool.continuations([0, 5, 1]) == [(4, 4), (6, 6), (2, 3)]
    assert pool.continuations([7, 8, 1]) == [(2, 3), (6, 6), (4, 4)]
    assert pool.continuations([9, 8, 1]) == [(2, 3), (6, 6), (4, 4)]  # shares two tokens
    assert len(pool) == 6  # every n-gram of both texts, once


def test_pool_from_sequence_and_zero_capacity():
    pool = NGramPool(ngram=2, capacity=3)
    pool.add_all([5, 6, 5, 7])
    assert pool.continuations([5]) == [(7,), (6,)]
    empty = NGramPool(ngram=2, capacity=0)
    empty.add_all([5, 6, 5, 7])
    assert len(empty) == 0


def test_window_fills_then_emits_ngrams_and_shifts():
    window = LookaheadWindow([10, 11, 12], max_levels=3)
    assert window.advance([20, 21, 22]) == []
    assert window.advance([30, 31, 32]) == []
    assert window.tokens == [10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert window.advance([40, 41, 42]) == [(10, 20, 30, 40), (11, 21, 31, 41), (12, 22, 32, 42)]
    assert window.levels == [[20, 21, 22], [30, 31, 32], [40, 41, 42]]


def test_verify_takes_longest_matching_prefix_plus_next_prediction():
    tree = build_guess_tree([(5, 9, 9), (5, 6, 7), (4, 6, 7)], 3)  # nodes: 5, 9, 9', 6, 7, 4, 6', 7'
    # the model says 5 after the last token, and after each node:
    node_predictions = torch.tensor([6, 1, 1, 8, 3, 6, 7, 2])
    verdict = verify_greedy(tree, 5, node_predictions)
    assert verdict.tokens == [5, 6, 8] and verdict.nodes == [0, 3]


def test_verify_without_match_or_guesses_commits_one_token():
    assert verify_greedy(build_guess_tree([(4, 5)], 2), 3, torch.tensor([5, 6])).tokens == [3]
    assert verify_greedy(build_guess_tree([], 2), 3, torch.zeros(0, dtype=torch.long)) == Verdict([3], [])


def test_verify_full_match_commits_guess_and_bonus_token():
    verdict = verify_greedy(build_guess_tree([(1, 2, 3)], 3), 1, torch.tensor([2, 3, 4]))
    assert verdict.tokens == [1, 2, 3, 4] and verdict.nodes == [0, 1, 2]


def test_greedy_walk_equals_vectorised_greedy():
    """The per-node walk (used when logits processors are on) agrees with the vectorised path."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        guesses = [tuple(torch.randint(0, 3, (3,), generator=generator).tolist()) for _ in range(4)]
        tree = build_guess_tree(guesses, 3)
        logits = torch.randn(1 + len(tree.tokens), 3, generator=generator)
        predictions = logits.argmax(dim=-1)
        fast = verify_greedy(tree, int(predictions[0]), predictions[1:])
        walked = walk_tree(tree, lambda node, accepted: logits[0 if node == ROOT else 1 + node], greedy_choice)
        assert fast == walked

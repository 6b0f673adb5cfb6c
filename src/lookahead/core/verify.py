"""Verification of a step's guess tree: which guessed tokens to commit, and the model's next token.

Greedy: the longest guess prefix that the model's own argmax reproduces. Sampling: a walk down the tree
that keeps the model's distribution exactly (see docs/sampling.md): at each node, the children's tokens
are tried in turn; candidate x is accepted with probability p(x), else p loses x and is renormalised;
when no child is accepted, the next token is drawn from what is left of p.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .layout import GuessTree

ROOT = -1  # the tree's root: the last committed token


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # committed this step: the accepted guess tokens plus the model's next token
    nodes: list[int]  # tree nodes of the accepted guess tokens (their KV entries are kept)


def verify_greedy(tree: GuessTree, root_prediction: int, node_predictions: torch.Tensor) -> Verdict:
    """Vectorised greedy verification from the argmax at the root and at every tree node."""
    if not tree.tokens:
        return Verdict([root_prediction], [])
    present = tree.paths >= 0  # guesses are ragged: a path ends at its first -1
    nodes = tree.paths.clamp(min=0)
    guesses = torch.tensor(tree.tokens)[nodes]  # [G, M]
    expected = torch.cat([torch.full_like(guesses[:, :1], root_prediction), node_predictions[nodes]], dim=1)
    matched = ((guesses == expected[:, :-1]) & present).cumprod(dim=1).sum(dim=1)
    best = int(matched.argmax())
    count = int(matched[best])
    return Verdict(expected[best, : count + 1].tolist(), tree.paths[best, :count].tolist())


# A rule picks the next token from a node's scores and its children [(token, node)]: (token, node or None).
ChooseRule = Callable[[torch.Tensor, list[tuple[int, int]]], tuple[int, int | None]]


def walk_tree(tree: GuessTree, scores_at: Callable[[int, list[int]], torch.Tensor], choose: ChooseRule) -> Verdict:
    """Walk from the root: at each node, `choose` among its children given `scores_at(node, accepted)`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(parent, []).append((token, node))
    node, tokens, nodes = ROOT, [], []
    while True:
        token, child = choose(scores_at(node, tokens), children.get(node, []))
        tokens.append(token)
        if child is None:
            return Verdict(tokens, nodes)
        nodes.append(child)
        node = child


def greedy_choice(scores: torch.Tensor, candidates: list[tuple[int, int]]) -> tuple[int, int | None]:
    token = int(scores.argmax())
    return token, next((node for candidate, node in candidates if candidate == token), None)


def sample_choice(
    scores: torch.Tensor, candidates: list[tuple[int, int]], generator: torch.Generator | None = None
) -> tuple[int, int | None]:
    """Multi-candidate speculative sampling for deterministic guesses; emits exactly softmax(scores)."""
    probs = torch.softmax(scores.float(), dim=-1)
    for token, node in candidates:
        p = float(probs[token])
        if p > 0 and float(torch.rand((), generator=generator)) < p:
            return token, node
        probs[token] = 0.0
        remaining = float(probs.sum())
        if remaining <= 0:  # rounding: this candidate held all the mass
            return token, node
        probs /= remaining
    return int(torch.multinomial(probs, 1, generator=generator)), None

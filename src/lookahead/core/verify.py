"""Verification of a step's guess tree: which guessed tokens to commit, and the model's next token.

Greedy: the longest guess prefix that the model's own argmax reproduces. Sampling: a walk down the tree
that keeps the model's distribution exactly (see docs/sampling.md): at each node, the token is drawn by
Gumbel-max from the model's distribution there, with noise of the seed and the position alone, and the walk
goes on into the child that holds it; where no child does, that token is the step's next token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .layout import GuessTree

ROOT = -1  # the tree's root: the last committed token


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # committed this step: the accepted guess tokens plus the model's next token
    nodes: list[int]  # tree nodes of the accepted guess tokens (their KV entries are kept)


def top_tokens(logits: torch.Tensor, count: int = 1) -> torch.Tensor:
    """[rows, count]: each row's `count` likeliest tokens, best first, from logits [rows, vocab]. Column 0 is
    exactly `logits.argmax(-1)` (the first maximum), what greedy decoding picks. On a CPU, float32 rows go
    through numpy, whose vectorised argmax is ~10x faster than torch's here (23 against 270 us for 5 rows of
    a 49k vocabulary); each further token is another argmax with the ones before masked out. bfloat16 and
    float16 rows are read as float32 first, which they convert to exactly (torch's bfloat16 argmax and topk
    took 0.5 ms a row for 4 tokens, numpy 0.1 ms with the conversion; `_host_float32`)."""
    if logits.device.type != "cpu":  # read back to the host, where the tree is verified: the step's one transfer
        best = logits.argmax(dim=-1, keepdim=True)
        if count > 1:
            best = torch.cat([best, logits.topk(count, dim=-1).indices[:, 1:]], dim=1)  # ties may repeat a token
        return best.cpu()
    scores, fresh = _host_float32(logits.detach())
    picks = [scores.argmax(axis=-1)]
    if count > 1:
        scores, rows = (scores if fresh else scores.copy()), np.arange(scores.shape[0])
        for _ in range(count - 1):
            scores[rows, picks[-1]] = -np.inf
            picks.append(scores.argmax(axis=-1))
    return torch.from_numpy(np.stack(picks, axis=1))


def _host_float32(logits: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A CPU tensor's values as a float32 numpy array, and whether that array is a copy of its own (not the
    tensor's memory). bfloat16 widens to float32 by its bits in numpy (the value exactly, as torch's `float`
    gives it): torch converts a 49k-vocabulary row on its thread pool, whose wake-up after the forward cost from
    0.1 to several ms a call on a 2-core CPU (numpy: 10-50 us a row, on one thread)."""
    if logits.dtype == torch.float32:
        return logits.numpy(), False
    if logits.dtype == torch.bfloat16:
        wide = logits.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32), True
    return logits.float().numpy(), True


def verify_greedy(tree: GuessTree, root_prediction: int, node_predictions: torch.Tensor) -> Verdict:
    """Greedy verification from the argmax at the root and at every tree node. A tree's nodes are distinct
    (parent, token) pairs (`build_guess_tree`), so the guesses that match longest share one path: the one down
    from the root along the predictions (a few dict look-ups, where a dozen small torch calls took 0.4 ms a
    step of 8 sequences)."""
    child = {key: node for node, key in enumerate(zip(tree.parents, tree.tokens))}
    predictions = node_predictions.tolist()
    tokens, nodes, node = [root_prediction], [], ROOT
    while (node := child.get((node, tokens[-1]))) is not None:
        nodes.append(node)
        tokens.append(predictions[node])
    return Verdict(tokens, nodes)


# A rule picks the next token at a node from its scores, its children [(token, node)] and the position
# (index in the whole sequence) the token takes: (token, the child holding it or None).
ChooseRule = Callable[[torch.Tensor, list[tuple[int, int]], int], tuple[int, int | None]]


def walk_tree(tree: GuessTree, scores_at: Callable[[int, list[int]], torch.Tensor], choose: ChooseRule,
              position: int = 0) -> Verdict:
    """Walk from the root, whose next token takes `position`: at each node, `choose` among its children
    given `scores_at(node, accepted)`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(parent, []).append((token, node))
    node, tokens, nodes = ROOT, [], []
    while True:
        token, child = choose(scores_at(node, tokens), children.get(node, []), position + len(tokens))
        tokens.append(token)
        if child is None:
            return Verdict(tokens, nodes)
        nodes.append(child)
        node = child


def greedy_choice(scores: torch.Tensor, candidates: list[tuple[int, int]], position: int = 0) -> tuple[int, int | None]:
    token = int(scores.argmax())
    return token, next((node for candidate, node in candidates if candidate == token), None)


def gumbel_noise(seed: int, position: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise (float64) for one position of one sequence: a function of (seed, position) alone."""
    return _gumbel(_uniforms(_mix(seed, position), size, torch.device(device)))


def _uniforms(key: int, size: int, device: torch.device) -> torch.Tensor:
    """`size` float64 uniforms in [0, 1) from a 64-bit key. float64: float32's 2**-24 grid capped the noise at 16.6,
    so that a token more than ~19 below the best score was never drawn and one 17 below at 0.45 of its probability."""
    if device.type == "cpu":
        # torch's CPU generator keeps a seed's low 32 bits only: two positions of one 32k-token sequence would share
        # their noise one time in ten (the birthday bound), correlating their tokens. PCG64 takes all 64 bits.
        return torch.from_numpy(np.random.Generator(np.random.PCG64(key)).random(size))
    # CUDA's Philox generator takes all 64
    return torch.rand(size, generator=torch.Generator(device=device).manual_seed(key), device=device,
                      dtype=torch.float64)


def _gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """-log(-log(u)), with an exact 0 (drawn once in 2**53) read as the smallest normal float64: its noise, -inf, would
    rule out its token (the only one a processor left possible, say, leaving every score -inf and argmax token 0)."""
    return -torch.log(-torch.log(uniform.clamp(min=torch.finfo(torch.float64).tiny)))


def _mix(seed: int, position: int) -> int:
    """A 64-bit hash of (seed, position) (splitmix64), so that neighbouring positions get unrelated streams."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def sample_choice(scores: torch.Tensor, candidates: list[tuple[int, int]], noise: torch.Tensor) -> tuple[int, int | None]:
    """Gumbel-max sampling coupled with verification: the token is argmax(scores + noise), which has
    distribution softmax(scores); a child is accepted when it holds that token. Accepting a fixed guess x
    this way has probability p(x), as speculative sampling's rule has, but the token drawn does not
    depend on the guesses, only on the noise (docs/sampling.md)."""
    token = int((scores.double() + noise).argmax())
    if not math.isfinite(float(scores[token])):  # where transformers' multinomial fails ("inf, nan or element < 0")
        raise ValueError(f"sampling: the processed scores are not finite (the token drawn scores {float(scores[token])}):"
                         " a temperature this small overflows the logits, or the processors left no token possible")
    return token, next((node for candidate, node in candidates if candidate == token), None)

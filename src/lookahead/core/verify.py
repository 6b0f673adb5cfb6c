"""Greedy verification: the longest guess prefix that the model's own predictions reproduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # committed this step: the matched guess prefix plus the model's next token
    guess: int  # index of the accepted guess (-1 when no guess matched)
    matched: int  # guess tokens accepted


def verify_greedy(next_token: int, guesses: torch.Tensor, guess_predictions: torch.Tensor) -> Verdict:
    """Pick the guess whose longest prefix agrees with the model.

    next_token: the model's prediction after the last committed token.
    guesses: [G, M] guessed continuations; guess_predictions: [G, M] the model's prediction after each
    guess token. Guess g's token t is correct when it equals the prediction before it: `next_token` for
    t = 0, else `guess_predictions[g, t-1]`.
    """
    if guesses.numel() == 0:
        return Verdict([next_token], -1, 0)
    expected = torch.cat([torch.full_like(guesses[:, :1], next_token), guess_predictions], dim=1)  # [G, M+1]
    matched = (guesses == expected[:, :-1]).cumprod(dim=1).sum(dim=1)
    best = int(matched.argmax())
    count = int(matched[best])
    if count == 0:
        return Verdict([next_token], -1, 0)
    return Verdict(expected[best, : count + 1].tolist(), best, count)

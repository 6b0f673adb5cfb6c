"""Drafts and the sources that propose them: one small interface, whatever the source.

A proposer sees the committed text and proposes drafts (guessed continuations of it); it learns from the
tokens committed after each step. It knows no model and no cache: the drafter merges every source's
drafts into one token tree under the step's budget, and the model verifies the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]  # the guessed continuation of the text, first token first
    source: str  # the proposer's name, for acceptance statistics and reports
    context: int = 1  # how many tokens of the text's end the draft's source matched (longer: likelier)


class Proposer(Protocol):
    name: str

    def propose(self, text: Sequence[int], limit: int) -> list[Draft]:
        """Drafts continuing `text` (the committed tokens), each at most `limit` tokens, best first."""
        ...

    def observe(self, text: Sequence[int], new: int) -> None:
        """The last `new` tokens of `text` were just committed (all of it, on the first call)."""
        ...

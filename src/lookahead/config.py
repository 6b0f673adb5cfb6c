"""Lookahead decoding parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from .arguments import checked_int

# The window's rows with the last token are at most this: at most half of a step, drafts the rest.
WINDOW_ROWS_BELOW = 128


@dataclass(frozen=True)
class LookaheadConfig:
    """Shape of one lookahead step.

    window:  W, columns of the 2-D Jacobi window (0 turns the lookahead branch off).
    ngram:   N, size of the cached n-grams; the window keeps N-1 levels and a guess is N-1 tokens.
    guesses: G, the pool's n-grams verified per step, and kept per key in the pool (0: the pool proposes
             none; with no other source, nor `proposers=` of the caller's, one token per step: plain decoding).
    seed_from_prompt: put the prompt's own n-grams into the pool before the first step.
    learn_from_output: put the n-grams of the committed output into the pool as they appear.
    seed: seed for the random prompt tokens that start the window.
    suffix:  the longest draft of the suffix source, which continues the longest earlier occurrences of
             the text's end in the prompt, the output and a shared corpus (0 turns it off).
    recycle: how many of the model's likeliest next tokens the recycle source keeps per token, from every
             row a step feeds; it drafts from them where no earlier text matches (0 turns it off).
    budget:  size each step to the model's measured forward cost: keep the draft-tree nodes that maximise
             expected tokens per second (at most 64) and give the window (at most `window` columns)
             rows only where they are nearly free. False: feed every draft and the whole window.
    """

    window: int = 5
    ngram: int = 4
    guesses: int = 5
    seed_from_prompt: bool = True
    learn_from_output: bool = True
    seed: int = 0
    suffix: int = 0
    recycle: int = 0
    budget: bool = False

    def __post_init__(self) -> None:
        self._check_int("window", 0, "an integer >= 0 (0 disables the lookahead branch)")
        self._check_int("ngram", 2, "an integer >= 2")
        self._check_int("guesses", 0, "an integer >= 0 (0: the pool proposes no n-grams)")
        self._check_int("suffix", 0, "an integer >= 0 (0 disables the suffix source)")
        self._check_int("recycle", 0, "an integer >= 0 (0 disables the recycle source)")
        for name in ("seed_from_prompt", "learn_from_output", "budget"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LookaheadConfig.{name} must be a bool, got {getattr(self, name)!r}")
        self._check_int("seed", 0, "an integer >= 0")
        if 1 + self.window * self.levels > WINDOW_ROWS_BELOW:
            raise ValueError(f"the window of {self.window} x {self.levels} rows is too large for one step; "
                             f"window x (ngram - 1) must be below {WINDOW_ROWS_BELOW}")

    def _check_int(self, name: str, minimum: int, allowed: str) -> None:
        """The field as a Python int (a numpy integer is taken as the int it holds), or ValueError naming it."""
        object.__setattr__(self, name, checked_int(f"LookaheadConfig.{name}", getattr(self, name), minimum,
                                                   allowed=allowed))

    @property
    def levels(self) -> int:
        """Levels of the lookahead window (Jacobi iterations kept)."""
        return self.ngram - 1

    @property
    def label(self) -> str:
        """Short name in reports: W5N4G5, W0N4G5S32, auto (the default) or W5N4G5S32R4-budget."""
        if self == AUTO_CONFIG:
            return "auto"
        sources = (f"S{self.suffix}" if self.suffix else "") + (f"R{self.recycle}" if self.recycle else "")
        return f"W{self.window}N{self.ngram}G{self.guesses}{sources}" + ("-budget" if self.budget else "")



# What `config=None` means: every source, each step sized to the device's measured cost curve.
AUTO_CONFIG = LookaheadConfig(window=5, ngram=4, guesses=5, suffix=32, recycle=4, budget=True)
# Lookahead off: one token per step through the same loop (the baseline our own engine is compared with),
# unless the caller adds draft sources of its own.
PLAIN_CONFIG = LookaheadConfig(window=0, guesses=0)

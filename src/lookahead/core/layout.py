"""Layout of one step's input: [last token | window levels | guesses], with positions and attention.

Rows: 0 is the last committed token; then level l, column i of the window at 1 + l*W + i; then guess g,
token t at 1 + L*W + g*M + t (M tokens per guess). Positions are offsets from the last token's position.

Attention inside the step (everything attends to the whole committed prefix as well):
- every row sees row 0 and itself;
- window (l, i) sees level 0 at columns <= i and levels 1..l at column i, so that its context is the
  contiguous chain of positions 1 .. l+i+1;
- guess (g, t) sees tokens 0..t of guess g.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class StepLayout:
    offsets: torch.Tensor  # [q] long: position of each row minus the last token's position
    allowed: torch.Tensor  # [q, q] bool: row may attend column
    window_rows: torch.Tensor  # [W] long: rows of the newest window level
    guess_rows: torch.Tensor  # [G, M] long
    logit_rows: torch.Tensor  # [1 + W + G*M] long: rows whose next-token predictions the step needs

    @property
    def size(self) -> int:
        return self.offsets.numel()


@lru_cache(maxsize=256)
def step_layout(levels: int, width: int, guesses: int, guess_len: int) -> StepLayout:
    """Build (once per shape) the layout of a step with `levels` x `width` window and `guesses` x `guess_len`."""
    n_window, n_guess = levels * width, guesses * guess_len
    size = 1 + n_window + n_guess
    # Per-row coordinates; -1 marks "not in this branch".
    level = torch.full((size,), -1)
    column = torch.full((size,), -1)
    guess = torch.full((size,), -1)
    depth = torch.full((size,), -1)
    window_slice = slice(1, 1 + n_window)
    guess_slice = slice(1 + n_window, size)
    level[window_slice] = torch.arange(levels).repeat_interleave(width)
    column[window_slice] = torch.arange(width).repeat(levels)
    guess[guess_slice] = torch.arange(guesses).repeat_interleave(guess_len)
    depth[guess_slice] = torch.arange(guess_len).repeat(guesses)

    offsets = torch.zeros(size, dtype=torch.long)
    offsets[window_slice] = level[window_slice] + column[window_slice] + 1
    offsets[guess_slice] = depth[guess_slice] + 1

    row_level, col_level = level[:, None], level[None, :]
    row_column, col_column = column[:, None], column[None, :]
    in_window = (row_level >= 0) & (col_level >= 0)
    window_sees = in_window & (
        ((col_level == 0) & (col_column <= row_column)) | ((col_column == row_column) & (col_level <= row_level))
    )
    in_guesses = (guess[:, None] >= 0) & (guess[None, :] >= 0)
    guess_sees = in_guesses & (guess[:, None] == guess[None, :]) & (depth[None, :] <= depth[:, None])
    allowed = window_sees | guess_sees | torch.eye(size, dtype=torch.bool)
    allowed[:, 0] = True

    window_rows = torch.arange(1 + (levels - 1) * width, 1 + n_window) if levels else torch.zeros(0, dtype=torch.long)
    guess_rows = torch.arange(1 + n_window, size).view(guesses, guess_len)
    logit_rows = torch.cat([torch.zeros(1, dtype=torch.long), window_rows, guess_rows.flatten()])
    return StepLayout(offsets, allowed, window_rows, guess_rows, logit_rows)

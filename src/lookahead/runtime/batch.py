"""Packs the steps of many sequences into one forward: rows padded to a common height, one batch row per
sequence, each attending to its own cached prefix and, within the step, to what its layout allows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StepInput:
    """One sequence's rows in a step: tokens at `offsets` after the position of its next cached entry,
    `allowed` [q, q] attention among them, and the rows whose logits are read."""

    tokens: torch.Tensor  # [q] long
    offsets: torch.Tensor  # [q] long
    allowed: torch.Tensor  # [q, q] bool
    logit_rows: torch.Tensor  # [r] long


def causal_step(tokens: torch.Tensor, logits: int = 1) -> StepInput:
    """Tokens in a row, each after the one before (a prompt chunk); logits for the last `logits` rows."""
    size = tokens.numel()
    return StepInput(tokens, torch.arange(size), torch.ones(size, size, dtype=torch.bool).tril(),
                     torch.arange(size - logits, size))


@dataclass(frozen=True)
class StepBatch:
    slots: list[int]
    tokens: torch.Tensor  # [B, h] long; padding rows hold token 0
    positions: torch.Tensor  # [B, h] long
    visible: torch.Tensor  # [B, h, attend] bool: row may attend the slot's key at that column
    key_positions: torch.Tensor  # [B, attend] long: the position of the token cached at each column
    logit_rows: torch.Tensor  # [U] long: every row any sequence reads, sorted
    picks: list[torch.Tensor | None]  # per sequence: its rows' places in `logit_rows` (None: all of them)
    sizes: tuple[int, ...]  # per sequence: its rows before the padding

    @property
    def height(self) -> int:
        return self.tokens.shape[1]

    @property
    def padded(self) -> bool:
        return any(size < self.height for size in self.sizes)

    def real_rows(self) -> torch.Tensor:
        """[sum(sizes)] long: the rows that are not padding, as indices into the [B * h] flattened rows."""
        return torch.cat([b * self.height + torch.arange(size) for b, size in enumerate(self.sizes)])


@dataclass(frozen=True)
class StepLogits:
    """A step's logits as its forward computed them: `computed` [B, U, vocab] (`index` None), or the distinct
    rows [M, vocab] of a ragged forward with `index` [B, U] saying which of them each sequence's logit rows
    are (a sequence shorter than the tallest repeats its last row). Spreading those to [B, U, vocab] copied
    up to tens of MB a step (8 sequences, one of 17 rows and seven of one: 27 MB, float32), most of them
    repeats that nobody reads."""

    computed: torch.Tensor
    index: torch.Tensor | None = None

    def of(self, sequence: int, picks: torch.Tensor | None = None) -> torch.Tensor:
        """Sequence `sequence`'s logit rows [U, vocab], or those at `picks` (places in the step's logit rows)."""
        if self.index is None:
            rows = self.computed[sequence]
            return rows if picks is None else _gathered(rows, picks.to(rows.device))
        index = self.index[sequence] if picks is None else self.index[sequence, picks.to(self.index.device)]
        return _gathered(self.computed, index)

    def dense(self) -> torch.Tensor:
        """[B, U, vocab]."""
        return self.computed if self.index is None else self.computed[self.index]


# Same-size integer views of the float dtypes, so that numpy (which lacks bfloat16) copies their rows.
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _gathered(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rows[index]`, a copy. On a CPU in numpy, by the rows' bits: torch's gather of a few 49k-vocabulary rows runs
    on its thread pool, whose wake-up after the forward cost from 0.1 to several ms a call on a 2-core CPU."""
    bits = _BITS.get(rows.dtype)
    if (rows.device.type != "cpu" or bits is None or rows.requires_grad or index.dim() != 1
            or index.dtype != torch.long):
        return rows[index]
    return torch.from_numpy(rows.view(bits).numpy()[index.numpy()]).view(rows.dtype)


def pack_steps(slots: Sequence[int], lengths: Sequence[int], steps: Sequence[StepInput]) -> StepBatch:
    """`lengths[b]`: positions already cached for sequence b, which are also the positions of its tokens;
    the step's rows are written from there on. Padding rows see only themselves and repeat their
    sequence's last position. (Built in numpy: a step is a few dozen small array operations, each several
    times cheaper there than as a torch call.)"""
    batch = len(steps)
    height = max(step.tokens.numel() for step in steps)
    cached = np.asarray(lengths, dtype=np.int64)
    attend = int(cached.max()) + height
    tokens = np.zeros((batch, height), dtype=np.int64)
    offsets = np.tile(np.arange(height), (batch, 1))
    inner = np.tile(np.eye(height, dtype=bool), (batch, 1, 1))
    for b, step in enumerate(steps):
        size = step.tokens.numel()
        tokens[b, :size] = step.tokens.numpy()
        offsets[b, :size] = step.offsets.numpy()
        offsets[b, size:] = offsets[b, size - 1]  # padding rows: a position inside the model's context
        inner[b, :size, :size] = step.allowed.numpy()
    columns = np.arange(attend)
    step_columns = cached[:, None] + np.arange(height)  # [B, h]: where each row's key is written
    visible = np.repeat((columns < cached[:, None])[:, None, :], height, axis=1)
    sequence = np.arange(batch)
    visible[sequence[:, None, None], np.arange(height)[None, :, None], step_columns[:, None, :]] = inner
    positions = cached[:, None] + offsets
    key_positions = np.tile(columns, (batch, 1))
    key_positions[sequence[:, None], step_columns] = positions
    logit_rows, picks = _shared_rows([step.logit_rows for step in steps])
    return StepBatch(list(slots), torch.from_numpy(tokens), torch.from_numpy(positions), torch.from_numpy(visible),
                     torch.from_numpy(key_positions), logit_rows, picks, tuple(step.tokens.numel() for step in steps))


def _shared_rows(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The union of the sequences' logit rows, and where each sequence's rows sit in it."""
    union = torch.unique(torch.cat(list(rows)))  # sorted
    if all(r.numel() == union.numel() and bool((r == union).all()) for r in rows):
        return union, [None] * len(rows)
    place = torch.full((int(union.max()) + 1,), -1, dtype=torch.long)
    place[union] = torch.arange(union.numel())
    return union, [place[r] for r in rows]


def after_tokens(prefix: torch.Tensor, step: StepInput) -> StepInput:
    """`step` preceded by `prefix`, a causal chain of tokens that every row of the step attends to: the
    committed tokens whose keys and values this process has not computed yet."""
    count, size = prefix.numel(), step.tokens.numel()
    if count == 0:
        return step
    allowed = torch.zeros(count + size, count + size, dtype=torch.bool)
    allowed[:count, :count] = torch.ones(count, count, dtype=torch.bool).tril()
    allowed[count:, :count] = True
    allowed[count:, count:] = step.allowed
    return StepInput(torch.cat([prefix, step.tokens]), torch.cat([torch.arange(count), step.offsets + count]),
                     allowed, step.logit_rows + count)


def pad_batch(batch: StepBatch, cached: Sequence[int], height: int, attend: int,
              slots: Sequence[int] | None = None) -> StepBatch:
    """`batch` as a forward of fixed shape: `height` rows per sequence and `attend` key columns, over `slots`
    (default: the batch's own; else any slots including them, in order; `cached[i]`: the positions slot
    `slots[i]` has cached, after which its step's keys are written). The extra rows repeat the sequence's
    last position and see only their own key, written after the step's rows where nothing is kept; a slot
    not in the batch gets only such rows. A compiled forward then meets a few shapes instead of one per
    step."""
    slots = list(batch.slots if slots is None else slots)
    rows, columns = batch.height, batch.visible.shape[-1]
    starts = np.asarray(cached, dtype=np.int64)
    if (height < rows or attend < columns or int(starts.max()) + height > attend or len(starts) != len(slots)
            or not set(batch.slots) <= set(slots)):
        raise ValueError(f"cannot pad a step of {rows} rows over {columns} columns to {height} x {attend} "
                         f"over slots {slots}")
    place = np.array([slots.index(slot) for slot in batch.slots])  # each sequence's row of the padded step
    count = len(slots)
    tokens = np.zeros((count, height), dtype=np.int64)
    tokens[place, :rows] = batch.tokens.numpy()
    step_positions = batch.positions.numpy()
    positions = np.repeat(starts[:, None], height, axis=1)
    positions[place] = step_positions[:, -1:]
    positions[place, :rows] = step_positions
    visible = np.zeros((count, height, attend), dtype=bool)
    visible[place, :rows, :columns] = batch.visible.numpy()
    key_positions = np.zeros((count, attend), dtype=np.int64)
    key_positions[place, :columns] = batch.key_positions.numpy()
    first_extra = np.zeros(count, dtype=np.int64)
    first_extra[place] = rows
    sequence, row = np.nonzero(np.arange(height)[None, :] >= first_extra[:, None])  # the extra rows
    own = starts[sequence] + row  # where each extra row's key is written
    visible[sequence, row, own] = True
    key_positions[sequence, own] = positions[sequence, row]
    sizes = np.zeros(count, dtype=np.int64)  # slots not in the batch: padding alone
    sizes[place] = batch.sizes
    return StepBatch(slots, torch.from_numpy(tokens), torch.from_numpy(positions), torch.from_numpy(visible),
                     torch.from_numpy(key_positions), batch.logit_rows, batch.picks, tuple(sizes.tolist()))

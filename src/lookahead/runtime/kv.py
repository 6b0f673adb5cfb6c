"""A KV store with one length per sequence: preallocated slots, written in place, rolled back by a length."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class KVStore(Cache):
    """Keys and values of up to `slots` sequences of `capacity` positions each, one buffer per layer of
    shape [slots, kv heads, capacity, head dim], allocated by the first forward and never again.

    A sequence owns a slot whose first `lengths[slot]` positions are committed. A forward covers some
    slots (`begin`): batch row b writes its step's rows at its slot's length onward, and attention reads
    the first `attend` positions of every covered slot (the caller's mask says which of them each row
    sees). Committing (`keep`) moves the kept rows of a step down in place and sets the length; whatever
    lies past a length is stale and is overwritten by later steps. A sequence joining, leaving or
    accepting tokens copies no cache: only `move` (a sequence changing slot) copies its own rows.
    """

    def __init__(self, num_layers: int, slots: int, capacity: int) -> None:
        super().__init__(layers=[_StoreLayer(self, index) for index in range(num_layers)])
        self.slots = slots
        self.capacity = capacity
        self.lengths = [0] * slots
        self.key_buffers: list[torch.Tensor | None] = [None] * num_layers
        self.value_buffers: list[torch.Tensor | None] = [None] * num_layers
        self._rows: slice | torch.Tensor | None = None  # the slots of this forward, in batch order (None: the first)
        self._count = torch.empty(0, dtype=torch.uint8)  # as many entries as the forward has sequences
        self._slot_index: torch.Tensor | None = None  # [B, 1, 1] the same slots, as an index
        self._write: torch.Tensor | None = None  # [B, 1, q] position each new row is written at
        self._flat: tuple[int, torch.Tensor] | None = None  # key/value heads, and `_flat_rows` for them
        self._ragged: tuple[torch.Tensor, torch.Tensor] | None = None  # a ragged forward's slot and position per row
        # The positions attention reads, as the length of a tensor rather than an int, marked dynamic (as is
        # every buffer's capacity): a compiled forward takes them as sizes instead of compiling per length.
        self._span = torch.empty(0, dtype=torch.uint8)

    def begin(self, slots: Sequence[int], rows: int, attend: int, device: torch.device,
              ragged: torch.Tensor | None = None) -> None:
        """Set up a forward whose batch row b feeds `rows` rows for slot `slots[b]`; attention reads the
        first `attend` positions of each slot. `ragged`: the forward feeds only these of the [B * rows]
        rows (indices b * rows + r), flattened into one sequence, and writes only theirs (eager only)."""
        starts = torch.tensor([self.lengths[slot] for slot in slots], dtype=torch.long)
        end = int(starts.max()) + rows
        if end > self.capacity or attend > self.capacity:
            raise ValueError(f"a step of {rows} rows after {int(starts.max())} cached positions exceeds the "
                             f"KV store's capacity of {self.capacity} positions per sequence")
        first = slots[0]
        contiguous = list(slots) == list(range(first, first + len(slots)))
        self._slot_index = torch.tensor(slots, device=device).view(-1, 1, 1)
        # The first slots (every compiled step: hf pads them so) are read as a prefix whose length is a
        # tensor's, not an int: a compiled forward then takes the number of sequences as a size.
        self._rows = None if contiguous and first == 0 else (
            slice(first, first + len(slots)) if contiguous else self._slot_index.view(-1))
        self._count = torch.empty(len(slots), dtype=torch.uint8)
        self._write = (starts[:, None] + torch.arange(rows)).view(len(slots), 1, rows).to(device)
        self._flat = None
        if ragged is not None:
            sequence = ragged // rows
            self._ragged = (torch.tensor(slots)[sequence].to(device), (starts[sequence] + ragged % rows).to(device))
        else:
            self._ragged = None
        self._span = torch.empty(attend, dtype=torch.uint8)
        for tensor, dim in ((self._span, 0), (self._count, 0), (self._slot_index, 0), (self._write, 0),
                            (self._write, 2)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.key_buffers[layer_idx] is None:
            shape = (self.slots, key_states.shape[1], self.capacity, key_states.shape[-1])
            self.key_buffers[layer_idx] = key_states.new_zeros(shape)
            self.value_buffers[layer_idx] = value_states.new_zeros(
                (self.slots, value_states.shape[1], self.capacity, value_states.shape[-1]))
            # Stores of any number of slots share graphs; not while dynamo traces the forward that allocates them (a
            # model whose forward its owner compiled), where the call is refused.
            for buffer in (self.key_buffers[layer_idx], self.value_buffers[layer_idx]):
                if not torch.compiler.is_compiling():
                    torch._dynamo.maybe_mark_dynamic(buffer, 0)
                    torch._dynamo.maybe_mark_dynamic(buffer, 2)
        return (self._write_and_read(self.key_buffers[layer_idx], key_states),
                self._write_and_read(self.value_buffers[layer_idx], value_states))

    def _write_and_read(self, buffer: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Compiled, an indexed write into the buffer itself runs in place, where a write into a view of
            # it compiles to a copy of the whole buffer and a copy back (2 per layer, each as long as the
            # store's capacity: 2-4 ms of a step on the default model).
            heads = torch.arange(new.shape[1], device=new.device).view(1, -1, 1)
            buffer[self._slot_index, heads, self._write] = new
        else:
            # Eager, the step's rows are copied to their rows of the flattened buffer, indexed once per forward:
            # the cheapest write measured (6-14 us a layer). A scatter_ along the positions costs as much in
            # float32 but copies the whole buffer in bfloat16 (CPU): 0.55 ms a layer for one slot of 4,352
            # positions, 28 ms for 16 slots.
            head_dim = new.shape[-1]
            buffer.view(-1, head_dim).index_copy_(0, self._flat_rows(new.shape[1]), new.reshape(-1, head_dim))
        return self._slots_of(buffer)[:, :, : self._span.shape[0]]

    def _flat_rows(self, heads: int) -> torch.Tensor:
        """Where this forward's new rows go in a buffer viewed as [slots * heads * capacity, head dim], in the
        order (sequence, head, row) of the keys and values a layer hands over."""
        if self._flat is None or self._flat[0] != heads:
            head = torch.arange(heads, device=self._write.device).view(1, -1, 1)
            if self._ragged is None:
                self._flat = heads, ((self._slot_index * heads + head) * self.capacity + self._write).view(-1)
            else:  # keys and values of one flattened sequence, [1, heads, rows, head dim]
                slot, position = self._ragged
                self._flat = heads, ((slot * heads + head) * self.capacity + position).view(-1)
        return self._flat[1]

    def _slots_of(self, buffer: torch.Tensor) -> torch.Tensor:
        """The forward's slots of `buffer`: a view for consecutive slots (the usual case), else a copy."""
        return buffer[: self._count.shape[0]] if self._rows is None else buffer[self._rows]

    @torch.inference_mode()
    def keep(self, slot: int, kept: torch.Tensor) -> None:
        """Commit a step: the slot keeps its cached prefix plus the step rows `kept` (offsets from its
        length, in order); the rest of the step is dropped."""
        past = self.lengths[slot]
        count = kept.numel()
        if not bool((kept == torch.arange(count)).all()):
            source = (past + kept).to(self._device())
            for buffer in (*self.key_buffers, *self.value_buffers):
                if buffer is not None:
                    buffer[slot, :, past : past + count] = buffer[slot].index_select(1, source)
        self.lengths[slot] = past + count

    def extend(self, slot: int, count: int) -> None:
        """Commit the `count` rows a prefill chunk wrote after the slot's length."""
        self.lengths[slot] += count

    @torch.inference_mode()
    def move(self, source: int, target: int) -> None:
        """Give the sequence in slot `source` the slot `target` (its rows are copied)."""
        length = self.lengths[source]
        for buffer in (*self.key_buffers, *self.value_buffers):
            if buffer is not None:
                buffer[target, :, :length] = buffer[source, :, :length]
        self.lengths[target], self.lengths[source] = length, 0

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0

    def allocated(self) -> bool:
        return self.key_buffers[0] is not None

    def _device(self) -> torch.device:
        buffer = self.key_buffers[0]
        return buffer.device if buffer is not None else torch.device("cpu")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._span.shape[0]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._span.shape[0], 0


class _StoreLayer(CacheLayerMixin):
    """A layer's view for transformers' bookkeeping; the data lives in the store."""

    def __init__(self, store: KVStore, index: int) -> None:
        super().__init__()
        self.store, self.index = store, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.store.update(key_states, value_states, self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.store.get_seq_length()

    def get_max_length(self) -> int:
        return self.store.capacity

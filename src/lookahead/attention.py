"""SDPA over grouped-query attention's key/value heads as they are, for steps of any height, with a mask.

Given a mask and more than one query row, transformers' SDPA path repeats every key/value head for its
query heads (a copy of the layer's cache per step); SDPA's own `enable_gqa` avoids the copy, but its CPU
kernel is slow at a few rows (8 sequences of 2 rows over 400 positions: 2.1x 8 of one row, bfloat16).
Here each key/value head's query heads are stacked as rows of one query instead, the mask repeated for
them (transformers does this for one-row steps without a mask, `pack_gqa`): the same products, without
the copy, on the kernel's fast path. Whole steps of 8-16 sequences of 2-4 rows ran 1.09-1.17x faster in
bfloat16, float32 within noise (docs/benchmarks.md, session 18).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "lookahead_sdpa"
# Options that transformers' SDPA path folds into the mask or refuses: left to it.
_ITS_OWN = ("position_bias", "softcap", "s_aux", "sinks", "output_attentions")


def stacked_heads_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, heads, Q, D], key and value [B, kv heads, L, D], an
    additive or boolean mask [B, 1, Q, L]; returns [B, Q, heads, D], as transformers' SDPA path does."""
    # Compiled forwards are all ours (`HFModelRunner`); eagerly, another thread may be transformers' own.
    ours = torch.compiler.is_compiling() or getattr(_THREAD, "ours", False)
    ragged = getattr(_THREAD, "ragged", None) if ours else None
    if ragged is not None:
        return _ragged_attention(module, query, key, value, attention_mask, ragged, dropout, scaling, **kwargs)
    group = query.shape[1] // key.shape[1]
    if not ours or not _stacks(group, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _stacked_attention(query, key, value, _masks(attention_mask, group)[0], dropout, scaling), None


def _stacks(group: int, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether `_stacked_attention` computes what transformers' SDPA path would."""
    return (group > 1 and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and all(kwargs.get(name) is None or kwargs.get(name) is False for name in _ITS_OWN))


def _stacked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, repeated_mask: torch.Tensor,
                       dropout: float, scaling: float | None) -> torch.Tensor:
    """SDPA with each key/value head's query heads stacked as rows; `repeated_mask`: the mask's rows repeated
    for each head of a group (`_masks`)."""
    batch, heads, rows, dim = query.shape
    stacked = query.reshape(batch, key.shape[1], -1, dim)  # row i * Q + q: head i of the group, row q
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=repeated_mask,
                                                           dropout_p=dropout, scale=scaling)
    # The output has the values' head size, which MLA models (DeepSeek-V2/V3) make smaller than the query's.
    return out.view(batch, heads, rows, value.shape[-1]).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class _Part:
    """One attention call of a ragged forward: the query rows `rows` ([n, r] indices into the flattened
    rows; a padding entry points at the zero row appended after them) of the sequences `sequences` (a slice
    of the batch, so that their keys are a view), against the mask's rows `mask_rows` and the first `keys`
    key columns (as far as any of those sequences' rows reaches)."""

    sequences: slice
    rows: torch.Tensor
    mask_rows: slice
    real: torch.Tensor | None  # where `rows` has padding: the real entries, flattened (None: all are)
    keys: int


@dataclass(frozen=True)
class RaggedLayout:
    """Where a ragged forward's rows go in attention (`ragged_rows`): either one call over the whole batch with
    every sequence padded to the tallest, or one call for the rows every sequence has (as many as the shortest
    has) and one per taller sequence for the rest of its rows, over its own keys; whichever `CALL_IN_ROWS`
    prices lower. A call per taller sequence costs a call's overhead each; one call pads every sequence to
    the tallest: one sequence of 16 rows beside seven of one, over 300 positions, spent 47 ms a step in
    attention against 17 ms for 8 one-row sequences (float32, 2 cores), and a prompt chunk of 779 tokens
    beside seven of 40-364 would pad each of them to 779 rows. Each call reads keys only as far as its
    sequences' rows reach: the step's key columns run to the longest cache plus the tallest sequence (a
    prompt chunk of 256 rows beside 15 one-row sequences over 300 cached positions had them read 556 columns
    of keys, not 301)."""

    parts: tuple[_Part, ...]
    count: int  # rows in all

    # A call of attention costs about as much as this many more query rows of each sequence it attends over
    # (a call ~39 us a layer, a row of a sequence ~4.6 us, over 300 positions on a 2-core EPYC, float32).
    # Alternating forward by forward, 8 sequences: three of 2 rows beside five of one, 4.2 ms a step faster
    # in one call; one of 3 rows beside seven of one, 1.9 ms faster split (session 31).
    CALL_IN_ROWS = 8

    @staticmethod
    def of(sizes: Sequence[int], cached: Sequence[int], device: torch.device) -> RaggedLayout:
        """`sizes[b]`: sequence b's rows; `cached[b]`: the positions it had cached before them."""
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        ends = [length + size for length, size in zip(cached, sizes)]  # key columns each sequence reads
        count, common, tallest = sum(sizes), min(sizes), max(sizes)
        taller = [b for b, size in enumerate(sizes) if size > common]
        split = sum(RaggedLayout.CALL_IN_ROWS + sizes[b] - common for b in taller)  # what their calls cost
        if len(sizes) * (tallest - common) <= split:  # one call, padded to the tallest
            rows = torch.tensor([[start + r if r < size else count for r in range(tallest)]
                                 for start, size in zip(starts, sizes)], device=device)
            real = (rows < count).view(-1) if taller else None
            return RaggedLayout((_Part(slice(0, len(sizes)), rows, slice(0, tallest), real, max(ends)),), count)
        rows = torch.tensor([[start + r for r in range(common)] for start in starts], device=device)
        parts = [_Part(slice(0, len(sizes)), rows, slice(0, common), None, max(ends))]
        parts += [_Part(slice(b, b + 1), torch.arange(starts[b] + common, starts[b] + sizes[b], device=device)[None],
                        slice(common, sizes[b]), None, ends[b]) for b in taller]
        return RaggedLayout(tuple(parts), count)


def _ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor, layout: RaggedLayout, dropout: float, scaling: float | None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Attention for a ragged forward: the query's rows [1, heads, N, D] are every sequence's rows one after
    another, the keys and values [B, kv heads, L, D] and the mask [B, 1, h, L] per sequence as in a padded
    step; each part of `layout` is laid out as a padded step and run through the usual path."""
    heads, dim, value_dim = query.shape[1], query.shape[3], value.shape[3]  # value_dim < dim in MLA models
    group = heads // key.shape[1]
    stacks = _stacks(group, attention_mask, kwargs)
    masks = _masks(attention_mask, group if stacks else 1, layout)
    flat = torch.cat([query[0].transpose(0, 1), query.new_zeros(1, heads, dim)])  # [N + 1, heads, D]
    out = query.new_empty(layout.count, heads, value_dim)
    for part, mask in zip(layout.parts, masks):
        sequences, keys = part.sequences, slice(0, part.keys)
        padded = flat[part.rows].transpose(1, 2)  # [n, heads, r, D]
        if stacks:
            result = _stacked_attention(padded, key[sequences, :, keys], value[sequences, :, keys], mask, dropout,
                                        scaling)
        else:
            result, _ = sdpa_attention_forward(module, padded, key[sequences, :, keys], value[sequences, :, keys],
                                               mask, dropout=dropout, scaling=scaling, **kwargs)
        result = result.reshape(-1, heads, value_dim)  # [n * r, heads, value D]
        if part.real is None:
            out[part.rows.view(-1)] = result
        else:
            out[part.rows.view(-1)[part.real]] = result[part.real]
    return out.unsqueeze(0), None


@contextmanager
def ragged_rows(layout: RaggedLayout) -> Iterator[None]:
    """Inside, our forwards take several sequences' steps flattened into one sequence, the sequences' rows one
    after another (no padding between them): the model's layers compute only those rows, and attention lays
    them out per sequence again (`RaggedLayout`). The mask, keys and values stay per sequence, as in a padded
    step. For use inside `stacked_heads`."""
    with _on_this_thread("ragged", layout):
        yield


@contextmanager
def _on_this_thread(name: str, value: object) -> Iterator[None]:
    """`_THREAD.<name>` is `value` inside, and what it was after."""
    outer = getattr(_THREAD, name, None)
    setattr(_THREAD, name, value)
    try:
        yield
    finally:
        setattr(_THREAD, name, outer)


def loaded_attention(config) -> str | None:
    """The attention implementation `config` names, ours (set by `stacked_heads` while a forward of ours runs,
    maybe in another thread) counted as the SDPA it stands for."""
    attention = getattr(config, "_attn_implementation", None)
    return "sdpa" if attention == NAME else attention


def routes(model: PreTrainedModel) -> bool:
    """Whether `stacked_heads` routes this model's attention through `stacked_heads_attention` (which ragged
    forwards need): SDPA on a CPU."""
    return model.device.type == "cpu" and loaded_attention(model.config.get_text_config(decoder=True)) == "sdpa"


# (id(mask), id(layout)) -> (mask, layout, group, masks): what `_masks` made for the forward in progress
_MASKS: dict[tuple[int, int], tuple[torch.Tensor, RaggedLayout | None, int, list[torch.Tensor]]] = {}


def _masks(mask: torch.Tensor, group: int, layout: RaggedLayout | None = None) -> list[torch.Tensor]:
    """The mask's rows repeated for each head of a group, [B, 1, group * Q, L]: the whole mask, or for a ragged
    forward each part's sequences, rows and key columns of it. Every layer of a forward gets the same mask, so
    eagerly they are made once a forward (cut and repeated once a layer, a part's took 20 us: 8 sequences,
    three of them taller, spent 2.5 ms of a 41 ms step so; session 31). An entry keeps its mask and layout
    alive, so their ids are not reused."""

    def made() -> list[torch.Tensor]:
        cuts = [mask] if layout is None else [mask[part.sequences, :, part.mask_rows, :part.keys]
                                              for part in layout.parts]
        return [cut.repeat(1, 1, group, 1) for cut in cuts] if group > 1 else cuts

    if torch.compiler.is_compiling():
        return made()
    entry = _MASKS.get((id(mask), id(layout)))
    if entry is None or entry[2] != group:
        if len(_MASKS) >= 4:  # a forward's masks (two with sliding-window layers); older ones are done
            _MASKS.clear()
        entry = _MASKS[id(mask), id(layout)] = (mask, layout, group, made())
    return entry[3]


AttentionInterface.register(NAME, stacked_heads_attention)
# Masks as for SDPA: forwards of transformers' own beside ours (another thread) build theirs by this name,
# and would otherwise get none (padding unmasked).
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def stacked_heads(model: PreTrainedModel) -> Iterator[None]:
    """Route the model's attention through `stacked_heads_attention` for the forwards inside, where the
    model runs SDPA on a CPU; its own setting is back once no forward of ours runs on it. Other threads
    (transformers' `generate` of the same model beside a server's engine) meanwhile reach the function too,
    which runs transformers' SDPA path for them, unchanged."""
    if not routes(model):
        yield
        return
    config = model.config.get_text_config(decoder=True)  # whose attention layers our forwards run
    with _SWITCH:
        entry = _SWITCHED.get(id(config))
        if entry is None and config._attn_implementation == "sdpa":
            entry = _SWITCHED[id(config)] = [config, 0]
            config._attn_implementation = NAME
        if entry is not None:
            entry[1] += 1
    # (entry None: the model was loaded on our function itself, and stays so; our forwards are ours all the same:
    # their ragged rows need it.)
    try:
        with _on_this_thread("ours", True):
            yield
    finally:
        _MASKS.clear()
        if entry is not None:
            with _SWITCH:
                entry[1] -= 1
                if entry[1] == 0:
                    del _SWITCHED[id(config)]
                    config._attn_implementation = "sdpa"


_SWITCH = threading.Lock()
_SWITCHED: dict[int, list] = {}  # id(config) -> [config, forwards of ours running on it]
_THREAD = threading.local()  # .ours: this thread is inside one of our forwards

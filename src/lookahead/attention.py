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
from collections.abc import Iterator
from contextlib import contextmanager

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
    batch, heads, rows, dim = query.shape
    group = heads // key.shape[1]
    # Compiled forwards are all ours (`HFModelRunner`); eagerly, another thread may be transformers' own.
    ours = torch.compiler.is_compiling() or getattr(_THREAD, "ours", False)
    if (not ours or group == 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
            or any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _ITS_OWN)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    stacked = query.reshape(batch, key.shape[1], group * rows, dim)  # row i * Q + q: head i of the group, row q
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=_repeated(attention_mask, group), dropout_p=dropout, scale=scaling)
    return out.view(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


_REPEATED: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(mask) -> (mask, group, repeated)


def _repeated(mask: torch.Tensor, group: int) -> torch.Tensor:
    """The mask's rows repeated for each head of a group, [B, 1, group * Q, L]; every layer of a forward gets
    the same mask, so eagerly it is built once (the entry keeps the mask alive: its id is not reused)."""
    if torch.compiler.is_compiling():
        return mask.repeat(1, 1, group, 1)
    entry = _REPEATED.get(id(mask))
    if entry is None or entry[1] != group:
        if len(_REPEATED) >= 4:  # a forward's masks (two with sliding-window layers); older ones are done
            _REPEATED.clear()
        entry = _REPEATED[id(mask)] = (mask, group, mask.repeat(1, 1, group, 1))
    return entry[2]


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
    config = model.config.get_text_config(decoder=True)  # whose attention layers our forwards run
    if model.device.type != "cpu":
        yield
        return
    with _SWITCH:
        entry = _SWITCHED.get(id(config))
        if entry is None and config._attn_implementation == "sdpa":
            entry = _SWITCHED[id(config)] = [config, 0]
            config._attn_implementation = NAME
        if entry is not None:
            entry[1] += 1
    if entry is None:
        yield
        return
    outer = getattr(_THREAD, "ours", False)
    _THREAD.ours = True
    try:
        yield
    finally:
        _THREAD.ours = outer
        _REPEATED.clear()
        with _SWITCH:
            entry[1] -= 1
            if entry[1] == 0:
                del _SWITCHED[id(config)]
                config._attn_implementation = "sdpa"


_SWITCH = threading.Lock()
_SWITCHED: dict[int, list] = {}  # id(config) -> [config, forwards of ours running on it]
_THREAD = threading.local()  # .ours: this thread is inside one of our forwards

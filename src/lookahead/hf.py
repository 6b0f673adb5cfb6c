"""Adapter for Hugging Face causal LMs: runs one lookahead step through the model's public forward
(4-D attention mask, explicit position ids, a `DynamicCache`) and commits the cache afterwards."""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

SUPPORTED_ATTENTION = ("eager", "sdpa")
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


class UnsupportedModelError(ValueError):
    """The model cannot run lookahead steps (no custom masks, or a cache we cannot commit)."""


def vocabulary_size(model: PreTrainedModel) -> int:
    """Rows of the input embedding: the token ids the model can take are [0, vocabulary_size)."""
    return model.get_input_embeddings().num_embeddings


def context_length(model: PreTrainedModel) -> int | None:
    """The most positions the model was built for (None where its config does not say)."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends into spare capacity instead of concatenating.

    `DynamicLayer.update` copies the whole layer cache on every step (`torch.cat`); here `keys`/`values`
    are views of the first `length` positions of larger buffers, which double when full, so a step
    writes only its own rows. Rolling back is re-slicing the view.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self._key_buffer = self._value_buffer = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._key_buffer = self._grown(self._key_buffer, self.keys, key_states, end)
            self._value_buffer = self._grown(self._value_buffer, self.values, value_states, end)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values

    @staticmethod
    def _grown(buffer: torch.Tensor | None, kept: torch.Tensor, new: torch.Tensor, needed: int) -> torch.Tensor:
        capacity = max(needed, 2 * (0 if buffer is None else buffer.shape[-2]), 256)
        grown = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
        grown[..., : kept.shape[-2], :] = kept
        return grown


class PackedLinears:
    """oneDNN-prepacked copies of a CPU model's `nn.Linear` weights, swapped in for our forward passes only.

    On some CPUs oneDNN's linear on a prepacked weight runs 1.4-1.6x faster than the default BLAS path for
    the 1..64-row inputs of decoding steps (an AMD EPYC), on others slower (an AVX-512 Xeon): which path
    runs is measured per machine (`costs.cost_curve`). The model itself is left as it was: the packed forward is
    set on each Linear instance on entering `active()` and removed on leaving. It costs a second copy of
    the linear weights, taken when first used: later in-place weight changes are not seen.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._forwards: list[tuple[torch.nn.Linear, object]] = []
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                weight = module.weight.detach().to_mkldnn()
                bias = None if module.bias is None else module.bias.detach()
                self._forwards.append((module, _packed_forward(weight, bias)))

    @staticmethod
    def supported(model: torch.nn.Module) -> bool:
        return model.device.type == "cpu" and model.dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()

    @contextmanager
    def active(self) -> Iterator[None]:
        for module, forward in self._forwards:
            module.forward = forward
        try:
            yield
        finally:
            for module, _ in self._forwards:
                del module.forward


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return forward


_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, PackedLinears] = weakref.WeakKeyDictionary()


class HFModelRunner:
    """Wraps a causal LM; all lookahead glue that knows about transformers lives here."""

    def __init__(self, model: PreTrainedModel, packed_linear: bool | None = None) -> None:
        if not isinstance(model, PreTrainedModel) or not hasattr(model, "get_output_embeddings"):
            raise UnsupportedModelError(f"model must be a transformers causal LM, got {type(model).__name__}")
        config = model.config.get_text_config(decoder=True)
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        if attention not in SUPPORTED_ATTENTION:
            raise UnsupportedModelError(
                f"attention implementation {attention!r} cannot take a custom 4-D mask; load the model with "
                f"attn_implementation set to one of {SUPPORTED_ATTENTION}"
            )
        self.layer_types: list[str] | None = getattr(config, "layer_types", None)
        unsupported = set(self.layer_types or ()) - SUPPORTED_LAYER_TYPES
        if unsupported:
            raise UnsupportedModelError(
                f"{type(model).__name__} has layers of type {sorted(unsupported)}; lookahead needs attention layers "
                f"whose cache can be rolled back ({sorted(SUPPORTED_LAYER_TYPES)})"
            )
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModelError("encoder-decoder models are not supported; use a decoder-only causal LM")
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        if self.cache_argument not in parameters or "position_ids" not in parameters:
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward must accept attention_mask, position_ids and a cache"
            )
        self.keeps_some_logits = "logits_to_keep" in parameters
        # Sliding-window layers get a mask limited to the window; the cache itself keeps everything.
        window = getattr(config, "sliding_window", None)
        uses_sliding = self.layer_types is None or "sliding_attention" in self.layer_types
        self.sliding_window: int | None = window if (window and uses_sliding) else None
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.forward_seconds = 0.0  # time spent inside the model's forward, for profiling
        if packed_linear and not PackedLinears.supported(model):
            raise ValueError("packed_linear=True needs a float32 or bfloat16 model on CPU with oneDNN (mkldnn) available")
        # None: measure which path is faster here; `costs.cost_curve` decides and sets `packed_from`.
        self.packing: bool | None = packed_linear if packed_linear is not None else (
            None if PackedLinears.supported(model) else False)
        if self.packing is not False and model not in _PACKED:
            _PACKED[model] = PackedLinears(model)
        self._packed = _PACKED[model] if self.packing is not False else None
        self.packed_from: int | None = 1 if self.packing else None  # steps this long or longer run packed

    def _forward(self, input_ids: torch.Tensor, **kwargs):
        start = time.perf_counter()
        packed = self._packed is not None and self.packed_from is not None and input_ids.shape[1] >= self.packed_from
        with self._packed.active() if packed else nullcontext():
            out = self.model(input_ids=input_ids, use_cache=True, **kwargs)
        self.forward_seconds += time.perf_counter() - start
        return out

    def new_cache(self) -> DynamicCache:
        # No config: every layer is a full-length `GrowingLayer`, which can drop arbitrary entries.
        cache = DynamicCache()
        cache.layer_class_to_replicate = GrowingLayer
        return cache

    @torch.inference_mode()
    def prefill(self, cache: DynamicCache, tokens: torch.Tensor) -> None:
        """Run the committed tokens (1-D) through the model to fill the cache."""
        positions = torch.arange(tokens.numel(), device=self.device)
        kwargs = {"logits_to_keep": 1} if self.keeps_some_logits else {}
        self._forward(
            input_ids=tokens.view(1, -1).to(self.device),
            position_ids=positions.view(1, -1),
            **{self.cache_argument: cache},
            **kwargs,
        )
        self._check_cache(cache)

    @torch.inference_mode()
    def logits(
        self,
        cache: DynamicCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Feed one step (tokens at absolute positions, `allowed` [q, q] attention within the step)
        on top of the cached prefix; return the logits at `logit_rows` as [len(logit_rows), vocab]."""
        past = cache.get_seq_length()
        mask = self._attention_mask(past, positions, allowed)
        kwargs = {"logits_to_keep": logit_rows.to(self.device)} if self.keeps_some_logits else {}
        out = self._forward(
            input_ids=tokens.view(1, -1).to(self.device),
            position_ids=positions.view(1, -1).to(self.device),
            attention_mask=mask,
            **{self.cache_argument: cache},
            **kwargs,
        )
        logits = out.logits[0]
        return logits if self.keeps_some_logits else logits[logit_rows.to(self.device)]

    def _attention_mask(
        self, past: int, positions: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        size = positions.numel()
        visible = torch.cat([torch.ones(size, past, dtype=torch.bool), allowed], dim=1)
        full = self._additive(visible)
        if self.sliding_window is None:
            return full
        key_positions = torch.cat([torch.arange(past), positions])
        in_window = positions[:, None] - key_positions[None, :] < self.sliding_window
        sliding = self._additive(visible & in_window)
        if self.layer_types is None:
            return sliding
        return {"full_attention": full, "sliding_attention": sliding}

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.dtype)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask.view(1, 1, *visible.shape).to(self.device)

    @torch.inference_mode()
    def commit(self, cache: DynamicCache, past: int, kept_rows: torch.Tensor) -> None:
        """Keep the cached prefix plus the step rows `kept_rows` (in order); drop the rest of the step."""
        kept = past + kept_rows.to(self.device)
        length = past + kept_rows.numel()
        contiguous = bool((kept_rows == torch.arange(kept_rows.numel())).all())
        for layer in cache.layers:
            if not contiguous:
                layer.keys[..., past:length, :] = layer.keys.index_select(-2, kept)
                layer.values[..., past:length, :] = layer.values.index_select(-2, kept)
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]

    @staticmethod
    def _check_cache(cache: DynamicCache) -> None:
        for layer in cache.layers:
            if type(layer) is not GrowingLayer:
                raise UnsupportedModelError(
                    f"the model filled a cache layer of type {type(layer).__name__}; lookahead needs the "
                    "GrowingLayer entries it created, which it can roll back"
                )

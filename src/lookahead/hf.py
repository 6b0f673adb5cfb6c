"""Adapter for Hugging Face causal LMs: runs a step of one or many sequences through the model's public
forward (a 4-D attention mask, explicit position ids, and our `KVStore` as the cache)."""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import sys
import threading
import time
import timeit
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedModel

from . import kernels
from .attention import RaggedLayout, loaded_attention, ragged_rows, routes, stacked_heads
from .quant import Int4Linear
from .runtime.batch import StepBatch, StepLogits, causal_step, pack_steps, pad_batch
from .runtime.kv import KVStore

SUPPORTED_ATTENTION = ("eager", "sdpa")
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
# With compile=True, decoding steps are padded to one of these heights, so the compiled forward meets a
# handful of shapes.
COMPILED_HEIGHTS = (1, 2, 4, 8, 16, 32, 64)
# `compile=` takes True (the first) or one of these by name.
COMPILE_MODES = ("default", "cpp-wrapper")


class UnsupportedModelError(ValueError):
    """The model cannot run lookahead steps (no custom masks, or a cache we cannot commit)."""


def vocabulary_size(model: PreTrainedModel) -> int:
    """Rows of the input embedding: the token ids the model can take are [0, vocabulary_size)."""
    return model.get_input_embeddings().num_embeddings


def context_length(model: PreTrainedModel) -> int | None:
    """The most positions a request may take (None where the model's config does not say): those the model was
    built for; with "longrope" rotary embeddings (Phi-3-128k, Phi-3.5) only its original context, past which
    transformers switches every position of a forward to the long frequencies once any position of that
    forward lies past it: a lookahead step (rows ahead of the text, other requests beside it, a prompt fed in
    chunks) would cross it at other steps than `generate`'s one-token steps, and its output differ."""
    config = model.config.get_text_config(decoder=True)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [rope, *(v for v in rope.values() if isinstance(v, dict))] if isinstance(rope, dict) else []  # per layer type
    for kind in kinds:
        if kind.get("rope_type", kind.get("type")) == "longrope":
            original = kind.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None)
            if original:
                return int(original)
    return getattr(config, "max_position_embeddings", None)


class PackedLinears:
    """Prepacked copies of a CPU model's `nn.Linear` weights, swapped in for our eager forward passes only.

    Three packers: MKL's packed single-precision GEMM (float32), oneDNN's prepacked linear (float32 or
    bfloat16) and our own kernel (float32, AVX-512: `kernels`); and "q4", which runs our 4-bit layers
    (`quant.Int4Linear` on our kernel) as they are, stacking those that share an input (a one-row int4 step of
    the default model: 210 calls -> 120). Which one runs, and from which step height, is
    measured per machine (`costs.cost_curve`): on an AMD EPYC oneDNN ran 1.4-1.6x faster than the default BLAS
    path for the 1..64-row inputs of decoding steps (whose one-row product runs on one thread), before its
    weights were reordered for many rows (`_PACKED_ROWS`), which made it faster again, and our kernel faster
    still at 1-12 rows; on an AVX-512 Xeon oneDNN (then unreordered) was slower at every height, and MKL's
    packed weights cost 2% more for one row and 23-31% less for 4 to 16 rows (the default BLAS call repacks
    the whole weight on each call from 4 rows on). oneDNN's packs and ours also stack the linears that the
    model calls on one input (`_group`). Compiled steps on a CPU call our kernel's packs as an op of the graph
    (`torch.ops.lookahead.linear_f32`) or, where it does not run, are frozen: inductor packs the weights itself (`_freezing`).
    The model itself is left as it was: the packed forward is set on each Linear instance on entering
    `active()` and removed on leaving. It costs a copy of the linear weights (MKL's: twice their bytes),
    taken when first used: later in-place weight changes are not seen.
    """

    def __init__(self, model: torch.nn.Module, packer: str) -> None:
        self.packer = packer
        self._forwards: list[tuple[torch.nn.Linear, Callable[[torch.Tensor], torch.Tensor]]] = []
        packed: dict[tuple[int, int], Callable[[torch.Tensor], torch.Tensor]] = {}  # a tied weight packed once
        for module in model.modules():
            if "forward" in vars(module):  # a forward someone else set (accelerate's hooks): theirs stays in place
                continue
            if packer == "q4":  # our 4-bit layers run as they are, stacked where they share an input
                if isinstance(module, Int4Linear) and module.ours:
                    self._forwards.append((module, module.forward))
            elif type(module) is torch.nn.Linear:
                weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
                key = (id(module.weight), id(module.bias))
                if key not in packed:
                    packed[key] = _packed_forward(packer, weight, bias)
                self._forwards.append((module, packed[key]))
        # oneDNN's linears that the model calls on one input (a layer's query, key and value projections; its
        # gate and up projections) run as one linear over their weights stacked, found in the first forward.
        self.groups: list[_SharedInputLinears] = []
        self._finds_groups = packer in ("onednn", "native", "q4")
        self.argmax_output = (ArgmaxOutputLayer.of(model, dict(self._forwards)) if packer in ("onednn", "native")
                              else None)
        self._lock = _lock_of(model)  # held by the forward the packs are active in (`active`)
        self._holder: int | None = None  # that forward's thread
        self._guarded: list[tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]] | None = None

    @staticmethod
    def packers(model: torch.nn.Module) -> tuple[str, ...]:
        """The packers that can run this model's linears: none off the CPU; for its `nn.Linear` layers, MKL
        for float32, oneDNN for float32 or bfloat16, ours for float32 where it builds (`kernels.library`),
        only those whose copy takes at most half the memory free now (MKL's packs took twice the bytes of the
        default model's float32 weights, oneDNN's and ours about once); "q4" where 4-bit layers run on our
        kernel (no copy beyond the stacked layers')."""
        weights = linear_bytes(model)
        q4 = any(isinstance(module, Int4Linear) and module.ours for module in model.modules())
        if model.device.type != "cpu" or is_sharded(model) or not (weights or q4):
            return ()
        room = available_memory() / 2
        mkl = (model.dtype == torch.float32 and torch.backends.mkl.is_available() and 0 < 2 * weights <= room)
        onednn = (model.dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
                  and 0 < weights <= room)
        native = model.dtype == torch.float32 and 0 < weights <= room and kernels.library() is not None
        return ("mkl",) * mkl + ("onednn",) * onednn + ("native",) * native + ("q4",) * q4

    @contextmanager
    def active(self, argmax_only: bool = False, traced: bool = False) -> Iterator[None]:
        """The packed linears in place of the model's, for a forward of ours. argmax_only: the logits are read
        for their argmax alone (greedy rows), which `argmax_output` computes faster where there is one.

        Our forwards of one model take turns (a lock per model). Meanwhile the forwards of other threads
        (transformers' `generate` of the same model beside a server's engine) run the model's own linears,
        except beside a forward that the compiler traces (`traced`), whose linears must be ours alone."""
        with self._lock:
            holder, self._holder = self._holder, threading.get_ident()
            inputs: list[tuple[torch.nn.Linear, torch.Tensor]] | None = [] if self._finds_groups else None
            if inputs is not None:
                forwards = [(module, _recording(module, forward, inputs)) for module, forward in self._forwards]
            else:
                forwards = self._forwards if traced else self._in_holders_thread()
            # Set in the instances' dicts: `nn.Module.__setattr__` and `__delattr__` took 0.28 ms a step.
            for module, forward in forwards:
                module.__dict__["forward"] = forward
            if argmax_only and self.argmax_output is not None:
                output = self.argmax_output
                output.module.__dict__["forward"] = output if traced else self._holders_only(output.module, output)
            try:
                yield
            finally:
                for module, _ in self._forwards:
                    module.__dict__.pop("forward", None)
                for group in self.groups:
                    group.clear()
                self._holder = holder
            if inputs:
                self._group(inputs)

    def _in_holders_thread(self) -> list[tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]]:
        if self._guarded is None:
            self._guarded = [(module, self._holders_only(module, forward)) for module, forward in self._forwards]
        return self._guarded

    def _holders_only(self, module: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` in the thread of the forward the packs are active in, the module's own in any other."""
        own = functools.partial(type(module).forward, module)

        def in_its_thread(x: torch.Tensor) -> torch.Tensor:
            return forward(x) if threading.get_ident() == self._holder else own(x)

        return in_its_thread

    def find_groups(self, model: torch.nn.Module) -> None:
        """Find the linears to stack (`_group`) by a one-token forward of `model` without a cache, where the
        first forward through these packs is to be traced by the compiler (which would not run the recording)."""
        if self._finds_groups:
            with torch.inference_mode(), self.active():
                model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device), use_cache=False)

    def _group(self, inputs: list[tuple[torch.nn.Linear, torch.Tensor]]) -> None:
        """Stack the linears that took the same input tensor in a forward (`inputs`: each call, in order), where
        each took no other input and all are alike (input size, data type, bias or none); their own packs are
        dropped. A one-row float32 step of the default model: 18.2 -> 16.3 ms (2-core EPYC, session 26; its
        30 layers' q/k/v and gate/up projections alone 8.5 -> 7.3 ms), where the small key and value
        projections had taken 25 us each for 0.4 MB."""
        by_input: dict[int, list[torch.nn.Linear]] = {}
        took: dict[torch.nn.Linear, set[int]] = {}
        for module, x in inputs:
            took.setdefault(module, set()).add(id(x))
            members = by_input.setdefault(id(x), [])
            if module not in members:
                members.append(module)
        self._finds_groups = False
        for members in by_input.values():
            alike = {(type(m), m.in_features, None if isinstance(m, Int4Linear) else m.weight.dtype, m.bias is None)
                     for m in members}
            if len(members) > 1 and len(alike) == 1 and all(len(took[m]) == 1 for m in members):
                self.groups.append(_SharedInputLinears(self.packer, members))
        forwards = {module: forward for group in self.groups for module, forward in group.forwards()}
        self._forwards = [(module, forwards.get(module, forward)) for module, forward in self._forwards]
        self._guarded = None


def _recording(module: torch.nn.Linear, forward: Callable[[torch.Tensor], torch.Tensor],
               inputs: list[tuple[torch.nn.Linear, torch.Tensor]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`forward`, noting each call's input in `inputs` (which keeps it alive, so that no two inputs share an id)."""
    def recorded(x: torch.Tensor) -> torch.Tensor:
        inputs.append((module, x))
        return forward(x)

    return recorded


class _SharedInputLinears:
    """Linears the model calls on one input, run as one linear over their weights stacked: the first of them
    called on an input computes every member's output, each member's call takes its columns. A member called
    again, or on another input, computes the whole again."""

    def __init__(self, packer: str, members: list[torch.nn.Module]) -> None:
        self.members = members
        bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        if packer == "q4":  # whole panels of 16 features each: stacked, each output computed as alone
            bias = None if bias is None else bias.float()
            stacked = functools.partial(kernels.linear_q4, codes=torch.cat([m.codes for m in members]),
                                        scales=torch.cat([m.scales_and_zeros for m in members]), bias=bias)
            self._forward = lambda x: stacked(x).to(x.dtype)  # as each layer's own (`Int4Linear.forward`)
        else:
            self._forward = _packed_forward(packer, torch.cat([m.weight.detach() for m in members]), bias)
        ends = list(itertools.accumulate(m.out_features for m in members))
        self._columns = list(zip([0] + ends[:-1], ends))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served: set[int] = set()

    def forwards(self) -> list[tuple[torch.nn.Linear, Callable[[torch.Tensor], torch.Tensor]]]:
        return [(m, functools.partial(self._member, index)) for index, m in enumerate(self.members)]

    def _member(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x or index in self._served:
            self._input, self._output, self._served = x, self._forward(x), set()
        self._served.add(index)
        start, end = self._columns[index]
        out = self._output[..., start:end].contiguous()  # contiguous, as the layer's own output: models view it
        if len(self._served) == len(self.members):
            self.clear()
        return out

    def clear(self) -> None:
        """Let go of the input and output held for members still to be called."""
        self._input = self._output = None
        self._served = set()


class ArgmaxOutputLayer:
    """A float32 output layer whose logits keep their argmax exact for less: every logit comes from a bfloat16
    copy of the weight (half the bytes read), then the tokens that could still be the float32 argmax, given a
    bound on that copy's error, get their float32 dot products. The others keep bfloat16's approximation,
    which is below the argmax by construction: fit for greedy rows, not for sampling. The default model's
    49152 x 576 output layer (2-core EPYC, session 27): the product alone 2.1 -> 0.9 ms for one row; over
    MT-bench's lookahead steps 3 tokens recomputed a row at the median, 53 at most, the layer 1.5 -> 1.1 ms a
    step; whole steps (interleaved) 19.4 -> 18.4 ms at one row, 28.1 -> 27.5 at 16.

    The bound, for token j and input h: rounding w_j and h to bfloat16 (relative error u = 2^-9, taken as
    2^-8), products summed in float32 (oneDNN accumulates so), the sum rounded to bfloat16 (again u), the float32
    logit's own summation error besides: |approx_j - logit_j| <= K |w_j| |h| (Cauchy-Schwarz), K below.
    Token j can be the argmax only if approx_j + K |w_j| |h| >= approx_a - K |w_a| |h| for the approximate
    argmax a."""

    _U = 2.0 ** -8
    # Inputs' and output's rounding (3u + u^2, the output's via |approx_j| <= |w_j| |h| (1 + ...)), float32 sums
    # of up to 2^14 terms (2 * 2^14 * 2^-24 = 2^-9) in the bfloat16 product and in the float32 logit.
    _K = 3 * _U + _U * _U + 2.0 ** -9

    def __init__(self, module: torch.nn.Linear, full: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.module = module
        self.weight = module.weight.detach()
        self._full = full  # the float32 product (packed), for inputs with too many tokens to recompute
        self._approximate = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(torch.bfloat16), _PACKED_ROWS)
        self._row_norms = self.weight.norm(dim=1)

    @classmethod
    def of(cls, model: torch.nn.Module, packed: dict[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]
           ) -> ArgmaxOutputLayer | None:
        """The model's output layer so, where it is a float32 `nn.Linear` without bias among `packed` (its float32
        forward), on a CPU whose oneDNN runs bfloat16, and a one-row product so measures at most 3/4 of float32's."""
        module = getattr(model, "get_output_embeddings", lambda: None)()
        if (module not in packed or module.bias is not None or module.weight.dtype != torch.float32
                or module.in_features > 2 ** 14 or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return None
        layer = cls(module, packed[module])
        x = torch.randn(1, module.in_features)

        def fastest(forward: Callable[[torch.Tensor], torch.Tensor]) -> float:  # after a warm-up call
            return min(timeit.repeat(lambda: forward(x), number=1, repeat=6)[1:])

        return layer if fastest(layer) <= 0.75 * fastest(layer._full) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        logits = torch.ops.mkldnn._linear_pointwise(rows.to(torch.bfloat16), self._approximate, None, "none", [],
                                                    "").float()
        slack = self._K * rows.norm(dim=1, keepdim=True)  # [R, 1]: the bound per unit of |w_j|
        best = torch.from_numpy(logits.numpy().argmax(axis=1)).unsqueeze(1)  # numpy's: ~8x faster than torch's
        floor = logits.gather(1, best) - slack * self._row_norms[best]
        row, token = (torch.addcmul(logits, self._row_norms, slack) >= floor).nonzero(as_tuple=True)
        # One product over the tokens any row needs: rows share most of theirs (random text: hundreds each).
        needed, column = torch.unique(token, return_inverse=True)
        if needed.numel() > self.weight.shape[0] // 16:  # gathering them would cost about the float32 product
            return self._full(x)
        logits[row, token] = (rows @ self.weight[needed].T)[row, column]
        return logits.view(*x.shape[:-1], -1)


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's `nn.Linear` weights (a weight tied to several of them once)."""
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    return sum({id(m.weight): m.weight.nbytes for m in linears}.values())


# Both packers lay a weight out for a number of rows, but a pack serves any number. MKL's, packed for 64 (the
# budget's tallest step), ran as fast as a pack for 4 or 16 rows at 1-16 rows and 24% faster at 64 on a 2-core
# Xeon. oneDNN's, reordered for 2 to 64 rows, ran a 576 x 1536 linear of 2-16 rows 1.4-1.9x faster than the
# weight merely converted to a oneDNN tensor (or reordered for one row), which the op reorders on every call;
# a whole float32 step of the default model 28-31% faster for 1-8 rows (2-core EPYC, session 26).
_PACKED_ROWS = 64


def _packed_forward(packer: str, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`nn.Linear`'s forward on a copy of `weight` packed by `packer`."""
    if packer == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKED_ROWS)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if packer == "native":
        panels, features = kernels.pack(weight), weight.shape[0]
        return lambda x: kernels.linear(x, panels, bias, features)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACKED_ROWS)

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(rows, packed, weight, bias, rows.shape[0])
        return out.view(*x.shape[:-1], weight.shape[0])

    return forward


def available_memory() -> int:
    """Bytes the kernel could give us now: Linux's MemAvailable (free memory plus the page cache it can
    drop), else the free pages alone."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's weights are split across processes (transformers' tensor parallelism, `tp_plan`)."""
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[tuple, PackedLinears]]] = weakref.WeakKeyDictionary()
_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _lock_of(model: torch.nn.Module) -> threading.RLock:
    """The lock that our forwards of `model` through packed linears take turns by."""
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(model, threading.RLock())


def _packs(model: torch.nn.Module, packer: str) -> PackedLinears:
    """The model's packed linears of `packer`, made at first use (the linears that share an input found by a
    one-token forward, not recorded in the first forward of ours, which may be a long prompt's) and kept while
    the model lives and its weights stay as they are (`weights_version`: trained or loaded again in place,
    they are packed again)."""
    packs = _PACKED.setdefault(model, {})
    version = weights_version(model)
    if packer not in packs or packs[packer][0] != version:
        packs.pop(packer, None)  # its copy freed before the next is made
        made = PackedLinears(model, packer)
        if isinstance(model, PreTrainedModel):
            made.find_groups(model)
        packs[packer] = version, made
    return packs[packer][1]


def weights_version(model: torch.nn.Module) -> tuple:
    """What changes when the model's weights do: each tensor's storage and its count of in-place changes (an
    optimizer's step, `load_state_dict`)."""
    return tuple((tensor.data_ptr(), _version(tensor)) for tensor in itertools.chain(model.parameters(), model.buffers()))


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor: no count kept, and it cannot be changed in place outside inference mode
        return 0


def _cache_argument(parameters: Mapping[str, inspect.Parameter]) -> str:
    """The name under which a model's forward (of these parameters) takes its cache (transformers renamed it in
    some models)."""
    return "cache" if "cache" in parameters else "past_key_values"


def layer_configs(config: PretrainedConfig) -> list[PretrainedConfig]:
    """Each decoder layer's config: a heterogeneous config's per-layer views (Gemma 4: a full-attention layer's
    head_dim is 512, a sliding one's 256; the whole config refuses to be read for such a field), else the one."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * getattr(config, "num_hidden_layers", 1)


def check_model(model: PreTrainedModel) -> None:
    """Raise UnsupportedModelError, saying why, for a model lookahead cannot drive."""
    if not isinstance(model, PreTrainedModel) or not hasattr(model, "get_output_embeddings"):
        raise UnsupportedModelError(f"model must be a transformers causal LM, got {type(model).__name__}")
    config = model.config.get_text_config(decoder=True)
    attention = loaded_attention(model.config) or "eager"
    if attention not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation {attention!r} cannot take a custom 4-D mask; load the model with "
            f"attn_implementation set to one of {SUPPORTED_ATTENTION}"
        )
    unsupported = set(getattr(config, "layer_types", None) or ()) - SUPPORTED_LAYER_TYPES
    if unsupported:
        raise UnsupportedModelError(
            f"{type(model).__name__} has layers of type {sorted(unsupported)}; lookahead drives attention layers of "
            f"the types {sorted(SUPPORTED_LAYER_TYPES)} (linear-attention and state-space layers keep a state that "
            "cannot be rolled back; chunked attention needs masks lookahead does not build)"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported; use a decoder-only causal LM")
    if getattr(config, "alibi", False):  # Falcon's ALiBi: positions read from a 2-D mask, not from position_ids
        raise UnsupportedModelError(f"{type(model).__name__} with alibi=True takes its positions from a 2-D attention "
                                    "mask; lookahead steps need position_ids and a 4-D mask")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "layer_types", None) is None and not _masks_by_sliding_window(model):
        context = context_length(model)
        if context is None or window < context:
            raise UnsupportedModelError(
                f"{type(model).__name__}'s attention ignores its config's sliding_window={window}, but transformers' "
                "cache applies it to the steps of generate after the prompt (not to the prompt), a mix lookahead does "
                "not reproduce; set model.config.sliding_window = None (full attention, the model as built: generate "
                "then agrees)")
    band = getattr(config, "window_size", None)
    if "local" in (getattr(config, "attention_layers", None) or ()) and band:
        context = context_length(model)
        if context is None or band < context:
            raise UnsupportedModelError(
                f"{type(model).__name__}'s local attention layers keep a band of window_size={band} keys counted by "
                "their place in the cache, not by position: lookahead's rows ahead of the text (and a batch's shorter "
                "sequences) would see other keys than generate's")
    parameters = inspect.signature(model.forward).parameters
    if _cache_argument(parameters) not in parameters or "position_ids" not in parameters:
        raise UnsupportedModelError(f"{type(model).__name__}.forward must accept attention_mask, position_ids and a cache")
    if not is_causal(model):
        raise UnsupportedModelError(f"{type(model).__name__} attends to later tokens (not a causal LM as loaded; a "
                                    "BERT-like model needs is_decoder=True)")


def is_causal(model: PreTrainedModel) -> bool:
    """Whether a token's logits ignore the tokens after it: one forward of two rows that differ in their second
    token, once per model (a BERT-like model loaded as a causal LM without is_decoder attends both ways). Not
    probed on a sharded model, whose forwards are collective."""
    if model not in _CAUSAL:
        if is_sharded(model):
            return True
        training = model.training
        model.eval()  # dropout (a model left in training mode) would make the two rows differ anyway
        try:
            with torch.inference_mode():
                ids = torch.tensor([[0, 1], [0, 0]], device=model.device)
                first = model(input_ids=ids, use_cache=False).logits[:, 0].float()
        finally:
            model.train(training)
        _CAUSAL[model] = torch.allclose(first[0], first[1], rtol=1e-3, atol=1e-3 * float(first.abs().max()))
    return _CAUSAL[model]


_CAUSAL: weakref.WeakKeyDictionary[PreTrainedModel, bool] = weakref.WeakKeyDictionary()


def compile_mode(compile: bool | str) -> str | None:
    """The mode `compile=` asks for: None (eager) for False, "default" for True, else one of COMPILE_MODES."""
    if compile is False or compile is True:
        return COMPILE_MODES[0] if compile else None
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be True, False or one of {COMPILE_MODES}, got {compile!r}")
    return compile


_COMPILED: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[str, str], tuple[tuple, Callable]]] = (
    weakref.WeakKeyDictionary())


def _compiled_forward(model: PreTrainedModel, mode: str, how: str) -> Callable:
    """The model's forward compiled on first use, one per model, mode and way of running its linears (`how`:
    our kernels from the graph, frozen weights, or the model's own; the guards dropped below would not tell
    these graphs apart), kept while the model keeps its shape (`_signature`); the step's sizes are marked
    dynamic at each call (`HFModelRunner._call`, `KVStore`). "cpp-wrapper": inductor
    writes the code that calls its kernels in C++ instead of Python, which saves 3-7% of an int4 step on our
    2-core CPU but compiles up to 9x longer (cached on disk by inductor).

    Dynamo keeps a compiled graph, and the guards that choose it, on the code object it traced: every model
    whose forward it entered shares one such list. Here each model gets a function of its own, on a code
    object of its own, so its graphs are never tried for another model; the guards on its modules (most of the
    ~7,400 of a graph of the default model: each module's type, attributes, parameters) are then dropped
    (`skip_guard_on_all_nn_modules_unsafe`), those on the step's inputs (ids, positions, mask, KV buffers) kept:
    dynamo's lookup took 1.9 ms of a 17 ms float32 step and takes 0.3 ms so (2-core EPYC, session 29). What the
    dropped guards would have seen, a model changed after compiling (its parameters' dtypes, shapes or device,
    its attention implementation, training mode), gets a new compiled function; changes to the modules'
    code or attributes inside are not seen."""
    # A few graphs per model (one sequence or several, one row or several), more where a compilation
    # specialises: allow more than dynamo's default of 8 per function.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    signature = _signature(model)
    compiled = _COMPILED.setdefault(model, {})
    if (mode, how) not in compiled or compiled[mode, how][0] != signature:
        # Without size asserts: the generated code would check every kernel's output shape in Python, about
        # 1,000 checks a step.
        options = {"size_asserts": False, "cpp_wrapper": mode == "cpp-wrapper",
                   "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        compiled[mode, how] = signature, torch.compile(_forward_of_its_own(), options=options)
    return compiled[mode, how][1]


def _signature(model: PreTrainedModel) -> tuple:
    """What a compiled forward of `model` assumes: its tensors' names, shapes, dtypes and devices, and the
    weights themselves (`weights_version`: frozen graphs hold them as constants), its attention implementation
    (ours, set during a forward of another thread, counting as SDPA) and training mode."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return (tuple((name, tensor.shape, tensor.dtype, tensor.device) for name, tensor in tensors),
            weights_version(model), loaded_attention(model.config), model.training)


def _forward_of_its_own() -> Callable:
    """`model(**kwargs)` as a function `(model, **kwargs)` on a code object of its own (`_compiled_forward`)."""
    def forward(model: PreTrainedModel, **kwargs):
        return model(**kwargs)

    return functools.update_wrapper(
        type(forward)(forward.__code__.replace(), forward.__globals__, forward.__name__), forward)


def _calling(function: Callable, *args, **kwargs):
    return function(*args, **kwargs)


# `_calling` with a frame of 66 KB (the slots of its evaluation stack, never used): CPython (3.11) keeps frames in
# chunks of 16 KB, allocated for a frame that does not fit in the current one and freed when that frame returns,
# and gives a larger frame a chunk of the next power of two, here 128 KB, the half it does not take left to its
# callees. A compiled step's frames (dynamo's code for the whole forward, ~750 locals, then inductor's wrappers
# and code) then never cross into a new chunk: where they did, at the level of the 121 calls of our operators,
# each call allocated and freed a chunk (strace: 54 mmap/munmap pairs a step; profiled, 14% of the step) and a
# compiled float32 step took 19.6-20.1 ms against 12.5-14.7 so (2-core EPYC, session 29).
_in_a_stack_chunk_of_its_own = type(_calling)(_calling.__code__.replace(co_stacksize=66 * 1024 // 8),
                                              _calling.__globals__, "_in_a_stack_chunk_of_its_own")


def _freezing() -> AbstractContextManager:
    """Inductor's freezing, for the compilations that happen inside: the weights become constants of the
    graph, and on a CPU each linear runs on a copy prepacked by oneDNN (where its rows are a dynamic size) or
    MKL, called from the compiled code. One float32 step of the default model over 300 cached tokens on a
    2-core EPYC: 19.3-20.8 ms for 2 rows, 20.4-21.0 for 4, against 28.4-29.1 and 29.1-29.5 through our packed
    linears called as an op (docs/benchmarks.md, session 25). The price: a packed copy of the weights per graph,
    and a compilation of 50-60 s per graph in every process (inductor's disk cache cannot keep a graph whose
    constants are oneDNN tensors, which do not pickle; unfrozen graphs came back from it in 8 s). Set around the
    calls rather than passed in `torch.compile`'s options, where inductor (torch 2.13) compiled without it."""
    return torch._inductor.config.patch(freezing=True)


def _masks_by_sliding_window(model: PreTrainedModel) -> bool:
    """Whether a model whose config names no layer types masks attention to its config's `sliding_window`: those of
    transformers that do build their masks with `create_sliding_window_causal_mask`; the others (Llama, OLMo 2,
    GPT-NeoX, ...) ignore the key in attention, which a config may carry all the same (one derived from Mistral's,
    say; `check_model` refuses them where it would matter). A model of code from elsewhere is taken at its config's
    word."""
    classes = [c for c in {type(model), type(getattr(model, "base_model", model))}
               if c.__module__.startswith("transformers.")]  # a user's subclass: its transformers base model
    if not classes:
        return True
    return any(hasattr(sys.modules.get(c.__module__), "create_sliding_window_causal_mask") for c in classes)


class HFModelRunner:
    """Wraps a causal LM; all lookahead glue that knows about transformers lives here."""

    def __init__(self, model: PreTrainedModel, packed_linear: bool | None = None, compile: bool | str = False) -> None:
        check_model(model)
        if packed_linear is not None and not isinstance(packed_linear, bool):
            raise TypeError(f"packed_linear must be True, False or None, got {packed_linear!r}")
        self.compile_mode = compile_mode(compile)
        config = model.config.get_text_config(decoder=True)
        self.layer_types: list[str] | None = getattr(config, "layer_types", None)
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = _cache_argument(parameters)
        self.keeps_some_logits = "logits_to_keep" in parameters
        # Sliding-window layers get a mask limited to the window; the cache itself keeps everything.
        window = getattr(config, "sliding_window", None)
        uses_sliding = ("sliding_attention" in self.layer_types if self.layer_types is not None
                        else _masks_by_sliding_window(model))
        self.sliding_window: int | None = window if (window and uses_sliding) else None
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.forward_seconds = 0.0  # time spent inside the model's forward, for profiling
        # The packers this runner may use; None: measure whether (and from which step height) one of them is
        # faster here, `costs.cost_curve` decides and calls `use_packed`.
        self.packers = PackedLinears.packers(model) if packed_linear is not False else ()
        if packed_linear and not self.packers:
            raise ValueError("packed_linear=True needs a model on CPU, unsharded, with 4-bit layers on our kernel or "
                             "in float32 (MKL, oneDNN or our AVX-512 kernel) or bfloat16 (oneDNN) with one of those "
                             "available, and free memory for a packed copy of its linear weights")
        self.packing: bool | None = packed_linear if packed_linear is not None else (None if self.packers else False)
        # Where our kernels run, compiled steps call them from the graph (`torch.ops.lookahead`, `kernels`): the
        # float32 one on one packed copy of the weights, the 4-bit one on the layers' own (stacked where they share
        # an input); float32 steps of the default model 1-7% faster than eager (2-core EPYC, session 28), where
        # inductor's fused pointwise code replaces some 2,000 eager ops of the layers.
        self.compiled_kernel = self.compile and bool({"native", "q4"} & set(self.packers))
        # Otherwise, on a CPU, compiled steps freeze the weights (`_freezing`): a packed copy of the linear weights
        # per graph, two graphs (one sequence, several); where they would not fit in half the free memory, none.
        self.freezes = (self.compile and not self.compiled_kernel and model.device.type == "cpu"
                        and not is_sharded(model) and 2 * linear_bytes(model) <= available_memory() / 2)
        # Inductor packs a frozen linear with oneDNN where its rows are a dynamic size, with MKL where they are
        # fixed, and dynamo fixes a size of 1: a one-row step of one sequence would get MKL's packs, 32-37 ms
        # a step on the EPYC above against 18-21 ms padded to two rows. So frozen steps start at two rows.
        self.compiled_heights = COMPILED_HEIGHTS[1:] if self.freezes else COMPILED_HEIGHTS
        how = f"kernels-{self._compiled_packer}" if self.compiled_kernel else "frozen" if self.freezes else "as-is"
        self._compiled = _compiled_forward(model, self.compile_mode, how) if self.compile else None
        # Compiled step shapes, (height, several sequences or one): dynamo compiles one sequence apart.
        self._eager_shapes: set[tuple[int, bool]] = set()  # those whose compilation failed
        self.compile_seconds: dict[tuple[int, bool], float] = {}  # those compiled -> seconds of the compiling call
        self._packed: PackedLinears | None = None
        self._compiled_packs: PackedLinears | None = None  # those of `_compiled_packer`, at the first compiled step
        self.packed_from: int | None = None  # steps this long or longer run packed
        # Eager steps of sequences of different heights run ragged (see `ragged`); False: always padded.
        self.ragged_steps = True
        if self.packing:
            self.use_packed(self.packers[0], 1)

    def use_packed(self, packer: str | None, packed_from: int | None = 1) -> None:
        """Run steps of `packed_from` rows or more through `packer`'s linears (None: never packed)."""
        if packer is not None and packer not in self.packers:
            raise ValueError(f"packer must be one of {self.packers}, got {packer!r}")
        self._packed = None if packer is None else _packs(self.model, packer)
        self.packed_from = None if packer is None else packed_from

    def drop_other_packs(self) -> None:
        """Free the packed copies of packers other than the one in use (measuring made one per packer)."""
        packs = _PACKED.get(self.model, {})
        for packer in [packer for packer in packs if packer not in (self.packer, self._compiled_packer)]:
            del packs[packer]

    @property
    def _compiled_packer(self) -> str | None:
        return next(packer for packer in ("native", "q4") if packer in self.packers) if self.compiled_kernel else None

    def _compiled_linears(self) -> AbstractContextManager:
        """The linears of compiled steps: ours, traced as an op of the graph, or frozen and packed by inductor."""
        if not self.compiled_kernel:
            return _freezing() if self.freezes else nullcontext()
        if self._compiled_packs is None:
            self._compiled_packs = _packs(self.model, self._compiled_packer)
        return self._compiled_packs.active(traced=True)

    @property
    def packer(self) -> str | None:
        """The packer steps of `packed_from` rows or more run through, if any."""
        return None if self._packed is None else self._packed.packer

    @property
    def ragged(self) -> bool:
        """Whether steps whose sequences feed different numbers of rows run ragged: their rows flattened into
        one sequence, so that the layers compute no padding rows (attention alone lays them out per sequence,
        `attention.ragged_rows`). Eager steps where our attention function runs (SDPA on a CPU); a compiled
        step is padded to a fixed shape anyway."""
        return self.ragged_steps and self._compiled is None and routes(self.model)

    def _forward(self, input_ids: torch.Tensor, compiled: bool = False, argmax_only: bool = False, **kwargs):
        start = time.perf_counter()
        if compiled:
            linears = self._compiled_linears()
        elif self._packed is not None and self.packed_from is not None and input_ids.numel() >= self.packed_from:
            linears = self._packed.active(argmax_only)
        else:
            linears = nullcontext()
        with linears, stacked_heads(self.model):
            if compiled:
                out = _in_a_stack_chunk_of_its_own(self._compiled, self.model, input_ids=input_ids, use_cache=True,
                                                   **kwargs)
            else:
                out = self.model(input_ids=input_ids, use_cache=True, **kwargs)
        if input_ids.device.type == "cuda":  # the forward only queued its kernels: time them, not their launch
            torch.cuda.synchronize(input_ids.device)
        self.forward_seconds += time.perf_counter() - start
        return out

    def warm_up(self, slots: int) -> None:
        """Compile, before serving, the step shapes that an engine of `slots` sequences meets: one sequence
        or several (in the first slots, or with slots between them padded), one row or more each (frozen
        steps: two or more). Dynamo treats a size of 1 apart from the others: each of these is a graph of its
        own (10-70 s on a 2-core CPU), which would otherwise compile in the middle of a run, stalling every
        sequence in it."""
        if self._compiled is None:
            return
        heights = [height for height in self.compiled_heights if height <= 2]
        # Longer than any step below attends to: where the two were equal, dynamo would specialise on it.
        store = self.new_store(slots, 64 + heights[-1])
        prompt = causal_step(torch.zeros(8, dtype=torch.long))
        groups = [[0], [1], [0, 1], [0, 2]]  # (compiled steps cover the first slots: padded to them)
        with self.untimed():
            self.forward(store, pack_steps(range(slots), [0] * slots, [prompt] * slots))  # eager: allocates it
            for slot in range(slots):
                store.extend(slot, 8)
            for group in [g for g in groups if max(g) < slots]:
                for rows in heights:
                    step = causal_step(torch.zeros(rows, dtype=torch.long), logits=rows)
                    self.forward(store, pack_steps(group, [8] * len(group), [step] * len(group)))

    @contextmanager
    def untimed(self) -> Iterator[None]:
        """Forwards inside are not decoding (measuring, warming up): kept out of `forward_seconds`."""
        decoding = self.forward_seconds
        try:
            yield
        finally:
            self.forward_seconds = decoding

    @property
    def compile(self) -> bool:
        """Whether decoding steps run compiled (in any mode)."""
        return self.compile_mode is not None

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Run every forward eagerly inside (the eager curves, which also choose the linear path, and the
        eager one-row probe are measured so)."""
        compiled, self._compiled = self._compiled, None
        try:
            yield
        finally:
            self._compiled = compiled

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config(decoder=True).num_hidden_layers

    def kv_bytes_per_position(self) -> int:
        """Bytes the KV store holds per cached position of one sequence (keys and values, every layer), in this
        process: under tensor parallelism it holds its share of the key/value heads."""
        config = self.model.config.get_text_config(decoder=True)
        # Layers that reuse an earlier layer's keys and values (Gemma 3n, Gemma 4) keep none of their own.
        sharing = getattr(config, "kv_sharing_modes", None) or [None] * self.num_layers
        shards = torch.distributed.get_world_size() if is_sharded(self.model) else 1
        values = 0
        for layer, mode in zip(layer_configs(config), sharing, strict=True):
            if str(mode).startswith("reuse"):  # "reuse" (and Mistral Large 4's "reuse_but_indexer")
                continue
            if getattr(layer, "kv_lora_rank", None):  # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3):
                values += layer.kv_lora_rank + layer.qk_rope_head_dim  # one head of the latent and the rotary key
            else:
                heads = (getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads) // shards
                head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
                values += 2 * heads * head_dim
        return values * torch.finfo(self.dtype).bits // 8

    def new_store(self, slots: int, capacity: int) -> KVStore:
        return KVStore(self.num_layers, slots, capacity)

    @torch.inference_mode()
    def forward(self, store: KVStore, batch: StepBatch, argmax_only: bool = False) -> torch.Tensor:
        """Run one packed step over `store`; the logits at `batch.logit_rows`, [B, len(logit_rows), vocab].
        The step's keys and values are written to the store; `store.keep`/`extend` decide what stays.
        argmax_only: the logits are read for their argmax alone; where it is faster, only the logits that could
        be a row's argmax are then float32's (`ArgmaxOutputLayer`), the others lower."""
        return self.step_logits(store, batch, argmax_only).dense()

    @torch.inference_mode()
    def step_logits(self, store: KVStore, batch: StepBatch, argmax_only: bool = False) -> StepLogits:
        """`forward`, its logits as the forward computed them (a ragged step's distinct rows, each once)."""
        if self._compiled is not None and store.allocated():
            logits = self._forward_compiled(store, batch)
            if logits is not None:
                return StepLogits(logits)
        if batch.padded and self.ragged:
            return self._forward_ragged(store, batch, argmax_only)
        store.begin(batch.slots, batch.height, batch.visible.shape[-1], self.device)
        out = self._call(store, batch, logits_to_keep=batch.logit_rows.to(self.device), argmax_only=argmax_only)
        if not store.allocated():
            raise UnsupportedModelError(
                f"{type(self.model).__name__} did not write its keys and values through the cache it was given; "
                "lookahead needs them in its KV store")
        return StepLogits(out.logits if self.keeps_some_logits else out.logits[:, batch.logit_rows.to(self.device)])

    def _call(self, store: KVStore, batch: StepBatch, logits_to_keep: torch.Tensor | int, compiled: bool = False,
              argmax_only: bool = False):
        """The model's forward over `batch` (set up on `store` by `store.begin`), eager or compiled."""
        mask = self._attention_mask(batch)
        tokens, positions = batch.tokens.to(self.device), batch.positions.to(self.device)
        if compiled:
            # The number of sequences, the padded height and the attended length are sizes, not constants:
            # a few graphs serve every step (dynamo still compiles size 1 apart) instead of one compiled,
            # for 10-70 s on a CPU, at each new size met in the middle of a run.
            for tensor in mask.values() if isinstance(mask, dict) else [mask]:
                for dim in (0, 2, 3):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
            for tensor in (tokens, positions):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
        return self._forward(
            input_ids=tokens,
            compiled=compiled,
            argmax_only=argmax_only,
            position_ids=positions,
            attention_mask=mask,
            **{self.cache_argument: store},
            **({"logits_to_keep": logits_to_keep} if self.keeps_some_logits else {}),
        )

    def _forward_ragged(self, store: KVStore, batch: StepBatch, argmax_only: bool) -> StepLogits:
        """`forward` with the sequences' rows flattened into one sequence of sum(sizes) rows: the model's
        layers compute no padding rows; each sequence's logit rows past its own rows repeat its last row."""
        count, height = len(batch.slots), batch.height
        rows = batch.real_rows()
        place = torch.full((count * height,), -1, dtype=torch.long)  # flattened row -> its place among `rows`
        place[rows] = torch.arange(rows.numel())
        sizes = torch.tensor(batch.sizes)
        wanted = torch.minimum(batch.logit_rows.view(1, -1), (sizes - 1).view(-1, 1))  # [B, U]
        # Each row's logits computed once: a sequence shorter than the tallest repeats its last row, and the
        # output layer is a large share of a step (8 sequences, one of 3 rows and seven of one: 24 rows through
        # it for 10 distinct ones, 36 ms a step against 29, float32, 2 cores).
        logit_places, repeats = torch.unique(place[(torch.arange(count) * height).view(-1, 1) + wanted],
                                             return_inverse=True)
        logit_places = logit_places.to(self.device)
        store.begin(batch.slots, height, batch.visible.shape[-1], self.device, ragged=rows)
        with ragged_rows(RaggedLayout.of(batch.sizes, [store.lengths[slot] for slot in batch.slots], self.device)):
            out = self._forward(input_ids=batch.tokens.view(1, -1)[:, rows].to(self.device), argmax_only=argmax_only,
                                position_ids=batch.positions.view(1, -1)[:, rows].to(self.device),
                                attention_mask=self._attention_mask(batch), **{self.cache_argument: store},
                                **({"logits_to_keep": logit_places} if self.keeps_some_logits else {}))
        return StepLogits(out.logits[0] if self.keeps_some_logits else out.logits[0, logit_places],
                          repeats.to(self.device))

    def _forward_compiled(self, store: KVStore, batch: StepBatch) -> torch.Tensor | None:
        """The step padded to a compiled height and run compiled; None where it runs eagerly (a prefill chunk
        taller than any compiled height, no room left in the store, that shape failed to compile, or
        padding that would more than double its rows)."""
        height = next((h for h in self.compiled_heights if h >= batch.height), None)
        slots = range(max(batch.slots) + 1)  # the first slots, those not in the batch padded: one shape class
        cached = [store.lengths[slot] for slot in slots]
        shape = (height, len(slots) > 1)
        if height is None or shape in self._eager_shapes or max(cached) + height > store.capacity:
            return None
        if len(slots) * height > 2 * len(batch.slots) * batch.height:
            return None  # padding would more than double the rows (a prompt chunk for a late slot): eager
        padded = pad_batch(batch, cached, height, max(cached) + height, slots)
        store.begin(padded.slots, height, padded.visible.shape[-1], self.device)
        first = shape not in self.compile_seconds
        start = time.perf_counter()
        try:
            out = self._call(store, padded, logits_to_keep=0, compiled=True)  # 0: every row's logits
        except Exception as error:  # noqa: BLE001 - any compiler failure: that shape runs eagerly from now on
            if not first:
                raise
            sequences = "several sequences" if shape[1] else "one sequence"
            warnings.warn(f"torch.compile failed for steps of {height} rows of {sequences}; they run eagerly: "
                          f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                          RuntimeWarning, stacklevel=3)
            self._eager_shapes.add(shape)
            return None
        if first:
            self.compile_seconds[shape] = time.perf_counter() - start
        return out.logits[torch.tensor(batch.slots, device=self.device)][:, batch.logit_rows.to(self.device)]

    def _attention_mask(self, batch: StepBatch) -> torch.Tensor | dict[str, torch.Tensor]:
        full = self._additive(batch.visible)
        if self.sliding_window is None:
            return full
        in_window = batch.positions[:, :, None] - batch.key_positions[:, None, :] < self.sliding_window
        sliding = self._additive(batch.visible & in_window)
        if self.layer_types is None:
            return sliding
        return {"full_attention": full, "sliding_attention": sliding}

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.dtype)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask.unsqueeze(1).to(self.device)

"""Weights kept quantised: a model's linear layers swapped for int8 or int4 weight-only layers, so that a step
reads 1/4 (int8) or about 1/6 (int4) of the float32 bytes.

- `int8`: one int8 per weight, one scale per output channel (torch's `_weight_int8pack_mm`).
- `int4`: 4-bit codes in groups of 32 inputs, each group with its own scale and minimum, the layout of
  GGUF's Q4_1 blocks; the output layer (`lm_head`, 49152 x 576 on the default model, a fifth of its weights) is
  int8, as GGUF files keep it at 8 bits. Our 4-bit kernel runs it where it can (`kernels.runs_q4`: AVX-512
  BF16; a one-row 576 x 1536 product 1.9x faster than torch's kernel, 8 rows 2.0x, on our 2-core EPYC, session
  28), torch's `_weight_int4pack_mm_for_cpu` elsewhere.

Both round a layer's input to bfloat16 and its output too (torch's kernels take bfloat16 inputs and scales; with
float32 inputs they fall back to a path 20-40x slower), and return the output in the model's dtype; everything
else stays in its own dtype. Every kernel here computes each input row on its own (a row's result is bit-identical whether
it is fed alone or among others), which is what keeps lookahead's greedy output token-identical to `generate`
on the same quantised model, but for near-ties: the rest of a step (attention over other rows) can differ from
`generate`'s in float32's last bits, which the next layer's rounding to bfloat16 can make a bfloat16 step, and two
tokens whose logits tie within one can then swap (int8 as int4).

Quantising is a one-way approximation of the float weights: a quantised model is its own model, with
transformers' `generate` on it as the reference. It is the same module for both, so both run the same
kernels.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import kernels

QUANTISED_WEIGHTS = ("int8", "int4")
GROUP_SIZE = 32
# The kernels' shape rules (torch 2.13, CPU): int8 needs the input size a multiple of this (others gave wrong
# products or crashed), int4 its output size too (it refuses others).
KERNEL_ALIGNMENT = 16
_KERNEL_DTYPE = torch.bfloat16


class _QuantisedLinear(nn.Module):
    """A layer whose weights keep the kernels' formats: they follow the model to another device, never to another
    dtype (`model.float()`, `.half()`, as `TieMeter` widens a model, had turned the bfloat16 scales to floats the
    kernels refuse); the bias follows both, as a float layer's."""

    def _apply(self, fn, recurse: bool = True):
        for name, buffer in self._buffers.items():
            if buffer is not None:  # the device fn moves a tensor to that no dtype change touches
                self._buffers[name] = fn(buffer) if name == "bias" else buffer.to(
                    fn(torch.empty(0, dtype=torch.uint8, device=buffer.device)).device)
        return self


class Int8Linear(_QuantisedLinear):
    """y = x W^T + b with W stored as int8 codes times a scale per output channel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not int8_fits(linear):
            raise ValueError(f"int8 needs in_features divisible by {KERNEL_ALIGNMENT}, got {linear.in_features}")
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(_KERNEL_DTYPE)
        codes = torch.round(weight / scale.float()[:, None]).clamp(-128, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(_KERNEL_DTYPE)
        out = torch._weight_int8pack_mm(rows, self.codes, self.scale)
        return _finish(out, x, self.bias)


class Int4Linear(_QuantisedLinear):
    """y = x W^T + b with W in groups of 32 inputs: w = scale * (code - 8) + zero, code in 0..15, i.e.
    scale * code + minimum, as GGUF's Q4_1 blocks store it. ours: run our kernel (None: where it runs)."""

    def __init__(self, linear: nn.Linear, ours: bool | None = None) -> None:
        super().__init__()
        if not int4_fits(linear):
            raise ValueError(f"int4 needs in_features divisible by {GROUP_SIZE} and out_features by "
                             f"{KERNEL_ALIGNMENT}, got {linear.in_features} and {linear.out_features}")
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        groups = weight.view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        # The codes are fitted to the scale and zero as the kernel will read them (rounded to bfloat16).
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(_KERNEL_DTYPE)
        zero = (low + 8 * scale.float()).to(_KERNEL_DTYPE)
        codes = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
        codes = codes.view(out_features, in_features).to(torch.int32)
        self.in_features, self.out_features = in_features, out_features
        self.ours = kernels.runs_q4() if ours is None else ours
        self._check_kernel()
        if self.ours:
            packed, scales_and_zeros = kernels.pack_q4(codes, scale, zero)
            self.register_buffer("codes", packed)
            self.register_buffer("scales_and_zeros", scales_and_zeros)  # [panel, group, 2, 16]: our layout
        else:
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
            # [groups, out_features, 2]: the kernel's layout of (scale, zero)
            self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def __setstate__(self, state: dict) -> None:  # unpickled (torch.load) in a process that has not loaded our kernel
        super().__setstate__(state)
        self._check_kernel()

    def _check_kernel(self) -> None:
        """Load our 4-bit kernel where this layer runs it (`runs_q4` loads it); raise where it does not run here."""
        if self.ours and not kernels.runs_q4():
            raise RuntimeError("this int4 layer runs lookahead's 4-bit kernel, which does not run here (it needs "
                               "AVX-512 BF16 and a C compiler: see kernels.library); quantise with ours=False")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:
            bias = None if self.bias is None else self.bias.float()
            return kernels.linear_q4(x, self.codes, self.scales_and_zeros, bias).to(x.dtype)
        rows = x.reshape(-1, self.in_features).to(_KERNEL_DTYPE)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return _finish(out, x, self.bias)


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def int4_fits(linear: nn.Linear) -> bool:
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % KERNEL_ALIGNMENT == 0


def int8_fits(linear: nn.Linear) -> bool:
    return linear.in_features % KERNEL_ALIGNMENT == 0


def _as_linear(module: nn.Linear | Conv1D) -> nn.Linear:
    """The `nn.Linear` a layer computes: itself, or for transformers' `Conv1D` (GPT-2's layers: y = x W + b, W
    stored [in, out]) a linear layer over a transposed copy of its weight."""
    if type(module) is nn.Linear:
        return module
    linear = nn.Linear(module.nx, module.nf, bias=False, device="meta")
    linear.weight = nn.Parameter(module.weight.detach().t().contiguous(), requires_grad=False)
    linear.bias = module.bias
    return linear


@torch.no_grad()
def quantise_weights(model: nn.Module, kind: str) -> nn.Module:
    """Replace every `nn.Linear` (and transformers' `Conv1D`) of a CPU model, in place, by its `kind` ("int8" or
    "int4") counterpart; with int4, the output layer and any layer of a shape the int4 kernel does not take become
    int8; a layer whose input size is not a multiple of 16 keeps its float weights. Returns the model."""
    if kind not in QUANTISED_WEIGHTS:
        raise ValueError(f"quantised weights must be one of {QUANTISED_WEIGHTS}, got {kind!r}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("int8/int4 weights run on torch's CPU kernels: load the model on the CPU")
    if weights_of(model) is not None:
        raise ValueError(f"the model's weights are {weights_of(model)} already: quantise a float model, once")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # Every name of each layer: one shared by two modules is replaced under both, by one quantised layer.
    targets = [(name, module) for name, module in model.named_modules(remove_duplicate=False)
               if type(module) in (nn.Linear, Conv1D)]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no nn.Linear or Conv1D layers to quantise")
    replacements: dict[int, nn.Module | None] = {}
    for name, module in targets:
        if id(module) not in replacements:
            linear = _as_linear(module)  # one layer's transposed copy at a time, for a Conv1D
            if kind == "int4" and module is not output and int4_fits(linear):
                replacements[id(module)] = Int4Linear(linear)
            elif int8_fits(linear):
                replacements[id(module)] = Int8Linear(linear)
            else:
                replacements[id(module)] = None  # a shape neither kernel takes: the layer keeps its float weights
        if replacements[id(module)] is not None:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacements[id(module)])
    if not any(replacements.values()):  # nothing quantised: a model labelled int8 or int4 that is its float self
        raise ValueError(f"none of {type(model).__name__}'s nn.Linear or Conv1D layers has a shape the kernels take "
                         f"(input features a multiple of {KERNEL_ALIGNMENT}): it keeps its float weights")
    # On the model, not its config, which other models built from the same config object share.
    model.lookahead_weights = kind
    return model


def weights_of(model: nn.Module) -> str | None:
    """"int8" or "int4" for a model quantised by `quantise_weights`, else None."""
    return getattr(model, "lookahead_weights", None)


def rounding_dtype(model: nn.Module) -> torch.dtype:
    """The coarsest rounding the model's logits go through: the kernels' bfloat16 for quantised weights."""
    return _KERNEL_DTYPE if weights_of(model) else model.dtype

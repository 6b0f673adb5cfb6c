"""Weights kept quantised: a model's linear layers swapped for int8 or int4 layers that run torch's own CPU
kernels on the packed weights, so that a step reads 1/4 (int8) or about 1/6 (int4) of the float32 bytes.

- `int8`: one int8 per weight, one scale per output channel (`torch._weight_int8pack_mm`).
- `int4`: 4-bit codes in groups of 32 inputs, each group with its own scale and minimum, the layout of
  GGUF's Q4_1 blocks (`torch._weight_int4pack_mm_for_cpu`).
- The output layer (`lm_head`, 49152 x 576 on the default model, a fifth of its weights), in both: int8
  weights times int8 inputs, multiplied in integers (`torch._int_mm`, `Int8DynamicLinear`): a step of 1, 4
  or 8 rows costs 1.0, 1.2 or 4.4 ms less than with the weight-only int8 kernel.

The weight-only kernels take bfloat16 inputs and scales (with float32 inputs they fall back to a path
20-40x slower); everything else in the model stays in its own dtype: only a layer's input is rounded (to
bfloat16, or to int8 for the output layer) and its output returned in the model's dtype. Every kernel
computes each input row on its own (a row's result is bit-identical whether it is fed alone or among
others; the integer products are exact), which is what keeps lookahead's greedy output token-identical to
`generate` on the same quantised model.

Quantising is a one-way approximation of the float weights: a quantised model is its own model, with
transformers' `generate` on it as the reference. It is the same module for both, so both run the same
kernels.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

QUANTISED_WEIGHTS = ("int8", "int4")
GROUP_SIZE = 32
_KERNEL_DTYPE = torch.bfloat16


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 codes times a scale per output channel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
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


class Int4Linear(nn.Module):
    """y = x W^T + b with W in groups of 32 inputs: w = scale * (code - 8) + zero, code in 0..15, i.e.
    scale * code + minimum, as GGUF's Q4_1 blocks store it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not int4_fits(linear):
            raise ValueError(f"int4 needs in_features divisible by {GROUP_SIZE}, got {linear.in_features}")
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
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        # [groups, out_features, 2]: the kernel's layout of (scale, zero)
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(_KERNEL_DTYPE)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return _finish(out, x, self.bias)


class Int8DynamicLinear(nn.Module):
    """y = x W^T + b in integers: each row of x / smooth rounded to int8 with a scale of its own (its largest
    magnitude / 127) when it arrives, W * smooth as int8 codes with a scale per output channel, their product
    exact in int32, then scaled back.

    `smooth` (per input channel; SmoothQuant's migration): dividing the inputs by it and multiplying the
    weight's columns by it leaves x W^T as it was, but tames the few channels far larger than the rest, which
    would otherwise set every row's scale.

    Used for the output layer only: its cost hardly grows with the rows fed (the default model's: 1.5 / 1.7
    / 1.8 / 2.1 ms for 1 / 4 / 8 / 16 rows against 2.4 / 3.0 / 5.6 / 9.0 ms with `Int8Linear`), and as the
    last layer its input's rounding moves only the logits. Rounding activations to int8 inside the model
    would turn the float differences between a row computed alone and among others (attention) into
    different codes, and lookahead would leave `generate`'s output at more than ties."""

    def __init__(self, linear: nn.Linear, smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        smooth = torch.ones(linear.in_features) if smooth is None else smooth.float()
        weight = linear.weight.detach().float() * smooth
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # [in, out] as a view of [out, in] codes: oneDNN's one-row path is 2x faster so than on [in, out] ones
        self.register_buffer("codes_t", codes.t())
        self.register_buffer("scale", scale)
        self.register_buffer("inverse_smooth", 1 / smooth)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float() * self.inverse_smooth
        row_scale = (rows.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round(rows / row_scale).to(torch.int8)
        out = torch._int_mm(codes, self.codes_t).float() * row_scale * self.scale
        return _finish(out, x, self.bias)


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def int4_fits(linear: nn.Linear) -> bool:
    return linear.in_features % GROUP_SIZE == 0


@torch.no_grad()
def quantise_weights(model: nn.Module, kind: str, calibration: Iterable[torch.Tensor] | None = None) -> nn.Module:
    """Replace every `nn.Linear` of a CPU model, in place, by its `kind` ("int8" or "int4") counterpart;
    the output layer becomes an `Int8DynamicLinear`; with int4, a layer whose input size is not a multiple of
    32 becomes int8. Returns the model.

    `calibration`: model inputs (token ids [1, n]) run through the float model first to find the output
    layer's largest input per channel, from which its smoothing is set (SmoothQuant, alpha 0.5). Without
    them it is not smoothed, and its logits are coarser (default model: perplexity 5.93 instead of 5.90)."""
    if kind not in QUANTISED_WEIGHTS:
        raise ValueError(f"quantised weights must be one of {QUANTISED_WEIGHTS}, got {kind!r}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("int8/int4 weights run on torch's CPU kernels: load the model on the CPU")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to quantise")
    smooth = None
    if calibration is not None and isinstance(output, nn.Linear):
        smooth = _smoothing(_input_range(model, output, calibration), output.weight.detach().float().abs().amax(dim=0))
    for name, linear in targets:
        if linear is output:
            replacement = Int8DynamicLinear(linear, smooth)
        elif kind == "int4" and int4_fits(linear):
            replacement = Int4Linear(linear)
        else:
            replacement = Int8Linear(linear)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    if hasattr(model, "config"):  # read by `weights_of`; part of the config, so of the cost curve's cache key
        model.config.lookahead_weights = kind
    return model


def _input_range(model: nn.Module, layer: nn.Linear, calibration: Iterable[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude of each input channel of `layer` while the model runs on the calibration inputs."""
    seen = torch.zeros(layer.in_features)

    def record(_: nn.Module, args: tuple) -> None:
        torch.maximum(seen, args[0].detach().reshape(-1, layer.in_features).abs().amax(dim=0).float(), out=seen)

    hook = layer.register_forward_pre_hook(record)
    fed = 0
    try:
        for input_ids in calibration:
            model(input_ids)
            fed += 1
    finally:
        hook.remove()
    if not fed:
        raise ValueError("calibration= holds no inputs")
    return seen


def _smoothing(input_range: torch.Tensor, weight_range: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's factor per input channel at alpha 0.5, sqrt(max |x| / max |w|): the input's and the
    weight's ranges end up equal. Channels never seen or all-zero keep 1."""
    smooth = (input_range / weight_range.clamp(min=torch.finfo(torch.float32).tiny)).sqrt()
    return torch.where((input_range > 0) & (weight_range > 0), smooth, torch.ones_like(smooth))


def weights_of(model: nn.Module) -> str | None:
    """"int8" or "int4" for a model quantised by `quantise_weights`, else None."""
    return getattr(getattr(model, "config", None), "lookahead_weights", None)


def rounding_dtype(model: nn.Module) -> torch.dtype:
    """The coarsest rounding the model's logits go through: the kernels' bfloat16 for quantised weights."""
    return _KERNEL_DTYPE if weights_of(model) else model.dtype

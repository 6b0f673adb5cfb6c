"""Weights kept quantised (`lookahead.quant`, `dtype="int8"/"int4"`): the layers compute what their codes
say, each row on its own, and lookahead on a quantised model follows `generate` on the same model except
at ties of the bfloat16 logits."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lookahead import costs, generate, kernels
from lookahead.bench.runner import TieMeter
from lookahead import hf
from lookahead.hf import HFModelRunner, PackedLinears
from lookahead.prompts import encode_prompt
from lookahead.quant import GROUP_SIZE, Int4Linear, Int8Linear, quantise_weights, rounding_dtype, weights_of
from lookahead.workloads import load_workload

from conftest import _COMMON, make_tiny_model, peaked, reference_greedy, run_cli


def _linear(weight: torch.Tensor, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.normal_()
    return layer


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


OURS_RUN = pytest.mark.skipif(not kernels.runs_q4(), reason="our 4-bit kernel needs AVX-512 BF16")


@pytest.mark.parametrize("ours", [False, pytest.param(True, marks=OURS_RUN)])
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9), bias=st.booleans())
def test_int4_layer_computes_with_its_groups_scale_and_minimum(ours, seed, rows, bias):
    """A weight that groups of 32 represent exactly (code * scale + minimum, both powers of two) comes out
    exact: the layer's output is the float product of the bfloat16-rounded input, rounded to bfloat16 (torch's
    kernel rounds the bias in too; ours adds it before rounding)."""
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = 64, 3 * GROUP_SIZE
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator).float()
    codes[:, ::GROUP_SIZE] = 0  # every group spans the full 0..15 range, so its scale and minimum are exact
    codes[:, 1::GROUP_SIZE] = 15
    groups = (out_features, in_features // GROUP_SIZE)
    scale = 2.0 ** torch.randint(-8, -3, groups, generator=generator).float()
    minimum = -(2.0 ** torch.randint(-5, 0, groups, generator=generator).float())
    weight = codes * scale.repeat_interleave(GROUP_SIZE, 1) + minimum.repeat_interleave(GROUP_SIZE, 1)
    layer = _linear(weight, bias)
    x = torch.randn(rows, in_features, generator=generator)
    int4 = Int4Linear(layer, ours=ours)
    if not ours:
        expected = _bf16(_bf16(x) @ weight.T) + (layer.bias.detach() if bias else 0)
        torch.testing.assert_close(int4(x), expected, rtol=2**-7, atol=1e-6)
        return
    out = int4(x)
    assert torch.equal(out, _bf16(out))
    expected = _bf16(x).double() @ weight.double().T + (layer.bias.detach().double() if bias else 0)
    # Rounded to bfloat16 (2^-9), and a code enters the products as 128 + code (`linear_q4.c`): float32 sums of
    # larger terms, ~2^-24 * 136 * sum |x| * scale a group, taken back after.
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-4)


@OURS_RUN
def test_our_4_bit_operator_refuses_an_input_of_another_size():
    """`torch.ops.lookahead.linear_q4` (registered from C++) names the input size its packed weight takes, and the
    layout its codes and scales must have."""
    layer = Int4Linear(_linear(torch.randn(32, 2 * GROUP_SIZE), bias=False), ours=True)
    with pytest.raises(RuntimeError, match=f"for an input of {2 * GROUP_SIZE}"):
        kernels.linear_q4(torch.randn(1, GROUP_SIZE), layer.codes, layer.scales_and_zeros, None)
    with pytest.raises(RuntimeError, match=r"pack_q4's codes, \[n / 16, k / 4, 32\] .* not \[2, 32, 16\]"):
        kernels.linear_q4(torch.randn(1, 2 * GROUP_SIZE), layer.codes.view(2, 32, 16), layer.scales_and_zeros, None)
    with pytest.raises(RuntimeError, match=r"pack_q4's scales, \[2, 2, 2, 16\] for these codes, not \[2, 2, 32\]"):
        kernels.linear_q4(torch.randn(1, 2 * GROUP_SIZE), layer.codes, layer.scales_and_zeros.view(2, 2, 32), None)


@OURS_RUN
def test_stacked_4_bit_layers_give_each_layers_own_output_in_the_models_dtype():
    """A bfloat16 model with int4 layers: run stacked where they share an input (`PackedLinears`, "q4"), its
    logits are its own, bfloat16 as they are."""
    model = quantise_weights(make_tiny_model("llama", seed=2).to(torch.bfloat16), "int4")
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        own = model(input_ids=ids).logits
        packs = hf._packs(model, "q4")
        for _ in range(2):  # (a first forward may find the layers to stack)
            with packs.active():
                stacked = model(input_ids=ids).logits
    assert packs.groups and stacked.dtype == torch.bfloat16
    assert torch.equal(stacked, own)


def test_int8_layer_computes_with_a_scale_per_output_channel():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (48, 64), generator=generator).float()
    codes[:, 0] = 127  # the largest magnitude fixes each channel's scale at a power of two / 127 * 127
    scale = 2.0 ** torch.randint(-9, -4, (48, 1), generator=generator).float()
    layer = _linear(codes * scale)
    x = torch.randn(5, 64, generator=generator)
    torch.testing.assert_close(Int8Linear(layer)(x), _bf16(_bf16(x) @ (codes * scale).T), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("kind", [functools.partial(Int4Linear, ours=False),
                                  pytest.param(functools.partial(Int4Linear, ours=True), marks=OURS_RUN), Int8Linear])
def test_each_row_is_computed_on_its_own(kind):
    """What lookahead's exactness rests on: a row's output does not depend on the rows fed with it."""
    torch.manual_seed(0)
    layer = kind(nn.Linear(96, 160))
    x = torch.randn(40, 96)
    together = layer(x)
    for count in (1, 2, 3, 8, 17, 40):
        alone = torch.cat([layer(x[i : i + 1]) for i in range(count)])
        assert torch.equal(layer(x[:count]), alone) and torch.equal(together[:count], alone)


def test_a_layer_two_modules_share_is_quantised_under_both_and_once():
    shared = nn.Linear(64, 64)
    model = quantise_weights(nn.Sequential(nn.Sequential(shared), nn.Sequential(shared)), "int8")
    assert isinstance(model[0][0], Int8Linear) and model[1][0] is model[0][0]  # the second had kept float weights
    with pytest.raises(ValueError, match="the model's weights are int8 already: quantise a float model, once"):
        quantise_weights(model, "int4")


def test_quantising_a_model_labels_that_model_not_others_of_its_config():
    """The label was written on the config, which two models built from one config object share: the float one
    was then taken for int4 (its rounding, its cost curves)."""
    config = LlamaConfig(**_COMMON)
    quantised, plain = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    quantise_weights(quantised, "int4")
    assert weights_of(quantised) == "int4" and weights_of(plain) is None and rounding_dtype(plain) == torch.float32
    assert costs._curve_key(HFModelRunner(quantised)) != costs._curve_key(HFModelRunner(plain))


def test_quantise_weights_swaps_every_linear(llama_tiny):
    model = quantise_weights(copy.deepcopy(llama_tiny), "int4")
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)  # the output layer stays at 8 bits, as GGUF files keep it
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    assert model.model.layers[0].mlp.down_proj.ours == kernels.runs_q4()  # our kernel wherever it runs
    assert weights_of(model) == "int4" and weights_of(llama_tiny) is None
    assert rounding_dtype(model) == torch.bfloat16 and rounding_dtype(llama_tiny) == torch.float32
    # an input size that groups of 32 do not divide falls back to int8
    odd = quantise_weights(nn.Sequential(nn.Linear(48, 8)), "int4")
    assert isinstance(odd[0], Int8Linear)


def test_quantise_weights_rejects_what_it_cannot_do(llama_tiny):
    with pytest.raises(ValueError, match=r"must be one of \('int8', 'int4'\), got 'int2'"):
        quantise_weights(copy.deepcopy(llama_tiny), "int2")
    with pytest.raises(ValueError, match="no nn.Linear or Conv1D layers"):
        quantise_weights(nn.Sequential(nn.ReLU()), "int8")
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        Int4Linear(nn.Linear(40, 8))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    n = min(a.numel(), b.numel())
    different = (a[:n] != b[:n]).nonzero()
    return int(different[0]) if len(different) else (None if a.numel() == b.numel() else n)


def _follows_generate_up_to_ties(model, prompts: list[torch.Tensor], max_new_tokens: int) -> int:
    """Greedy lookahead against transformers' `generate` on the same quantised model: each output is
    identical, or its first difference is a choice between two tokens whose logits lie within two bfloat16
    steps. Returns how many were identical."""
    meter = TieMeter(model)
    identical = 0
    for prompt in prompts:
        start = prompt.shape[1]
        reference = reference_greedy(model, prompt, max_new_tokens)[0, start:]
        ours = generate(model, prompt, max_new_tokens=max_new_tokens).sequences[0, start:]
        index = _first_difference(reference, ours)
        if index is None:
            identical += 1
            continue
        gap, _, spacing = meter.gaps(prompt, reference.tolist(), ours.tolist(), index)
        assert gap <= 2 * spacing, (prompt.tolist(), index, gap, spacing)
    return identical


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_lookahead_follows_generate_on_the_quantised_model_up_to_bfloat16_ties(llama_tiny, kind):
    model = quantise_weights(copy.deepcopy(llama_tiny), kind)
    prompts = [torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(seed)) for seed in range(6)]
    assert _follows_generate_up_to_ties(model, prompts, 40) >= 3


@pytest.mark.slow
def test_the_default_model_with_int4_weights_follows_generate_up_to_ties(default_model_int4):
    model, tokenizer = default_model_int4
    assert weights_of(model) == "int4"
    prompts = [encode_prompt(tokenizer, prompt.turns[0])
               for prompt in load_workload("mt_bench")[::40] + load_workload("humaneval")[:2]]
    assert _follows_generate_up_to_ties(model, prompts, 64) >= 1


def test_cli_generates_with_int4_weights(tiny_dir):
    result = run_cli("generate", "def add(a, b):", "--raw", "--model", tiny_dir, "--dtype", "int4",
                     "--max-new-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    assert '"new_tokens": 8' in result.stdout


def test_layers_of_shapes_the_kernels_do_not_take_keep_working():
    """The int8 kernel needs an input size that is a multiple of 16 (others gave wrong products or crashed),
    the int4 kernel an output size that is one too: such layers fall back to int8, or keep float weights."""
    from lookahead.quant import Int4Linear, Int8Linear, quantise_weights
    torch.manual_seed(0)
    shapes = [(64, 40), (40, 64), (64, 1), (64, 32)]
    floats = nn.ModuleList(nn.Linear(a, b) for a, b in shapes)
    model = quantise_weights(copy.deepcopy(floats), "int4")
    assert [type(layer) for layer in model] == [Int8Linear, nn.Linear, Int8Linear, Int4Linear]
    for (inputs, _), quantised, original in zip(shapes, model, floats):
        x = torch.randn(3, inputs)
        error = (quantised(x) - original(x)).abs().max() / original(x).abs().max()
        assert error < 0.1, (inputs, type(quantised).__name__)  # a quantisation error, not a wrong product
    with pytest.raises(ValueError, match="int8 needs in_features divisible by 16, got 40"):
        Int8Linear(nn.Linear(40, 8))
    with pytest.raises(ValueError, match="int4 needs in_features divisible by 32 and out_features by 16, got 64 and 1"):
        Int4Linear(nn.Linear(64, 1))


class _SharedInput4(nn.Module):
    """Three 4-bit layers on one input (as a layer's query, key and value), one on another."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.out = (Int4Linear(nn.Linear(64, n, bias=bias), ours=True)
                                            for n, bias in ((64, True), (16, True), (32, True), (64, False)))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.q(x), self.k(x), self.v(x), self.out(x * 2)]


@OURS_RUN
def test_our_4_bit_layers_on_one_input_run_stacked_each_output_as_alone():
    """The "q4" packer: after the first forward, our 4-bit layers that took the same input run as one call over
    their codes stacked, and each output is bit-identical to its own layer's."""
    module = _SharedInput4()
    packed = PackedLinears(module, "q4")
    x = torch.randn(3, 5, 64)
    expected = module(x)
    for _ in range(2):  # the first forward finds the group, the second runs it
        with packed.active():
            got = module(x)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert [group.members for group in packed.groups] == [[module.q, module.k, module.v]]


@OURS_RUN
def test_int4_lookahead_on_stacked_layers_follows_generate(llama_tiny):
    model = quantise_weights(copy.deepcopy(llama_tiny), "int4")
    assert "q4" in PackedLinears.packers(model)
    prompt = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    expected = generate(model, prompt, max_new_tokens=30, packed_linear=False).sequences
    assert torch.equal(generate(model, prompt, max_new_tokens=30, packed_linear=True).sequences, expected)
    assert _follows_generate_up_to_ties(model, [prompt], 30) == 1  # and transformers' (our two could agree wrongly)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantised_model_cast_to_another_dtype_keeps_its_kernels_formats(kind):
    """`.float()`, `.half()` (and TieMeter, which widens a bfloat16 model) had cast the bfloat16 scales too, which the
    kernels refuse: the next forward raised. The weights stay as quantised, the bias follows the model."""
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model = quantise_weights(make_tiny_model("llama"), kind)
    expected = model(prompt).logits
    assert torch.equal(copy.deepcopy(model).float()(prompt).logits, expected)
    half = copy.deepcopy(model).half()
    assert half(prompt).logits.dtype == torch.float16
    assert torch.allclose(half(prompt).logits.float(), expected, atol=0.1)
    wide = quantise_weights(make_tiny_model("llama").to(torch.bfloat16), kind)
    reference = wide.generate(prompt, do_sample=False, max_new_tokens=4, pad_token_id=0)[0, 6:].tolist()
    other = reference[:3] + [(reference[3] + 1) % 128]
    gap, _, _ = TieMeter(wide).gaps(prompt, reference, other, 3)
    assert gap >= 0


QUANTISED_IN_A_NEW_PROCESS = """
import sys, torch
from torch import nn
from lookahead.quant import Int4Linear
if sys.argv[1] == "built":
    layer = Int4Linear(nn.Linear(64, 32), ours=True)
else:
    layer = torch.load(sys.argv[1], weights_only=False)
print(tuple(layer(torch.ones(1, 64)).shape))
"""


@OURS_RUN
def test_an_int4_layer_on_our_kernel_runs_in_a_process_that_had_not_loaded_it(tmp_path):
    """Built with ours=True, or unpickled (torch.load), the layer had called our operator before any code loaded it
    in that process: AttributeError at the first forward."""
    import subprocess
    import sys

    torch.save(Int4Linear(nn.Linear(64, 32), ours=True), tmp_path / "layer.pt")
    for how in ("built", str(tmp_path / "layer.pt")):
        done = subprocess.run([sys.executable, "-c", QUANTISED_IN_A_NEW_PROCESS, how], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "(1, 32)", done.stderr


def test_an_int4_layer_refuses_our_kernel_where_it_does_not_run(monkeypatch):
    monkeypatch.setattr(kernels, "runs_q4", lambda: False)
    with pytest.raises(RuntimeError, match="runs lookahead's 4-bit kernel, which does not run here"):
        Int4Linear(nn.Linear(64, 32), ours=True)
    assert not Int4Linear(nn.Linear(64, 32)).ours  # None: where it runs


def test_a_model_none_of_whose_layers_the_kernels_take_is_refused_not_labelled():
    """Its only linear layer (40 inputs) kept its float weights, and the model had been labelled int8 all the same."""
    model = nn.Sequential(nn.Linear(40, 8))
    with pytest.raises(ValueError, match="none of Sequential's nn.Linear or Conv1D layers has a shape the kernels take"):
        quantise_weights(model, "int8")
    assert weights_of(model) is None


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_gpt2s_conv1d_layers_are_quantised_and_lookahead_follows_generate(kind):
    """GPT-2's blocks are transformers' `Conv1D` (weights stored [in, out]), not `nn.Linear`: they had kept their
    float weights while the model was labelled int4."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    plain = peaked(GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=256, n_embd=64, n_layer=2, n_head=4)), 0.15)
    model = quantise_weights(copy.deepcopy(plain), kind)
    assert not any(type(m) in (nn.Linear, Conv1D) for m in model.modules())
    block = model.transformer.h[0]
    assert isinstance(block.attn.c_attn, Int4Linear if kind == "int4" else Int8Linear)
    x = torch.randn(3, 64)
    for quantised, original in ((block.attn.c_attn, plain.transformer.h[0].attn.c_attn),
                                (block.attn.c_proj, plain.transformer.h[0].attn.c_proj)):
        error = (quantised(x) - original(x)).abs().max() / original(x).abs().max()
        assert error < 0.25  # a quantisation error (int4: about 0.1 here), not a transposed product
    prompts = [torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    assert _follows_generate_up_to_ties(model, prompts, 30) >= 2

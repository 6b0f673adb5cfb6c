"""Shared fixtures: tiny random models of several families, and the real default model."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lookahead.baseline import hf_generate

TINY_VOCAB = 128
_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _tiny(family: str):
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**_COMMON))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_COMMON))
    if family == "mistral":  # a sliding window shorter than the sequences, to exercise the sliding mask
        return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=24))
    if family == "phi3":
        return Phi3ForCausalLM(Phi3Config(**_COMMON))
    if family == "gemma3":  # hybrid: sliding and full layers alternate
        config = Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 3},
            head_dim=16,
            sliding_window=20,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        return Gemma3ForCausalLM(config)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gemma3")


def make_tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A small random model whose greedy output is varied enough to test with: larger init weights
    give peaked, input-dependent distributions instead of near-uniform ones."""
    torch.manual_seed(seed)
    return peaked(_tiny(family), 0.15)


def peaked(model: torch.nn.Module, std: float) -> torch.nn.Module:
    """Re-draw the weight matrices with a larger spread, in eval mode."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, std)
    return model.eval()


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def llama_tiny():
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def default_model():
    from lookahead import load_model

    return load_model()


def reference_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    return hf_generate(model, input_ids, max_new_tokens, eos_token_id=eos_token_id)[0]

"""Bad input gives a clear error naming the argument and what is allowed, before any work is done."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from lookahead import LookaheadConfig, UnsupportedModelError, generate


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window": -1}, "window must be an integer >= 0"),
        ({"ngram": 1}, "ngram must be an integer >= 2"),
        ({"guesses": -2}, "guesses must be an integer >= 0"),
        ({"window": 2.5}, "window must be an integer"),
        ({"ngram": True}, "ngram must be an integer"),
        ({"seed_from_prompt": "yes"}, "seed_from_prompt must be a bool"),
        ({"learn_from_output": 1}, "learn_from_output must be a bool"),
        ({"seed": -1}, "seed must be an integer >= 0"),
    ],
)
def test_invalid_config_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LookaheadConfig(**kwargs)


class Recorder:
    def __init__(self):
        self.calls = 0

    def put(self, value):
        self.calls += 1

    def end(self):
        self.calls += 1


@pytest.mark.parametrize(
    "input_ids, message",
    [
        (torch.zeros(1, 0, dtype=torch.long), "input_ids is empty"),
        ([], "input_ids is empty"),
        (torch.ones(2, 5, dtype=torch.long), "streamer takes one sequence"),
        (torch.ones(1, 1, 5, dtype=torch.long), r"shape \[n\] or \[B, n\], or be a list of 1-D prompts; got shape \[1, 1, 5\]"),
        (torch.ones(1, 5), "integer token ids"),
    ],
)
def test_bad_prompts(llama_tiny, input_ids, message):
    recorder = Recorder()
    with pytest.raises(ValueError, match=message):
        generate(llama_tiny, input_ids, streamer=recorder)
    assert recorder.calls == 0  # nothing half-done: the streamer never saw a token


@pytest.mark.parametrize("value", [0, -3, 2.0, None])
def test_bad_max_new_tokens(llama_tiny, value):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate(llama_tiny, [5, 6, 7], max_new_tokens=value)


def test_bad_config_type(llama_tiny):
    with pytest.raises(TypeError, match="config must be a LookaheadConfig"):
        generate(llama_tiny, [5, 6, 7], config={"window": 3})


def test_attention_without_custom_masks_is_refused():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="'flash_attention_2' cannot take a custom 4-D mask.*'eager', 'sdpa'"):
        generate(model, [1, 2, 3])


def test_encoder_decoder_is_refused():
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16))
    with pytest.raises(UnsupportedModelError, match="decoder-only"):
        generate(model.eval(), [1, 2, 3])


def test_not_a_model_is_refused():
    with pytest.raises(UnsupportedModelError, match="must be a transformers causal LM"):
        generate(torch.nn.Linear(2, 2), [1, 2, 3])


def test_layers_whose_cache_cannot_roll_back_are_refused(llama_tiny):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    model.config.layer_types = ["linear_attention"]
    with pytest.raises(UnsupportedModelError, match=r"\['linear_attention'\]"):
        generate(model, [1, 2, 3])


@pytest.mark.parametrize("bad_id", [10**7, -5, 128])
def test_ids_outside_the_vocabulary(llama_tiny, bad_id):
    recorder = Recorder()
    with pytest.raises(ValueError, match=rf"token id {bad_id}, outside the model's vocabulary \[0, 128\)"):
        generate(llama_tiny, [[5, bad_id, 6]], streamer=recorder)
    assert recorder.calls == 0


def test_prompt_longer_than_the_context(llama_tiny):
    context = llama_tiny.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"the prompt has {context + 1} tokens, more than the model's context of {context}"):
        generate(llama_tiny, [5] * (context + 1))


def test_prompt_plus_new_tokens_past_the_context(llama_tiny):
    context = llama_tiny.config.max_position_embeddings
    prompt = [5] * (context - 10)
    with pytest.raises(ValueError, match=rf"\({context - 10} tokens\) \+ max_new_tokens \(11\) = {context + 1} exceeds "
                                         rf"the model's context of {context} positions; max_new_tokens can be at most 10"):
        generate(llama_tiny, prompt, max_new_tokens=11)
    assert generate(llama_tiny, prompt, max_new_tokens=10, eos_token_id=[]).sequences.shape[1] == context  # the edge fits


@pytest.mark.parametrize(
    "prompt, args, message",
    [
        ("hello", ["--max-new-tokens", "9000"], "max_new_tokens (9000) = "),
        ("word " * 9000, ["--raw", "--max-new-tokens", "1"], "more than the model's context of 8192 positions"),
    ],
    ids=["new-tokens-past-context", "prompt-past-context"],
)
def test_cli_reports_requests_past_the_context_in_one_line(prompt, args, message):
    result = run_cli("generate", prompt, *args)
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr

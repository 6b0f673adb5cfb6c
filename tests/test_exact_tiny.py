"""Exactness on tiny random models of several families: lookahead output == plain greedy `generate`."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, reference_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lookahead import LookaheadConfig, generate
from lookahead.core.layout import build_guess_tree, step_layout
from lookahead.hf import HFModelRunner

CONFIGS = [
    LookaheadConfig(),
    LookaheadConfig(window=3, ngram=3, guesses=3),
    LookaheadConfig(window=7, ngram=5, guesses=2, seed=3),
    LookaheadConfig(window=0, ngram=3, guesses=4),  # prompt n-grams only
    LookaheadConfig(window=0, guesses=0),  # plain decoding through our loop
]


def random_prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"W{c.window}N{c.ngram}G{c.guesses}")
def test_identical_to_greedy(tiny_model, config):
    for seed, length in [(1, 30), (2, 5), (3, 1)]:
        prompt = random_prompt(length, seed)
        expected = reference_greedy(tiny_model, prompt, 48)
        out = generate(tiny_model, prompt, max_new_tokens=48, config=config)
        assert torch.equal(out.sequences, expected)
        assert out.stats.new_tokens == expected.shape[1] - length
        assert sum(out.stats.accepted_per_step) == out.stats.new_tokens
        assert out.stats.steps == len(out.stats.accepted_per_step)


def test_lookahead_accepts_guesses_on_some_family():
    """Exactness alone cannot tell a working guess path from one that never matches: make sure that,
    across families and prompts, verified guesses are accepted (more than one token per step)."""
    accepted = 0
    for family in ("qwen2", "phi3", "mistral"):
        model = make_tiny_model(family)
        for seed in range(3):
            out = generate(model, random_prompt(30, seed), max_new_tokens=60)
            accepted += out.stats.new_tokens - out.stats.steps
    assert accepted > 10


def test_step_predictions_equal_plain_forward(tiny_model):
    """Every row of a lookahead step predicts what a plain forward over that row's context predicts."""
    runner = HFModelRunner(tiny_model)
    prompt = random_prompt(40, 5)[0]
    cache = runner.new_cache()
    runner.prefill(cache, prompt[:-1])
    layout = step_layout(3, 4, build_guess_tree([(9, 8, 7), (9, 6, 5), (4, 3, 2)], 3))
    tokens = torch.randint(3, 128, (layout.size,), generator=torch.Generator().manual_seed(6))
    tokens[0] = prompt[-1]
    past = cache.get_seq_length()
    logits = runner.logits(cache, tokens, past + layout.offsets, layout.allowed, torch.arange(layout.size))
    for row in range(layout.size):
        context_rows = torch.nonzero(layout.allowed[row]).flatten()
        context_rows = context_rows[layout.offsets[context_rows].argsort()]
        sequence = torch.cat([prompt[:-1], tokens[context_rows]])
        with torch.inference_mode():
            expected = tiny_model(sequence.view(1, -1)).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt_length", [20, 250], ids=["in-capacity", "cache-grows-during-step"])
def test_commit_leaves_exactly_the_committed_tokens_in_the_cache(llama_tiny, prompt_length):
    runner = HFModelRunner(llama_tiny)
    prompt = random_prompt(prompt_length, 7)[0]
    cache = runner.new_cache()
    runner.prefill(cache, prompt[:-1])
    tree = build_guess_tree([(9, 8, 7), (9, 6, 5)], 3)
    layout = step_layout(2, 3, tree)
    tokens = torch.randint(3, 128, (layout.size,), generator=torch.Generator().manual_seed(8))
    tokens[0] = prompt[-1]
    past = cache.get_seq_length()
    runner.logits(cache, tokens, past + layout.offsets, layout.allowed, layout.logit_rows)
    kept = torch.cat([torch.zeros(1, dtype=torch.long), tree.paths[1, :2] + layout.tree_start])
    runner.commit(cache, past, kept)
    committed = torch.cat([prompt[:-1], tokens[kept]])
    fresh = runner.new_cache()
    runner.prefill(fresh, committed)
    assert cache.get_seq_length() == committed.numel()
    for ours, reference in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(ours.keys, reference.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.values, reference.values, rtol=1e-4, atol=1e-5)


def test_phase_seconds_account_for_the_whole_call(llama_tiny):
    stats = generate(llama_tiny, random_prompt(30, 3), max_new_tokens=24).stats
    phases = stats.phase_seconds
    assert {"prefill", "plan", "inputs", "forward", "verify", "commit", "other"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) == pytest.approx(stats.seconds, abs=2e-3)
    assert phases["forward"] <= stats.forward_seconds  # which also counts the prefill's forward


def test_eos_stops_like_greedy(tiny_model):
    prompt = random_prompt(30, 11)
    free_run = reference_greedy(tiny_model, prompt, 40)[0, 30:].tolist()
    eos = free_run[len(free_run) // 2]  # a token that does occur in the output
    expected = reference_greedy(tiny_model, prompt, 40, eos_token_id=eos)
    for config in CONFIGS[:3]:
        out = generate(tiny_model, prompt, max_new_tokens=40, config=config, eos_token_id=eos)
        assert torch.equal(out.sequences, expected)
        assert out.sequences[0, -1].item() == eos
    several = [free_run[-1], eos]
    expected = reference_greedy(tiny_model, prompt, 40, eos_token_id=several)
    assert torch.equal(generate(tiny_model, prompt, max_new_tokens=40, eos_token_id=several).sequences, expected)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 17])
def test_max_new_tokens_is_never_exceeded(llama_tiny, max_new_tokens):
    prompt = random_prompt(12, 13)
    expected = reference_greedy(llama_tiny, prompt, max_new_tokens, eos_token_id=[])
    out = generate(llama_tiny, prompt, max_new_tokens=max_new_tokens, eos_token_id=[])
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens == max_new_tokens


def test_streamer_receives_prompt_then_every_committed_token(llama_tiny):
    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    prompt = random_prompt(20, 17)
    recorder = Recorder()
    out = generate(llama_tiny, prompt, max_new_tokens=30, streamer=recorder)
    assert recorder.chunks[0] == prompt[0].tolist()
    assert sum(recorder.chunks[1:], []) == out.sequences[0, 20:].tolist()
    assert recorder.ended


@given(
    prompt=st.lists(st.integers(3, 127), min_size=1, max_size=40),
    window=st.integers(0, 6),
    ngram=st.integers(2, 5),
    guesses=st.integers(0, 6),
    max_new_tokens=st.integers(1, 40),
    family=st.sampled_from(["qwen2", "mistral"]),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_identical_to_greedy(prompt, window, ngram, guesses, max_new_tokens, family):
    model = _cached_model(family)
    ids = torch.tensor([prompt])
    expected = reference_greedy(model, ids, max_new_tokens)
    config = LookaheadConfig(window=window, ngram=ngram, guesses=guesses)
    assert torch.equal(generate(model, ids, max_new_tokens=max_new_tokens, config=config).sequences, expected)


_MODELS: dict[str, torch.nn.Module] = {}


def _cached_model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = make_tiny_model(family)
    return _MODELS[family]


def test_default_config_follows_the_device(llama_tiny):
    from lookahead.generation import CPU_CONFIG, default_config

    assert default_config(llama_tiny) == CPU_CONFIG
    prompt = random_prompt(20, 19)
    implicit = generate(llama_tiny, prompt, max_new_tokens=30)
    explicit = generate(llama_tiny, prompt, max_new_tokens=30, config=CPU_CONFIG)
    assert implicit.stats.accepted_per_step == explicit.stats.accepted_per_step


@pytest.mark.parametrize("packed_linear", [True, False])
def test_packed_linear_path_is_exact_and_leaves_the_model_as_it_was(tiny_model, packed_linear):
    prompt = random_prompt(25, 23)
    expected = reference_greedy(tiny_model, prompt, 40)
    out = generate(tiny_model, prompt, max_new_tokens=40, config=LookaheadConfig(), packed_linear=packed_linear)
    assert torch.equal(out.sequences, expected)
    linears = [m for m in tiny_model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" not in vars(m) for m in linears)


def test_packed_linear_refused_where_unsupported():
    model = make_tiny_model("llama").to(torch.float16)
    with pytest.raises(ValueError, match="packed_linear=True needs a float32 or bfloat16 model on CPU"):
        generate(model, [5, 6, 7], packed_linear=True)

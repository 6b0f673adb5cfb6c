"""Exactness on the real default model (SmolLM2-135M-Instruct, fp32) over chat, code and math prompts."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_greedy

from lookahead import LookaheadConfig, generate
from lookahead.config import AUTO_CONFIG
from lookahead.prompts import encode_prompt
from lookahead.workloads import load_workload

pytestmark = pytest.mark.slow

# The automatic config, and a fixed one with every part (window, pool, suffix and recycle sources), each on
# every other prompt of each workload (so each meets chat, code and math); the fixed default W5 N4 G5 runs in
# the tiny models' fuzz and, checked identical, in the bench test on this model.
CONFIGS = {"auto": AUTO_CONFIG,
           "W4N5G2S16R4": LookaheadConfig(window=4, ngram=5, guesses=2, suffix=16, recycle=4)}
WORKLOADS = {name: load_workload(name)[::step] for name, step in (("mt_bench", 10), ("humaneval", 27), ("gsm8k", 200))}
# Most of these tests' time is transformers' own `generate` computing the references (cached on disk).
NEW_TOKENS = 96
CASES = [(workload, prompt, list(CONFIGS)[i % 2])
         for workload, prompts in WORKLOADS.items() for i, prompt in enumerate(prompts)]


def test_prompt_set_covers_chat_code_and_math_with_each_config():
    assert len(CASES) >= 20
    assert {(workload, config) for workload, _, config in CASES} == {(w, c) for w in WORKLOADS for c in CONFIGS}


@pytest.mark.parametrize("prompt, config", [pytest.param(p, c, id=f"{p.id}-{c}") for _, p, c in CASES])
def test_identical_to_greedy_generate(default_model, prompt, config):
    model, tokenizer = default_model
    input_ids = encode_prompt(tokenizer, prompt.turns[0])
    out = generate(model, input_ids, max_new_tokens=NEW_TOKENS, config=CONFIGS[config])
    assert torch.equal(out.sequences, reference_greedy(model, input_ids, NEW_TOKENS)), f"{config} diverged on {prompt.id}"


def test_lookahead_takes_fewer_steps_than_tokens_on_code(default_model):
    model, tokenizer = default_model
    input_ids = encode_prompt(tokenizer, load_workload("humaneval")[0].turns[0])
    out = generate(model, input_ids, max_new_tokens=128)
    assert out.stats.tokens_per_step > 1.2


def test_the_recycle_source_drafts_tokens_the_model_accepts(default_model):
    """Unbudgeted (every draft fed), so the test does not hang on this machine's cost curve."""
    model, tokenizer = default_model
    input_ids = encode_prompt(tokenizer, load_workload("mt_bench")[3].turns[0])
    out = generate(model, input_ids, max_new_tokens=96, config=LookaheadConfig(window=0, guesses=2, recycle=4))
    assert torch.equal(out.sequences, reference_greedy(model, input_ids, 96))
    assert out.stats.accepted_by_source.get("recycle", 0) > 0


def test_a_shared_corpus_drafts_the_second_request_from_the_first(default_model):
    """Two requests over the same article: the second drafts from the first one's prompt and output, and
    both stay identical to greedy generate."""
    from lookahead import Corpus

    model, tokenizer = default_model
    article = next(p for p in load_workload("spec_bench") if p.category == "summarization").turns[0]
    article = article.removeprefix("Summarize: ")[:1500]
    corpus = Corpus()
    outputs = []
    for instruction in ("Summarize this article in two sentences.", "Give a short summary of the article."):
        input_ids = encode_prompt(tokenizer, f"{instruction}\n\n{article}")
        out = generate(model, input_ids, max_new_tokens=96, corpus=corpus)
        assert torch.equal(out.sequences, reference_greedy(model, input_ids, 96))
        outputs.append(out)
    assert len(corpus) == 2
    assert "corpus" not in outputs[0].stats.accepted_by_source  # nothing was in the corpus yet
    assert outputs[1].stats.accepted_by_source.get("corpus", 0) > 0


def assert_equal_or_near_tie(model, got: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """Token-identical, or else diverging where the model's top two logits (on the shared prefix) are within
    1e-3, where batched float32 arithmetic may order them differently; the gap is reported either way."""
    length = min(got.numel(), expected.numel())
    differs = torch.nonzero(got[:length] != expected[:length]).flatten()
    if differs.numel() == 0:
        assert got.numel() == expected.numel(), f"{label}: lengths differ"
        return
    first = int(differs[0])
    with torch.inference_mode():
        logits = model(expected[:first].view(1, -1)).logits[0, -1].double()
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    print(f"{label}: diverges at position {first}, logit gap {gap:.2e}")
    assert gap < 1e-3, f"{label}: diverges at position {first} where the logit gap is {gap:.2e}, not a near-tie"


def test_a_batch_of_different_prompts_is_each_ones_greedy_output(default_model):
    model, tokenizer = default_model
    chosen = [prompt for _, prompt, _ in CASES][::3][:8]
    prompts = [encode_prompt(tokenizer, p.turns[0])[0] for p in chosen]
    assert len({p.numel() for p in prompts}) > 4  # prompts of different lengths
    out = generate(model, prompts, max_new_tokens=NEW_TOKENS)  # the exactness cases' references serve
    pad = model.generation_config.pad_token_id
    for row, prompt, stats, workload in zip(out.sequences, prompts, out.stats.per_sequence, chosen):
        expected = reference_greedy(model, prompt.view(1, -1), NEW_TOKENS)[0]
        assert_equal_or_near_tie(model, row[: prompt.numel() + stats.new_tokens], expected, workload.id)
        assert bool((row[prompt.numel() + stats.new_tokens :] == pad).all())

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

CONFIGS = [AUTO_CONFIG, LookaheadConfig(), LookaheadConfig(window=4, ngram=5, guesses=2, suffix=16)]
PROMPTS = load_workload("mt_bench")[::10] + load_workload("humaneval")[::27] + load_workload("gsm8k")[::200]


def test_prompt_set_covers_chat_code_and_math():
    assert len(PROMPTS) >= 20
    assert {"humaneval", "gsm8k"} <= {p.category for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: p.id)
def test_identical_to_greedy_generate(default_model, prompt):
    model, tokenizer = default_model
    input_ids = encode_prompt(tokenizer, prompt.turns[0])
    expected = reference_greedy(model, input_ids, 128)
    for config in CONFIGS:
        out = generate(model, input_ids, max_new_tokens=128, config=config)
        assert torch.equal(out.sequences, expected), f"{config} diverged on {prompt.id}"


def test_lookahead_takes_fewer_steps_than_tokens_on_code(default_model):
    model, tokenizer = default_model
    input_ids = encode_prompt(tokenizer, load_workload("humaneval")[0].turns[0])
    out = generate(model, input_ids, max_new_tokens=128)
    assert out.stats.tokens_per_step > 1.2


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

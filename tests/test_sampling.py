"""Sampling with lookahead keeps the model's output distribution: statistical tests against plain
`model.generate(do_sample=True)`, with a negative control that a wrong acceptance rule fails."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import peaked, reference_greedy
from scipy.stats import chi2_contingency, chisquare
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import lookahead.sampling
from lookahead import LookaheadConfig, generate
from lookahead.core import verify
from lookahead.core.verify import _mix, gumbel_noise, sample_choice

# The suffix and recycle sources: ragged trees.
CONFIG = LookaheadConfig(window=3, ngram=3, guesses=4, suffix=8, recycle=2)


def wrong_choice(scores, candidates, noise):
    """A plausible but wrong rule: accept a candidate when it is the argmax, else sample."""
    best = int(scores.argmax())
    for token, node in candidates:
        if token == best:
            return token, node
    return sample_choice(scores, candidates, noise)


def test_sample_choice_emits_exactly_the_distribution():
    """Over seeds and positions, the token drawn has distribution softmax(scores); the wrong rule does not."""
    probs = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    candidates = [(1, 10), (3, 11), (0, 12)]
    draws = 20000

    def frequencies(rule):
        counts = Counter(rule(probs.log(), candidates, gumbel_noise(seed, 0, 5))[0] for seed in range(draws))
        return [counts[token] for token in range(5)]

    assert chisquare(frequencies(sample_choice), (probs * draws).tolist()).pvalue > 1e-3
    assert chisquare(frequencies(wrong_choice), (probs * draws).tolist()).pvalue < 1e-6  # negative control


def test_sample_choice_returns_the_node_of_an_accepted_candidate():
    scores = torch.tensor([-1e9, 0.0, -1e9])  # all mass on token 1
    noise = gumbel_noise(3, 0, 3)
    assert sample_choice(scores, [(1, 7)], noise) == (1, 7)
    assert sample_choice(scores, [(2, 8)], noise) == (1, None)


def test_a_uniform_draw_of_exactly_zero_leaves_its_token_possible(llama_tiny, monkeypatch):
    """An exact 0 among the uniforms (token 55's at every position here) had given that token the noise -inf. Forced
    there (the last position, forced_eos_token_id=55), token 55 was the only one with a finite score, every sum was
    -inf, and token 0, which generate gives probability 0, was drawn (float32 uniforms, a seed search of a review)."""
    uniforms = verify._uniforms

    def zero_at_55(key: int, size: int, device: torch.device) -> torch.Tensor:
        drawn = uniforms(key, size, device)
        drawn[55] = 0.0
        return drawn

    monkeypatch.setattr(verify, "_uniforms", zero_at_55)
    assert bool(gumbel_noise(3, 11, 128).isfinite().all())
    out = generate(llama_tiny, [5, 6, 7, 8, 9, 5, 6, 7], max_new_tokens=4, do_sample=True, forced_eos_token_id=55,
                   eos_token_id=[], seed=171708, config=LookaheadConfig(window=3, ngram=3, guesses=3))
    assert out.sequences[0, -1].item() == 55


def test_the_noise_reaches_the_far_tail():
    """Uniforms on float32's 2**-24 grid capped the noise at 16.6: a token more than ~19 below the best score was never
    drawn, and one 17 below at 0.45 of its probability (a review: 0 draws of 17 expected at -19.5, p=4e-8). float64
    uniforms reach 36.7 (a token 40 below the best: probability 4e-18)."""
    uniform = verify._uniforms(_mix(3, 11), 100_000, torch.device("cpu"))
    assert uniform.dtype == torch.float64 and bool(((uniform * 2**24) % 1 != 0).any())  # finer than float32's grid
    assert float(verify._gumbel(torch.tensor([1 - 2**-53], dtype=torch.float64))) > 36.7
    noise = gumbel_noise(3, 11, 100_000)
    assert noise.dtype == torch.float64 and torch.equal(noise, verify._gumbel(uniform))


def test_the_noise_of_one_sequence_takes_its_whole_64_bit_key():
    """torch's CPU generator keeps a seed's low 32 bits: these two positions of seed 0, whose keys share them, drew the
    same noise (one 32k-token sequence in ten had two such positions, their tokens correlated)."""
    assert _mix(0, 85077) & 0xFFFFFFFF == _mix(0, 177925) & 0xFFFFFFFF
    assert not torch.equal(gumbel_noise(0, 85077, 1000), gumbel_noise(0, 177925, 1000))


@pytest.fixture(scope="module")
def small_vocab_model():
    """Small vocabulary, peaked but not deterministic distributions: guesses often hit."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return peaked(LlamaForCausalLM(config), 0.25)


PROMPT = torch.tensor([[2, 3, 4, 5, 2, 3, 4, 6, 2, 3, 7, 8, 9, 2, 3]])
SAMPLES = 1500
NEW_TOKENS = 3


def reference_samples(model, **options) -> list[tuple[int, ...]]:
    torch.manual_seed(123)
    with torch.inference_mode():
        out = model.generate(PROMPT.repeat(SAMPLES, 1), do_sample=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0, eos_token_id=None, **options)
    return [tuple(row) for row in out[:, PROMPT.shape[1]:].tolist()]


def lookahead_samples(model, batch: int = 100, **options) -> tuple[list[tuple[int, ...]], int]:
    """SAMPLES sequences drawn `batch` at a time (each a request of its own in one engine, as a server
    decodes them); the tokens accepted from drafts."""
    generator = torch.Generator().manual_seed(7)
    samples, accepted = [], 0
    for _ in range(SAMPLES // batch):
        out = generate(model, PROMPT.repeat(batch, 1), max_new_tokens=NEW_TOKENS, config=CONFIG, eos_token_id=[],
                       do_sample=True, generator=generator, **options)
        samples += [tuple(row) for row in out.sequences[:, PROMPT.shape[1]:].tolist()]
        accepted += sum(stats.new_tokens - stats.steps for stats in out.stats.per_sequence)
    return samples, accepted


def same_distribution_pvalue(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """Chi-square test of homogeneity on whole sequences (rare ones pooled into one bin)."""
    counts_a, counts_b = Counter(a), Counter(b)
    common = [key for key in set(counts_a) | set(counts_b) if counts_a[key] + counts_b[key] >= 10]
    table = [[counts_a[k] for k in common], [counts_b[k] for k in common]]
    rest = [len(a) - sum(table[0]), len(b) - sum(table[1])]
    if sum(rest) >= 10:
        table[0].append(rest[0])
        table[1].append(rest[1])
    return chi2_contingency(table).pvalue


OPTION_SETS = [
    {},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 4},
    {"top_p": 0.8},
    {"temperature": 0.9, "top_k": 6, "top_p": 0.9, "repetition_penalty": 1.4},
]


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_sequence_distribution_matches_generate(small_vocab_model, options):
    expected = reference_samples(small_vocab_model, **options)
    samples, accepted = lookahead_samples(small_vocab_model, **options)
    assert accepted > SAMPLES // 10  # the acceptance path really runs
    assert same_distribution_pvalue(samples, expected) > 1e-3


def test_user_logits_processor_sees_each_verified_prefix(small_vocab_model):
    """MinLength bans EOS by the length of the sequence before each position: right only if every verified
    node is scored with its own prefix. EOS is token 1 here; the ban lifts after the second new token."""
    processor = [MinLengthLogitsProcessor(PROMPT.shape[1] + 2, eos_token_id=1)]
    expected = reference_samples(small_vocab_model, logits_processor=processor)
    samples, _ = lookahead_samples(small_vocab_model, logits_processor=processor)
    assert all(1 not in s[:2] for s in samples)
    assert same_distribution_pvalue(samples, expected) > 1e-3


def test_negative_control_a_wrong_rule_fails_the_same_test(small_vocab_model, monkeypatch):
    monkeypatch.setattr(lookahead.sampling, "sample_choice", wrong_choice)
    expected = reference_samples(small_vocab_model)
    samples, _ = lookahead_samples(small_vocab_model)
    assert same_distribution_pvalue(samples, expected) < 1e-6


def test_same_seed_same_output_and_temperature_zero_is_greedy(small_vocab_model):
    def run(seed: int) -> list[int]:
        out = generate(small_vocab_model, PROMPT, max_new_tokens=20, do_sample=True, config=CONFIG,
                       generator=torch.Generator().manual_seed(seed))
        return out.sequences[0].tolist()

    assert run(5) == run(5)
    assert len({tuple(run(seed)) for seed in range(6)}) > 1
    greedy = reference_greedy(small_vocab_model, PROMPT, 20)
    assert torch.equal(generate(small_vocab_model, PROMPT, max_new_tokens=20, do_sample=True, temperature=0).sequences, greedy)


def test_a_sampling_field_of_the_generation_config_is_not_warned_about_when_sampling(small_vocab_model, monkeypatch):
    """min_p with do_sample=True: transformers warned that min_p "may be ignored" (our do_sample was not in the
    config it checked), though it is applied."""
    import transformers.generation.configuration_utils as configuration

    warned = []
    monkeypatch.setattr(configuration.logger, "warning_once", warned.append)
    generate(small_vocab_model, PROMPT, max_new_tokens=2, do_sample=True, min_p=0.1,
             generator=torch.Generator().manual_seed(0))
    assert warned == []
    generate(small_vocab_model, PROMPT, max_new_tokens=2, min_p=0.1)  # greedy: it is ignored, as generate warns
    assert len(warned) == 1 and "min_p" in warned[0]


def test_greedy_with_repetition_penalty_equals_generate(small_vocab_model):
    with torch.inference_mode():
        expected = small_vocab_model.generate(PROMPT, do_sample=False, max_new_tokens=30, repetition_penalty=1.5,
                                              pad_token_id=0)
    out = generate(small_vocab_model, PROMPT, max_new_tokens=30, config=CONFIG, repetition_penalty=1.5)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"temperature": -0.5}, "temperature must be a number >= 0"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
        ({"do_sample": "yes"}, "do_sample must be a bool"),
        ({"generator": 3}, "generator must be a torch.Generator"),
    ],
)
def test_bad_sampling_options(small_vocab_model, options, message):
    with pytest.raises(ValueError, match=message):
        generate(small_vocab_model, PROMPT, **{"do_sample": True, **options})


def first_two_tokens_distribution(model, prompt: torch.Tensor, warpers: LogitsProcessorList) -> dict[tuple, float]:
    """The exact distribution of `model.generate(do_sample=True)`'s first two tokens under `warpers`:
    the model's logits, warped by transformers' own processors, at the prompt and after each first token."""
    with torch.inference_mode():
        first = warpers(prompt, model(prompt, logits_to_keep=1).logits[:, -1]).softmax(-1)[0]
        tokens = first.nonzero()[:, 0]
        extended = torch.cat([prompt.repeat(len(tokens), 1), tokens[:, None]], dim=1)
        second = warpers(extended, model(extended, logits_to_keep=1).logits[:, -1]).softmax(-1)
    joint = first[tokens, None] * second  # [first tokens, vocabulary]; read as lists (a tensor per outcome: 6 s)
    firsts = tokens.tolist()
    return {(firsts[i], b): p for (i, b), p in zip(joint.nonzero().tolist(), joint[joint > 0].tolist())}


def fit_pvalue(samples: list[tuple], expected: dict[tuple, float]) -> float:
    """Chi-square goodness of fit of `samples` to `expected` probabilities; outcomes expected fewer than 5
    times pooled into one bin (with every outcome outside `expected`)."""
    counts, n = Counter(samples), len(samples)
    common = [key for key, p in expected.items() if p * n >= 5]
    observed = [counts[key] for key in common] + [n - sum(counts[key] for key in common)]
    predicted = [expected[key] * n for key in common] + [n * (1 - sum(expected[key] for key in common))]
    return chisquare(observed, predicted).pvalue


@pytest.mark.slow
def test_first_tokens_distribution_on_the_default_model(default_model):
    """Lookahead sampling on the real model, against the exact distribution that transformers' sampling
    draws from (the model's logits through its own warpers). The prompt repeats itself, so that drafts from
    it are often accepted: about 40% of the second tokens come from an accepted draft. A fixed config feeds
    its drafts at every step: the automatic budget, having learnt in the first calls how often such drafts
    are accepted, rightly stops feeding them to a batch of 20 on a CPU."""
    model, tokenizer = default_model
    prompt = tokenizer("Roses are red, violets are blue. Roses are red, violets are blue. Roses are",
                       return_tensors="pt").input_ids
    expected = first_two_tokens_distribution(
        model, prompt, LogitsProcessorList([TemperatureLogitsWarper(1.2), TopKLogitsWarper(20)]))
    generator = torch.Generator().manual_seed(1)
    batch, draws, samples, accepted = 20, 300, [], 0  # batches of 20: 3.6x cheaper per draw than one by one
    for _ in range(draws // batch):
        out = generate(model, prompt.repeat(batch, 1), max_new_tokens=2, do_sample=True, top_k=20,
                       temperature=1.2, generator=generator, config=LookaheadConfig(window=0, guesses=5))
        samples += [tuple(row) for row in out.sequences[:, prompt.shape[1]:].tolist()]
        accepted += sum(s.new_tokens - s.steps for s in out.stats.per_sequence)
    assert accepted > draws // 5  # the acceptance path really runs
    assert fit_pvalue(samples, expected) > 1e-3


def test_a_temperature_that_overflows_the_logits_is_an_error_as_in_generate(llama_tiny):
    """logits / 1e-45 are +-inf: the draw had taken the first token of positive logit, a reply of garbage with no
    word said; transformers' generate raises there (its multinomial refuses inf)."""
    with pytest.raises(RuntimeError):
        llama_tiny.generate(torch.tensor([[5, 6, 7]]), do_sample=True, temperature=1e-45, max_new_tokens=2)
    with pytest.raises(ValueError, match="the processed scores are not finite .* a temperature this small overflows"):
        generate(llama_tiny, [5, 6, 7], do_sample=True, temperature=1e-45, max_new_tokens=2)

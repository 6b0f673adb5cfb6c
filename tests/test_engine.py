"""The engine: many sequences in one forward, requests joining and leaving, each one exactly what it
would be alone (transformers' greedy `generate` of its own prompt)."""

from __future__ import annotations

import time
import weakref
from collections import Counter

import pytest
import torch
from conftest import model_fingerprint, peaked, reference_greedy
from test_exact_tiny import ForwardRecorder, random_prompt
from test_sampling import PROMPT, reference_samples, same_distribution_pvalue, small_vocab_model  # noqa: F401

from lookahead import LookaheadConfig, generate
from lookahead.config import PLAIN_CONFIG
from lookahead.core.drafter import AcceptanceStats
from lookahead.core.drafts import Draft
from lookahead.engine import Engine, RequestParams, acceptance_stats

STOPS = [2, 17]  # token 17 is common enough in the tiny models' outputs to stop some sequences mid-batch
BATCH_CONFIGS = [None, LookaheadConfig(window=3, ngram=3, guesses=3), LookaheadConfig(window=0, guesses=0)]


def prompts_of(lengths, seed=0):
    return [random_prompt(length, seed + length)[0] for length in lengths]


def expected_row(model, prompt, max_new_tokens, pad, stops=STOPS):
    """transformers' greedy output of the prompt alone, right-padded to prompt + max_new_tokens."""
    reference = reference_greedy(model, prompt.view(1, -1), max_new_tokens, eos_token_id=stops)[0]
    return torch.cat([reference, torch.full((prompt.numel() + max_new_tokens - reference.numel(),), pad)])


@pytest.mark.parametrize("config", BATCH_CONFIGS, ids=lambda c: c.label if c else "auto")
def test_every_sequence_of_a_batch_is_its_own_greedy_output(tiny_model, config):
    prompts = prompts_of([30, 5, 1, 60])
    # A stop token that the last prompt's output reaches early: that sequence stops mid-batch.
    stops = [reference_greedy(tiny_model, prompts[3].view(1, -1), 40, eos_token_id=[])[0, 60 + 11].item()]
    out = generate(tiny_model, prompts, max_new_tokens=40, config=config, eos_token_id=stops)
    lengths = [p.numel() + s.new_tokens for p, s in zip(prompts, out.stats.per_sequence)]
    assert out.sequences.shape == (4, max(lengths))
    for row, prompt in zip(out.sequences, prompts):
        pad = tiny_model.generation_config.pad_token_id
        expected = expected_row(tiny_model, prompt, 40, pad, stops)
        length = min(row.numel(), expected.numel())
        assert torch.equal(row[:length], expected[:length])
        assert bool((row[length:] == pad).all()) and bool((expected[length:] == pad).all())
    new_tokens = [s.new_tokens for s in out.stats.per_sequence]
    assert new_tokens[3] <= 12 and max(new_tokens) > new_tokens[3]  # one stopped mid-batch, others went on
    assert out.stats.new_tokens == sum(new_tokens)
    # a step cut short by the stop token or the length counts the tokens kept, not those verified
    assert [sum(s.accepted_per_step) for s in out.stats.per_sequence] == new_tokens
    together = Counter()  # the batch's accepted guesses by source: every sequence's
    for s in out.stats.per_sequence:
        together.update(s.accepted_by_source)
    assert {k: v for k, v in out.stats.accepted_by_source.items() if v} == {k: v for k, v in together.items() if v}
    # each row's forwards are those it was in (they had read 0.0): shared, so none above the call's
    forwards = [s.forward_seconds for s in out.stats.per_sequence]
    assert 0 < min(forwards) and max(forwards) <= out.stats.forward_seconds and forwards[3] < max(forwards)


def test_acceptance_stats_outlive_a_call_and_never_change_its_output(llama_tiny, monkeypatch):
    """Every engine over a model learns into the same statistics, so a call's first steps are sized by what
    the model accepted before; whatever they hold (here: every source trusted to any depth, then the
    statistics of the call before), the output is transformers' greedy output. Sampled calls learn apart."""
    trusting = AcceptanceStats()
    for source in ("suffix", "pool", "recycle"):
        for context in (1, 2, 4, 8, 16):
            for _ in range(50):
                trusting.record([Draft(tuple(range(32)), source, context=context)], list(range(32)))
    monkeypatch.setattr("lookahead.engine._ACCEPTANCE", weakref.WeakKeyDictionary({llama_tiny: {False: trusting}}))
    assert acceptance_stats(llama_tiny) is trusting
    prompt = torch.cat([random_prompt(12, 7)[0]] * 3)  # repeats: the suffix source drafts from its first copy
    expected = expected_row(llama_tiny, prompt, 40, 0)
    for _ in range(2):
        out = generate(llama_tiny, prompt, max_new_tokens=40, eos_token_id=STOPS)
        assert torch.equal(out.sequences[0], expected[: out.sequences.shape[1]])
    assert acceptance_stats(llama_tiny) is trusting
    assert trusting.calibration != 1.0  # the calls' steps were learnt: primed by `record` alone, it was 1
    learnt = trusting.calibration
    sampled = acceptance_stats(llama_tiny, sampling=True)
    assert sampled is not trusting and sampled.calibration == 1.0
    generate(llama_tiny, prompt, max_new_tokens=40, eos_token_id=STOPS, do_sample=True,
             generator=torch.Generator().manual_seed(0))
    assert sampled.calibration != 1.0 and trusting.calibration == learnt


def test_left_padded_batch_with_attention_mask(llama_tiny):
    prompts = prompts_of([12, 4, 9], seed=3)
    width = max(p.numel() for p in prompts)
    pad = llama_tiny.generation_config.pad_token_id
    input_ids = torch.stack([torch.cat([torch.full((width - p.numel(),), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.numel()), torch.ones(p.numel())]) for p in prompts]).long()
    Engine(llama_tiny, max_batch=3)  # the cost curves (their own forwards) are measured once per batch size
    with ForwardRecorder(llama_tiny) as recorder:
        out = generate(llama_tiny, input_ids, attention_mask=mask, max_new_tokens=24, eos_token_id=STOPS)
    assert torch.equal(out.sequences[:, :width], input_ids)  # the input as given, then the new tokens
    for b, prompt in enumerate(prompts):
        new = out.sequences[b, width:]
        expected = expected_row(llama_tiny, prompt, 24, pad)[prompt.numel():]
        assert torch.equal(new, expected[: new.numel()])
    # One forward per step for the whole batch, after one forward of the three prompts.
    assert len(recorder.sizes) == 1 + out.stats.steps
    assert out.stats.tokens_fed == sum(recorder.sizes[1:])


def test_requests_join_wait_abort_and_leave_between_steps(llama_tiny):
    """Three slots, five requests: two start, three join later (one waits for a slot), one is aborted;
    a long prompt joins in chunks while the others keep decoding."""
    engine = Engine(llama_tiny, max_batch=3, max_length=200, prefill_chunk=16)
    prompts = prompts_of([7, 20, 90, 3, 11], seed=5)
    lengths = [30, 12, 25, 40, 30]
    params = [RequestParams(max_new_tokens=n, eos_token_id=STOPS) for n in lengths]
    outputs: dict[int, list[int]] = {}
    finished: set[int] = set()

    def step() -> list[int]:
        """One step; the ids that got tokens."""
        moved = []
        for output in engine.step():
            assert output.request_id not in finished
            outputs.setdefault(output.request_id, []).extend(output.tokens)
            moved.append(output.request_id)
            if output.finished:
                finished.add(output.request_id)
                assert output.stats.new_tokens == len(outputs[output.request_id])
        return moved

    first = [engine.add_request(prompts[i], params[i]) for i in (0, 1)]
    for _ in range(3):
        step()
    late = [engine.add_request(prompts[i], params[i]) for i in (2, 3, 4)]  # the 90-token prompt: 6 chunks
    while late[0] not in outputs:  # while the long prompt is fed chunk by chunk, the others decode
        moved = step()
        assert set(first) - finished <= set(moved)
    assert engine.abort(late[1]) and not engine.abort(late[1])  # it was still waiting for a slot
    while engine.has_unfinished():
        step()
    ids = dict(zip(first + late, range(5)))
    assert set(outputs) == set(ids) - {late[1]}
    for request, tokens in outputs.items():
        index = ids[request]
        prompt = prompts[index]
        expected = expected_row(llama_tiny, prompt, lengths[index], -1)[prompt.numel():]
        assert tokens == [t for t in expected.tolist() if t != -1]
    assert engine.store.lengths == [0, 0, 0]  # every slot is free again


def test_aborting_a_running_request_frees_its_slot_for_a_waiting_one(llama_tiny):
    engine = Engine(llama_tiny, max_batch=1, max_length=100)
    running = engine.add_request(prompts_of([10])[0], RequestParams(max_new_tokens=50, eos_token_id=[]))
    waiting = engine.add_request(prompts_of([6])[0], RequestParams(max_new_tokens=8, eos_token_id=[]))
    assert {o.request_id for o in engine.step()} == {running}
    assert engine.abort(running)
    tokens = []
    while engine.has_unfinished():
        outputs = engine.step()
        assert {o.request_id for o in outputs} <= {waiting}
        tokens += [t for o in outputs for t in o.tokens]
    assert tokens == reference_greedy(llama_tiny, prompts_of([6])[0].view(1, -1), 8, eos_token_id=[])[0, 6:].tolist()


def test_a_request_samples_where_the_generation_config_asks_unless_it_says_otherwise(small_vocab_model):
    """do_sample unset is the generation config's (the request's, else the model's), as in `generate`: it was
    False, so an engine request decoded greedily where `generate` sampled."""
    import copy

    from transformers import GenerationConfig

    model = copy.copy(small_vocab_model)
    model.generation_config = GenerationConfig(do_sample=True, eos_token_id=[])

    def tokens(params: RequestParams) -> list[int]:
        engine = Engine(model, max_batch=1, max_length=80)
        engine.add_request(PROMPT[0], params)
        return [t for _ in iter(engine.has_unfinished, False) for o in engine.step() for t in o.tokens]

    sampled = generate(model, PROMPT[0], max_new_tokens=30, generator=torch.Generator().manual_seed(11))
    greedy = generate(model, PROMPT[0], max_new_tokens=30, do_sample=False)
    assert sampled.sequences.tolist() != greedy.sequences.tolist()
    new = slice(PROMPT[0].numel(), None)
    assert tokens(RequestParams(max_new_tokens=30, seed=11)) == sampled.sequences[0, new].tolist()
    assert tokens(RequestParams(max_new_tokens=30, seed=11, do_sample=False)) == greedy.sequences[0, new].tolist()
    own_config = RequestParams(max_new_tokens=30, seed=11, generation_config=GenerationConfig(top_k=4))
    assert tokens(own_config) != greedy.sequences[0, new].tolist()  # unset in its own config: the model's


def test_a_seeded_request_samples_the_same_whatever_else_is_in_the_batch(small_vocab_model):
    """The automatic config sizes each step's tree by the batch, so the guesses differ with the company a
    request keeps; its sampled tokens must not: they equal those of plain decoding with the same seed."""
    sampled = RequestParams(max_new_tokens=30, do_sample=True, seed=11, eos_token_id=[])

    def run(params: RequestParams, others: list[tuple[torch.Tensor, RequestParams]], join_after: int) -> list[int]:
        engine = Engine(small_vocab_model, max_batch=4, max_length=80)
        for prompt, other in others:
            engine.add_request(prompt, other)
        for _ in range(join_after):
            engine.step()
        request = engine.add_request(PROMPT[0], params)
        tokens, steps = [], 0
        while engine.has_unfinished():
            outputs = engine.step()
            tokens += [t for o in outputs if o.request_id == request for t in o.tokens]
            steps += any(o.request_id == request for o in outputs)
        run.steps = steps
        return tokens

    alone = run(sampled, [], 0)
    assert run.steps < 30  # guesses were accepted: the tree mattered
    others = [(torch.tensor([3, 4, 5, 6, 7]), RequestParams(max_new_tokens=20, do_sample=True, seed=1)),
              (torch.tensor([2, 2, 9]), RequestParams(max_new_tokens=40)),
              (torch.tensor([5] * 12), RequestParams(max_new_tokens=9, do_sample=True, temperature=0.5, seed=2))]
    assert run(sampled, others, 0) == alone
    assert run(sampled, others, 3) == alone
    plain = RequestParams(**{**sampled.__dict__, "config": LookaheadConfig(window=0, guesses=0)})
    assert run(plain, [], 0) == alone and run.steps == 30  # one token a step, the same tokens
    assert run(RequestParams(**{**sampled.__dict__, "seed": 12}), [], 0) != alone  # the seed matters


def test_every_bit_of_a_request_seed_counts_and_generate_takes_the_same_seed(small_vocab_model):
    """torch's CPU generator keeps a seed's low 32 bits: seeded through it, requests whose seeds were 2**32 apart
    sampled the same tokens. Each seed now samples its own; `generate(seed=...)` samples what the engine does,
    and below 2**32 both sample what a generator so seeded does."""
    def engine_tokens(seed: int) -> list[int]:
        engine = Engine(small_vocab_model, max_batch=1, max_length=80)
        engine.add_request(PROMPT[0], RequestParams(max_new_tokens=30, do_sample=True, seed=seed, eos_token_id=[]))
        return [t for _ in iter(engine.has_unfinished, False) for o in engine.step() for t in o.tokens]

    def generate_tokens(**seeding) -> list[int]:
        out = generate(small_vocab_model, PROMPT, max_new_tokens=30, do_sample=True, eos_token_id=[], **seeding)
        return out.sequences[0, PROMPT.shape[1]:].tolist()

    seeds = [5, 5 + 2**32, 5 - 2**32, 5 + 2**63, -5]
    samples = [engine_tokens(seed) for seed in seeds]
    assert len({tuple(tokens) for tokens in samples}) == len(seeds)
    assert [generate_tokens(seed=seed) for seed in seeds] == samples
    assert generate_tokens(generator=torch.Generator().manual_seed(5)) == samples[0]
    assert engine_tokens(2**64 - 5) == samples[-1]  # the same 64 bits as -5, as torch reads a negative seed
    with pytest.raises(ValueError, match="seed seeds one prompt"):
        generate(small_vocab_model, PROMPT.repeat(2, 1), max_new_tokens=3, do_sample=True, seed=5)


def test_sampling_inside_a_batch_keeps_the_distribution(small_vocab_model):
    """The chi-square test of test_sampling, for requests decoded in batches with other prompts."""
    expected = reference_samples(small_vocab_model)
    generator = torch.Generator().manual_seed(7)
    config = LookaheadConfig(window=3, ngram=3, guesses=4, suffix=8)
    others = [torch.tensor([3, 4, 5, 6, 7]), torch.tensor([2, 2, 9, 8]), torch.tensor([5] * 12)]
    samples, accepted = [], 0
    while len(samples) < len(expected):
        out = generate(small_vocab_model, [PROMPT[0]] * 50 + others, max_new_tokens=3, config=config, eos_token_id=[],
                       do_sample=True, generator=generator)
        samples += [tuple(row[PROMPT.shape[1]:].tolist()) for row in out.sequences[:50]]
        accepted += sum(stats.new_tokens - stats.steps for stats in out.stats.per_sequence[:50])
    assert same_distribution_pvalue(samples[: len(expected)], expected) > 1e-3
    assert accepted > len(expected) // 20  # drafts were accepted: the test can tell a biased acceptance path


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m, engine: engine.add_request([5] * 60, RequestParams(max_new_tokens=10)),
         ValueError, r"prompt \(60 tokens\) \+ max_new_tokens \(10\) exceeds the engine's max_length of 64"),
        (lambda m, engine: Engine(m, max_batch=10**9), MemoryError, "max_batch=1000000000 .* lower max_batch or max_length"),
        (lambda m, engine: Engine(m, max_batch=0), ValueError, "max_batch must be an integer >= 1, got 0"),
        (lambda m, engine: Engine(m, max_length=10**6), ValueError, r"max_length \(1000000\) exceeds the model's context of 512"),
        (lambda m, engine: engine.add_request([5], {"max_new_tokens": 3}), TypeError, "params must be a RequestParams"),
        (lambda m, engine: engine.add_request([5], RequestParams(max_new_tokens=5, seed=1, generator=torch.Generator())), ValueError,
         "a request seed or a generator, not both"),
        (lambda m, engine: generate(m, torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]])),
         ValueError, "attention_mask must pad on the left"),
        (lambda m, engine: generate(m, [[1, 2], [3]], attention_mask=torch.ones(2, 2)), ValueError,
         "attention_mask goes with a .B, n. tensor"),
        (lambda m, engine: generate(m, [[1, 2], [3, 500]]), ValueError, "token id 500, outside the model's vocabulary"),
        # These two had raised "'function' object is not iterable" and "'NoneType' object is not iterable".
        (lambda m, engine: engine.add_request([5], RequestParams(max_new_tokens=4, logits_processor=lambda ids, scores: scores)),
         TypeError, "logits_processor must be a list of transformers LogitsProcessor .*got function"),
        (lambda m, engine: engine.add_request([5], RequestParams(max_new_tokens=4, proposers=None)), TypeError,
         r"proposers must be a list of draft sources .*got NoneType"),
        (lambda m, engine: engine.add_request([5], RequestParams(max_new_tokens=4), padding=[1.5]), ValueError,
         "padding must hold integer token ids, got dtype torch.float32"),
        (lambda m, engine: engine.add_request([5], RequestParams(max_new_tokens=4), padding=[[1], [2]]), ValueError,
         r"padding must be one row \(\[n\] or \[1, n\]\), got shape \[2, 1\]"),
    ],
    ids=["too-long", "memory", "max-batch", "max-length", "params", "seed-and-generator", "right-padding",
         "mask-with-list", "bad-id-in-batch", "lone-processor", "no-proposers", "float-padding", "2-d-padding"],
)
def test_bad_engine_input_is_refused_before_any_work(llama_tiny, call, error, message):
    engine = Engine(llama_tiny, max_length=64)
    fingerprint = model_fingerprint(llama_tiny)
    with ForwardRecorder(llama_tiny) as recorder, pytest.raises(error, match=message):
        call(llama_tiny, engine)
    assert recorder.sizes == []  # no forward ran
    assert model_fingerprint(llama_tiny) == fingerprint
    assert not engine.has_unfinished()  # nothing was queued


def test_the_cost_of_a_batch_step_is_measured_per_batch_size_once(llama_tiny):
    from lookahead.costs import batch_cost_curve
    from lookahead.hf import HFModelRunner

    runner = HFModelRunner(llama_tiny)
    curve = batch_cost_curve(runner, 8)
    assert curve.sizes == [1, 2, 4, 8, 16] and curve.relative[0] == 1.0  # 8 x 16 rows at most: 128
    with ForwardRecorder(llama_tiny) as recorder:
        again = batch_cost_curve(runner, 8)
    assert recorder.sizes == [] and again.relative == curve.relative  # kept, not measured again
    assert batch_cost_curve(runner, 1).sizes == [1, 2, 4, 8, 16, 32, 64]  # one sequence: the k-row curve


def _run(engine: Engine, requests: dict[int, torch.Tensor], outputs: dict[int, list[int]], errors: dict) -> None:
    """Step until every request is done, collecting tokens and errors per request id."""
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.tokens)
            if output.error is not None:
                errors[output.request_id] = output.error


def test_another_threads_abort_and_add_wait_for_the_step_in_progress(llama_tiny, monkeypatch):
    """An abort from another thread in the middle of a step had freed a slot under it (and moved the last slot
    down): a waiting request then joined the half-moved slot and was lost, others got wrong tokens. It now waits
    for the step to end, and every request left is its own greedy output."""
    import threading

    from lookahead.hf import HFModelRunner

    engine = Engine(llama_tiny, max_batch=2, max_length=64)
    prompts = prompts_of([5, 7, 6], seed=21)
    first, second = (engine.add_request(p, RequestParams(max_new_tokens=10, eos_token_id=[])) for p in prompts[:2])
    outputs: dict[int, list[int]] = {}

    def step() -> None:
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.tokens)

    step()
    forward, inside, events = HFModelRunner.step_logits, threading.Event(), []

    def slow(self, store, batch, argmax_only=False):
        inside.set()
        time.sleep(0.3)  # long enough for the other thread to call in
        events.append("forward ended")
        return forward(self, store, batch, argmax_only)

    def meanwhile():
        inside.wait(5)
        third.append(engine.add_request(prompts[2], RequestParams(max_new_tokens=10, eos_token_id=[])))
        events.append("added")
        engine.abort(first)
        events.append("aborted")

    monkeypatch.setattr(HFModelRunner, "step_logits", slow)
    third, other = [], threading.Thread(target=meanwhile)
    other.start()
    step()
    other.join(5)
    assert events[:3] == ["forward ended", "added", "aborted"]  # both waited for the step
    monkeypatch.setattr(HFModelRunner, "step_logits", forward)
    while engine.has_unfinished():
        step()
    for rid, prompt in ((second, prompts[1]), (third[0], prompts[2])):
        expected = reference_greedy(llama_tiny, prompt.view(1, -1), 10, eos_token_id=[])[0, prompt.numel():]
        assert outputs[rid] == expected.tolist()


def test_prompt_chunks_packed_together_stay_inside_each_slots_store():
    """A long prompt's last chunk beside a new prompt's tall one: the short chunk is padded to the tall one's
    height, and that padding must fit the first request's slot (it had overflowed it: every later step
    failed)."""
    torch.manual_seed(0)
    from conftest import _COMMON, peaked
    from transformers import LlamaConfig, LlamaForCausalLM
    model = peaked(LlamaForCausalLM(LlamaConfig(**{**_COMMON, "max_position_embeddings": 2048})), 0.15)
    engine = Engine(model, max_batch=2, max_length=1040, prefill_chunk=1024)
    long, short = random_prompt(1026, 1)[0], random_prompt(513, 2)[0]
    params = RequestParams(max_new_tokens=6, config=LookaheadConfig(window=0, guesses=0), eos_token_id=[])
    requests = {engine.add_request(long, params): long}
    outputs: dict[int, list[int]] = {}
    engine.step()  # the long prompt's first 1024 tokens
    requests[engine.add_request(short, params)] = short
    _run(engine, requests, outputs, {})
    for rid, prompt in requests.items():
        expected = reference_greedy(model, prompt.view(1, -1), 6, eos_token_id=[])[0, prompt.numel():]
        assert outputs[rid] == expected.tolist()


class FailsOnce:
    """A logits processor with a bug that shows once, at its `when`-th call."""

    def __init__(self, when: int) -> None:
        self.calls, self.when = 0, when

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.when:
            raise RuntimeError("a bug in the user's processor")
        return scores


def test_a_request_whose_decoding_rule_fails_ends_alone_and_the_others_stay_exact(llama_tiny):
    engine = Engine(llama_tiny, max_batch=3)
    prompts = prompts_of([9, 5, 12], seed=11)
    ids = [engine.add_request(p, RequestParams(max_new_tokens=20, eos_token_id=[],
                                               logits_processor=[FailsOnce(4)] if i == 1 else None))
           for i, p in enumerate(prompts)]
    outputs: dict[int, list[int]] = {}
    errors: dict[int, Exception] = {}
    _run(engine, dict(zip(ids, prompts)), outputs, errors)
    assert list(errors) == [ids[1]] and "a bug in the user's processor" in str(errors[ids[1]])
    for rid, prompt in zip([ids[0], ids[2]], [prompts[0], prompts[2]]):
        expected = reference_greedy(llama_tiny, prompt.view(1, -1), 20, eos_token_id=[])[0, prompt.numel():]
        assert outputs[rid] == expected.tolist()
    with pytest.raises(RuntimeError, match="a bug in the user's processor"):
        generate(llama_tiny, prompts[0], max_new_tokens=8, logits_processor=[FailsOnce(2)])


class BrokenSource:
    """A caller's draft source: fails at its `when`-th proposal, or proposes `token` every time, or what
    `proposes()` returns."""

    name = "broken"

    def __init__(self, when: int | None = None, token: int | None = None, proposes=None) -> None:
        self.calls, self.when, self.token, self.proposes = 0, when, token, proposes

    def propose(self, text, limit):
        self.calls += 1
        if self.calls == self.when:
            raise RuntimeError("a bug in the user's draft source")
        if self.proposes is not None:
            return self.proposes()
        return [Draft((self.token,), self.name)] if self.token is not None else []

    def observe(self, text, new):
        pass


@pytest.mark.parametrize("source, error", [
    (lambda: BrokenSource(when=3), "a bug in the user's draft source"),
    (lambda: BrokenSource(token=10**6), r"draft source 'broken' proposed token id 1000000, outside the model's "
                                        r"vocabulary \[0, "),
    # True == 1 passed the vocabulary check, and the step then committed token 1 whatever the model predicted.
    (lambda: BrokenSource(token=True), r"draft source 'broken' proposed True \(bool\), not a token id"),
    (lambda: BrokenSource(token=3.0), r"draft source 'broken' proposed 3.0 \(float\), not a token id"),
    (lambda: BrokenSource(proposes=lambda: None),
     r"draft source 'broken': propose\(\) must return a list of lookahead Drafts, got None"),
    (lambda: BrokenSource(proposes=lambda: [(5, 6)]),
     r"draft source 'broken': propose\(\) must return a list of lookahead Drafts, got \[\(5, 6\)\]"),
    (lambda: BrokenSource(proposes=lambda: [Draft(5, "broken")]),
     r"draft source 'broken' proposed tokens=5, not a sequence"),
    (lambda: BrokenSource(proposes=lambda: [Draft((5,), "broken", None)]),
     r"draft source 'broken' proposed a draft of context=None: .* an integer >= 0"),
], ids=["raises", "token-outside-the-vocabulary", "bool-token", "float-token", "none", "tuples", "int-tokens",
        "context-none"])
def test_a_request_whose_draft_source_fails_ends_alone_and_the_others_stay_exact(llama_tiny, source, error):
    """Proposing runs before the step's forward, for every request together: a failing source had failed every
    step of the engine (its drafts are checked before they reach the model's embedding)."""
    engine = Engine(llama_tiny, max_batch=2)
    prompts = prompts_of([9, 12], seed=12)
    ids = [engine.add_request(p, RequestParams(max_new_tokens=20, eos_token_id=[], config=LookaheadConfig(),
                                               proposers=[source()] if i == 0 else ()))
           for i, p in enumerate(prompts)]
    outputs: dict[int, list[int]] = {}
    errors: dict[int, Exception] = {}
    _run(engine, dict(zip(ids, prompts)), outputs, errors)
    assert list(errors) == [ids[0]]
    with pytest.raises(type(errors[ids[0]]), match=error):
        raise errors[ids[0]]
    expected = reference_greedy(llama_tiny, prompts[1].view(1, -1), 20, eos_token_id=[])[0, prompts[1].numel():]
    assert outputs[ids[1]] == expected.tolist()
    assert not engine.has_unfinished() and engine.running() == 0


def test_numpy_token_ids_from_a_draft_source_and_a_numpy_length_are_taken_as_ints(llama_tiny):
    import numpy as np

    prompt = prompts_of([9], seed=13)[0]
    expected = reference_greedy(llama_tiny, prompt.view(1, -1), 16, eos_token_id=[])[0, prompt.numel():].tolist()
    engine = Engine(llama_tiny, max_batch=1)
    rid = engine.add_request(prompt, RequestParams(max_new_tokens=np.int64(16), eos_token_id=[],
                                                   config=LookaheadConfig(),
                                                   proposers=[BrokenSource(token=np.int64(expected[1]))]))
    outputs: dict[int, list[int]] = {}
    errors: dict[int, Exception] = {}
    _run(engine, {rid: prompt}, outputs, errors)
    assert errors == {} and outputs[rid] == expected and all(type(t) is int for t in outputs[rid])


def test_numpy_and_tensor_integers_are_taken_as_ints_everywhere_and_bools_and_floats_are_refused(llama_tiny):
    import numpy as np

    prompt = prompts_of([9], seed=13)[0]
    expected = reference_greedy(llama_tiny, prompt.view(1, -1), 12, eos_token_id=[])[0, prompt.numel():].tolist()
    config = LookaheadConfig(window=np.int64(2), ngram=np.int32(3), guesses=torch.tensor(2), suffix=np.int64(8))
    assert all(type(getattr(config, name)) is int for name in ("window", "ngram", "guesses", "suffix"))
    engine = Engine(llama_tiny, max_batch=np.int64(2), max_length=np.int64(64), prefill_chunk=torch.tensor(16))
    assert (type(engine.max_batch), type(engine.max_length), type(engine.prefill_chunk)) == (int, int, int)
    rid = engine.add_request(prompt, RequestParams(max_new_tokens=torch.tensor(12), eos_token_id=[], config=config))
    outputs: dict[int, list[int]] = {}
    errors: dict[int, Exception] = {}
    _run(engine, {rid: prompt}, outputs, errors)
    assert errors == {} and outputs[rid] == expected
    sampled = [generate(llama_tiny, prompt, max_new_tokens=8, do_sample=True, top_k=k, eos_token_id=[],
                        generator=torch.Generator().manual_seed(3)).sequences for k in (5, np.int64(5), torch.tensor(5))]
    assert torch.equal(sampled[0], sampled[1]) and torch.equal(sampled[0], sampled[2])

    class FailingIndex:
        def __index__(self):
            raise OverflowError("no")

    for bad in (True, np.True_, torch.tensor(True), 2.0, torch.tensor(2.0), "2", FailingIndex(),
                torch.tensor(3, device="meta")):
        with pytest.raises(ValueError, match=r"max_batch must be an integer >= 1, got"):
            Engine(llama_tiny, max_batch=bad)
        with pytest.raises(ValueError, match=r"LookaheadConfig.window must be an integer >= 0"):
            LookaheadConfig(window=bad)
        with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got"):
            engine.add_request(prompt, RequestParams(max_new_tokens=bad))


def test_a_freed_slot_takes_the_highest_request_even_from_the_slot_above_it(llama_tiny):
    """Decoding requests keep to the first slots (the store reads them without gathering)."""
    engine = Engine(llama_tiny, max_batch=3, max_length=64)
    ids = [engine.add_request(random_prompt(6, seed)[0], RequestParams(max_new_tokens=8)) for seed in range(3)]
    engine.step()
    assert engine.abort(ids[1])
    assert [r.id if r else None for r in engine._slots] == [ids[0], ids[2], None] and engine._slots[1].slot == 1


class CallsEngine:
    """A stopping criterion that calls `action(engine)` at its `when`-th call, and stops nothing."""

    def __init__(self, engine: Engine, action, when: int) -> None:
        self.engine, self.action, self.calls, self.when = engine, action, 0, when

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.when:
            self.action(self.engine)
        return False


@pytest.mark.parametrize("action", [lambda e: e.abort(0), lambda e: e.abort(1), lambda e: e.finish(2),
                                    lambda e: e.step()], ids=["abort-other", "abort-itself", "finish-other", "step"])
def test_ending_requests_from_inside_a_step_is_refused_and_harms_no_other(llama_tiny, action):
    """`abort` from a criterion run by `step` moved slots under the step's feet: other requests' caches were
    written to the wrong slot, and later requests in those slots decoded from a stale prefix. Now the call
    raises, ending the request whose criterion made it; every other request, and every later one, is exact."""
    engine = Engine(llama_tiny, max_batch=4)
    prompts = prompts_of([9, 5, 12, 7], seed=14)
    ids = [engine.add_request(p, RequestParams(max_new_tokens=12, eos_token_id=[], config=LookaheadConfig(),
                                               stopping_criteria=[CallsEngine(engine, action, 4)] if i == 1 else None))
           for i, p in enumerate(prompts)]
    outputs: dict[int, list[int]] = {}
    errors: dict[int, Exception] = {}
    _run(engine, dict(zip(ids, prompts)), outputs, errors)
    assert list(errors) == [ids[1]] and isinstance(errors[ids[1]], RuntimeError)
    assert "was called while Engine.step() runs" in str(errors[ids[1]])
    later = prompts_of([6, 10, 8, 11], seed=15)
    again = [engine.add_request(p, RequestParams(max_new_tokens=12, eos_token_id=[])) for p in later]
    _run(engine, dict(zip(again, later)), outputs, errors)
    for rid, prompt in [*zip(ids, prompts), *zip(again, later)]:
        if rid != ids[1]:
            expected = reference_greedy(llama_tiny, prompt.view(1, -1), 12, eos_token_id=[])[0, prompt.numel():]
            assert outputs[rid] == expected.tolist(), rid
    assert engine.store.lengths == [0] * 4


def test_a_refused_request_leaves_its_corpus_free_to_serve_another_vocabulary(llama_tiny, small_vocab_model):
    """The corpus was bound to the model's vocabulary while the request's options were checked, before its prompt
    was refused: a model of another vocabulary could then not use the corpus, that no request had drafted from."""
    from lookahead import Corpus

    corpus = Corpus()
    with pytest.raises(ValueError, match="exceeds the engine's max_length of 16 positions"):
        Engine(llama_tiny, max_batch=1, max_length=16).add_request(list(range(3, 20)), RequestParams(
            max_new_tokens=4, corpus=corpus))
    assert corpus.vocabulary is None
    with pytest.raises(ValueError, match=r"token id 10, outside the model.s vocabulary \[0, 10\)"):
        generate(small_vocab_model, [2, 3, 10], max_new_tokens=2, corpus=corpus)
    assert corpus.vocabulary is None
    out = generate(small_vocab_model, [2, 3, 4], max_new_tokens=2, eos_token_id=[], corpus=corpus)
    assert corpus.vocabulary == 10 and len(corpus) == 1 and out.sequences.shape == (1, 5)


def test_finish_keeps_the_tokens_asked_for_and_refuses_a_count_it_does_not_have(llama_tiny):
    """`finish(rid, k)` ends a request as if it had stopped after k new tokens (a stop string the caller
    found): its corpus gets the prompt and those k. A negative k had cut tokens from the end instead."""
    from lookahead import Corpus

    corpus = Corpus()
    engine = Engine(llama_tiny, max_batch=1)
    prompt = prompts_of([9], seed=18)[0]
    rid = engine.add_request(prompt, RequestParams(max_new_tokens=20, eos_token_id=[], corpus=corpus))
    generated: list[int] = []
    while len(generated) < 5:
        generated += engine.step()[0].tokens
    for bad in (-1, len(generated) + 1, 2.0, True):
        with pytest.raises(ValueError, match=rf"tokens must be an integer in \[0, {len(generated)}\]"):
            engine.finish(rid, bad)
    assert engine.running() == 1 and len(corpus) == 0  # a refused call changes nothing
    assert engine.finish(rid, 3) and engine.running() == 0 and not engine.has_unfinished()
    assert len(corpus) == 1 and corpus.tokens == 1 + prompt.numel() + 3  # a separator, the prompt, 3 tokens
    assert not engine.finish(rid, 3)  # unknown now


class InterruptsOnce:
    """A logits processor through which Ctrl-C arrives, at its `when`-th call."""

    def __init__(self, when: int) -> None:
        self.calls, self.when = 0, when

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.when:
            raise KeyboardInterrupt
        return scores


def test_a_step_interrupted_while_committing_ends_the_requests_it_reached(llama_tiny):
    """KeyboardInterrupt in the middle of committing a step (a notebook's interrupt in a user's processor):
    the requests it had reached committed tokens that were never reported, with caches not kept. They had
    decoded on from there, silently wrong; now they end with an error at the next step, and the others,
    and later requests, stay exact."""
    engine = Engine(llama_tiny, max_batch=3)
    prompts = prompts_of([9, 5, 12], seed=16)
    ids = [engine.add_request(p, RequestParams(max_new_tokens=12, eos_token_id=[], config=LookaheadConfig(),
                                               logits_processor=[InterruptsOnce(3)] if i == 1 else None))
           for i, p in enumerate(prompts)]
    outputs: dict[int, list[int]] = {}
    errors: dict[int, Exception] = {}
    with pytest.raises(KeyboardInterrupt):
        _run(engine, dict(zip(ids, prompts)), outputs, errors)
    step_logits = engine.runner.step_logits

    def fails_once(*args, **kwargs):  # the next step's forward fails too: their ends must still come
        engine.runner.step_logits = step_logits
        raise RuntimeError("a failed forward")

    engine.runner.step_logits = fails_once
    with pytest.raises(RuntimeError, match="a failed forward"):
        engine.step()
    _run(engine, dict(zip(ids, prompts)), outputs, errors)  # the caller goes on stepping
    assert sorted(errors) == ids[:2]
    assert all("KeyboardInterrupt interrupted the step" in str(errors[rid]) for rid in ids[:2])
    later = prompts_of([6, 10], seed=17)
    again = [engine.add_request(p, RequestParams(max_new_tokens=12, eos_token_id=[])) for p in later]
    _run(engine, dict(zip(again, later)), outputs, errors)
    for rid, prompt in [(ids[2], prompts[2]), *zip(again, later)]:
        expected = reference_greedy(llama_tiny, prompt.view(1, -1), 12, eos_token_id=[])[0, prompt.numel():]
        assert outputs[rid] == expected.tolist(), rid
    assert engine.store.lengths == [0] * 3 and not engine.has_unfinished()


@pytest.mark.parametrize("failure", [MemoryError("no room for the corpus"), KeyboardInterrupt()],
                         ids=["exception", "interrupt"])
def test_a_corpus_failing_to_take_a_finished_reply_loses_no_token_of_the_step(llama_tiny, failure):
    """A step's tokens are committed before its requests are finished; a finished request's corpus raising there had
    dropped every report of the step: that request never ended, the others decoded on without the step's tokens.
    Now an exception ends that request with its tokens and the error; an interrupt brings the step's reports with
    the next step. Either way every request's tokens are its greedy output, and the slots are freed."""
    from lookahead import Corpus

    class FailsOnce(Corpus):
        failed = False

        def add(self, tokens):
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise failure
            super().add(tokens)

    engine = Engine(llama_tiny, max_batch=3)
    prompts = prompts_of([9, 5, 12], seed=18)
    lengths = [1, 12, 12]  # the first finishes at the first step, beside the others
    ids = [engine.add_request(p, RequestParams(max_new_tokens=n, eos_token_id=[], config=LookaheadConfig(),
                                               corpus=FailsOnce() if i == 0 else None))
           for i, (p, n) in enumerate(zip(prompts, lengths))]
    outputs: dict[int, list[int]] = {}
    errors: dict[int, BaseException] = {}
    ended: set[int] = set()
    while engine.has_unfinished():
        try:
            for output in engine.step():
                outputs.setdefault(output.request_id, []).extend(output.tokens)
                ended |= {output.request_id} if output.finished else set()
                if output.error is not None:
                    errors[output.request_id] = output.error
        except KeyboardInterrupt:
            assert isinstance(failure, KeyboardInterrupt)
    assert FailsOnce.failed and ended == set(ids)
    assert errors == ({ids[0]: failure} if isinstance(failure, Exception) else {})
    for rid, prompt, n in zip(ids, prompts, lengths):
        expected = reference_greedy(llama_tiny, prompt.view(1, -1), n, eos_token_id=[])[0, prompt.numel():]
        assert outputs[rid] == expected.tolist(), rid
    assert engine.store.lengths == [0] * 3


def test_a_failed_generate_ends_its_stream(llama_tiny):
    """A reader of transformers' `TextIteratorStreamer` waits for the stream's end: a `generate` that fails
    ends it too, then raises."""
    from transformers import TextIteratorStreamer

    class Tokens:  # what the streamer needs of a tokenizer
        def decode(self, ids, **options):
            return " ".join(map(str, ids))

    streamer = TextIteratorStreamer(Tokens(), timeout=5)
    prompt = prompts_of([7], seed=3)[0]
    expected = reference_greedy(llama_tiny, prompt.view(1, -1), 2, eos_token_id=[])[0].tolist()
    with pytest.raises(RuntimeError, match="a bug in the user's processor"):  # its 3rd call: the 3rd token's
        generate(llama_tiny, prompt, max_new_tokens=8, logits_processor=[FailsOnce(3)], streamer=streamer,
                 config=PLAIN_CONFIG, eos_token_id=[])
    text = "".join(streamer)  # an unended stream raises queue.Empty after its timeout instead
    assert text == " ".join(map(str, expected))  # the prompt and the 2 tokens before the failure, flushed


@pytest.mark.parametrize("config", [None, LookaheadConfig(5, 4, 5)], ids=["auto", "W5N4G5"])
def test_a_model_of_a_short_context_decodes_up_to_its_end(config):
    """A context of 64 positions had been refused outright: the cost curve timed steps of 64 tokens after a
    cached prefix. It times the steps that fit (up to 32 rows here), and only a context that fits no two is refused."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from lookahead import UnsupportedModelError
    model = peaked(GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2)), 0.15)
    for prompt in ([5, 6, 7], [5, 6, 7, 8] * 10):
        prompt = torch.tensor([prompt])
        expected = reference_greedy(model, prompt, 64 - prompt.shape[1], eos_token_id=[])
        assert generate(model, prompt, max_new_tokens=64 - prompt.shape[1], config=config,
                        eos_token_id=[]).sequences.tolist() == expected.tolist()
    tiny = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=3, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(UnsupportedModelError, match="the model's context of 3 positions is too short"):
        generate(tiny, [5], max_new_tokens=2)


def test_prompt_chunks_ride_in_the_forward_of_the_decoding_step(llama_tiny):
    """A prompt that joins while others decode is fed chunk by chunk inside their steps: one forward per
    step, the prompt's rows in it, and every output still its own greedy one."""
    engine = Engine(llama_tiny, max_batch=3, max_length=200, prefill_chunk=16)
    prompts = prompts_of([7, 11, 45], seed=9)
    params = [RequestParams(max_new_tokens=n, eos_token_id=[]) for n in (30, 24, 20)]
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts[:2], params)]
    outputs: dict[int, list[int]] = {}

    def step() -> None:
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.tokens)

    step()  # the first two prompts in a forward of their own, then their first step
    ids.append(engine.add_request(prompts[2], params[2]))
    fed_before = engine.stats.tokens_fed
    with ForwardRecorder(llama_tiny) as recorder:
        while engine.has_unfinished():
            forwards = len(recorder.sizes)
            step()
            assert len(recorder.sizes) == forwards + 1
    # The forwards computed the decoding rows and the prompt's own rows (its last token is its first step's):
    # no padding, no forward of its own.
    assert sum(recorder.sizes) == engine.stats.tokens_fed - fed_before + prompts[2].numel() - 1
    for request, prompt, p in zip(ids, prompts, params):
        expected = reference_greedy(llama_tiny, prompt.view(1, -1), p.max_new_tokens, eos_token_id=[])
        assert outputs[request] == expected[0, prompt.numel():].tolist()


def test_steps_that_feed_riding_prompt_chunks_go_unpriced(llama_tiny, monkeypatch):
    """A step's time says what its decoding rows cost only without a prompt chunk in its forward: the step prices
    learn from the others (a gap a mutation review of the engine found untested)."""
    engine = Engine(llama_tiny, max_batch=3, max_length=200, prefill_chunk=16)
    riding, priced, alone = set(), set(), []
    feed, fed, record = engine._feed_prompts, engine._prompts_fed, engine.prices.record

    def feed_alone(chunks):
        alone.append(True)
        try:
            feed(chunks)
        finally:
            alone.pop()

    def fed_riding(chunks):
        if chunks and not alone:
            riding.add(engine.stats.steps)
        fed(chunks)

    def recorded(*args, **kwargs):
        priced.add(engine.stats.steps)
        record(*args, **kwargs)

    monkeypatch.setattr(engine, "_feed_prompts", feed_alone)
    monkeypatch.setattr(engine, "_prompts_fed", fed_riding)
    monkeypatch.setattr(engine.prices, "record", recorded)
    prompts = prompts_of([7, 11, 45], seed=9)
    for prompt, n in zip(prompts[:2], (30, 24)):
        engine.add_request(prompt, RequestParams(max_new_tokens=n, eos_token_id=[]))
    engine.step()
    engine.add_request(prompts[2], RequestParams(max_new_tokens=20, eos_token_id=[]))
    while engine.has_unfinished():
        engine.step()
    assert len(riding) == 3 and priced and not riding & priced  # 44 prompt rows in chunks of 16, each riding


def test_an_engines_own_step_history_is_bounded(llama_tiny, monkeypatch):
    """A server's engine steps for days: its aggregate stats keep the tokens of the last steps only."""
    import lookahead.engine as engine_module

    monkeypatch.setattr(engine_module, "STEP_HISTORY", 5)
    engine = Engine(llama_tiny, max_batch=1)
    plain = LookaheadConfig(window=0, guesses=0)  # a token a step: 12 steps
    engine.add_request(prompts_of([6], seed=2)[0], RequestParams(max_new_tokens=12, eos_token_id=[], config=plain))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.steps == 12 and list(engine.stats.accepted_per_step) == [1] * 5


def _longrope_phi3(original: int) -> torch.nn.Module:
    """A tiny Phi-3 with "longrope" rotary embeddings (as Phi-3-128k): short frequencies up to `original`
    positions, long ones past it."""
    from conftest import _COMMON, peaked
    from transformers import Phi3Config, Phi3ForCausalLM
    half = _COMMON["hidden_size"] // _COMMON["num_attention_heads"] // 2
    torch.manual_seed(0)
    config = Phi3Config(**_COMMON, original_max_position_embeddings=original, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
        "long_factor": [float(4 + i) for i in range(half)], "original_max_position_embeddings": original})
    return peaked(Phi3ForCausalLM(config), 0.15)


def test_a_longrope_model_decodes_within_its_original_context_only():
    """transformers switches a forward to the long frequencies once any of its positions lies past the original
    context; a batch, a lookahead step or a prompt fed in chunks would cross it at other steps than generate's
    (outputs differed), so requests stay inside it."""
    model = _longrope_phi3(original=80)  # the cost curve's steps need 65 positions
    prompts = prompts_of([10, 30], seed=13)
    out = generate(model, prompts, max_new_tokens=50, eos_token_id=[], config=LookaheadConfig())
    for row, prompt in zip(out.sequences, prompts):  # the longer one ends at the last position allowed
        expected = reference_greedy(model, prompt.view(1, -1), 50, eos_token_id=[])[0]
        assert row[: expected.numel()].tolist() == expected.tolist()
    with pytest.raises(ValueError, match="exceeds the model's context of 80 positions"):
        generate(model, prompts[1], max_new_tokens=51)
    with pytest.raises(ValueError, match="max_length"):
        Engine(model, max_length=81)


def test_a_requests_generation_config_takes_its_unset_fields_from_the_models():
    """`RequestParams(generation_config=...)`, as `model.generate(generation_config=...)`: what it leaves unset
    (here the stop token) comes from the model's config (it had been dropped: the request ran past the model's
    EOS)."""
    from conftest import make_tiny_model
    from transformers import GenerationConfig

    model = make_tiny_model("llama")
    prompt = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])
    free = reference_greedy(model, prompt.view(1, -1), 12, eos_token_id=[])[0, 8:].tolist()
    model.generation_config.eos_token_id = free[3]
    own = GenerationConfig(no_repeat_ngram_size=4)
    with torch.inference_mode():
        expected = model.generate(prompt.view(1, -1), do_sample=False, max_new_tokens=12, generation_config=own)
    assert expected.shape[1] < 8 + 12  # the model's EOS ended it
    engine = Engine(model, max_batch=1)
    request = engine.add_request(prompt, RequestParams(max_new_tokens=12, generation_config=own))
    tokens = [t for _ in iter(engine.has_unfinished, False) for o in engine.step() if o.request_id == request
              for t in o.tokens]
    assert tokens == expected[0, 8:].tolist()


@pytest.mark.parametrize("config", [LookaheadConfig(), None])
def test_the_window_is_not_fed_on_a_requests_last_step(llama_tiny, config):
    """The window's rows only feed later steps: a request with one token left feeds its last token alone (its
    guesses are capped there already)."""
    prompt = torch.tensor([[1] + [5, 6, 7, 8] * 6])
    out = generate(llama_tiny, prompt, max_new_tokens=1, config=config, eos_token_id=[])
    assert (out.stats.steps, out.stats.tokens_fed) == (1, 1)
    assert out.sequences.tolist() == reference_greedy(llama_tiny, prompt, 1, eos_token_id=[]).tolist()


def test_the_memory_check_counts_the_bytes_the_kv_store_holds(llama_tiny):
    """The estimate the engine's memory check makes equals what the store allocates in its first forward: on
    Gemma 4 too, whose head_dim differs by layer (it had crashed reading it from the whole config) and whose last
    layers reuse earlier layers' keys and values (counted as their own, the estimate had been twice the store); on
    DeepSeek-V3, which caches one head of its latent (32 here) and rotary key (8), not its 4 heads of head_dim 8."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    from conftest import _COMMON, make_mla_model
    import lookahead.hf as hf
    from lookahead.runtime.batch import causal_step, pack_steps

    gemma4 = Gemma4ForCausalLM(Gemma4TextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=12, head_dim=16, global_head_dim=32, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128)).eval()
    for model in (llama_tiny, gemma4, make_mla_model()):
        runner = hf.HFModelRunner(model)
        store = runner.new_store(2, 16)
        runner.forward(store, pack_steps([0], [0], [causal_step(torch.tensor([5, 6, 7]))]))
        held = sum(b.numel() * b.element_size() for b in store.key_buffers + store.value_buffers if b is not None)
        assert runner.kv_bytes_per_position() * 2 * 16 == held, type(model).__name__


def test_the_kv_store_is_sized_by_this_processs_share_of_the_heads_under_tensor_parallelism(llama_tiny, monkeypatch):
    """Under tensor parallelism each process caches its share of the key/value heads: the memory check counts
    that share, not every head (which refused batches that fit)."""
    import lookahead.hf as hf

    runner = hf.HFModelRunner(llama_tiny)
    whole = runner.kv_bytes_per_position()
    monkeypatch.setattr(hf, "is_sharded", lambda model: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert runner.kv_bytes_per_position() * 2 == whole

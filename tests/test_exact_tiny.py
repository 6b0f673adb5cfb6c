"""Exactness on tiny random models of several families: lookahead output == plain greedy `generate`."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from conftest import _COMMON, FAMILIES, TINY_VOCAB, make_mla_model, make_tiny_model, peaked, random_tree_step, reference_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead import LookaheadConfig, generate
from lookahead.core.drafts import Draft
from lookahead.core.layout import build_guess_tree, step_layout
from lookahead import hf as hf_module
from lookahead import kernels
from lookahead.costs import cost_curve
from lookahead import attention
from lookahead.attention import RaggedLayout
from lookahead.hf import ArgmaxOutputLayer, HFModelRunner, PackedLinears
from lookahead.runtime.batch import StepInput, causal_step, pack_steps
from lookahead.runtime.kv import KVStore

CONFIGS = [
    LookaheadConfig(),
    LookaheadConfig(window=3, ngram=3, guesses=3),
    LookaheadConfig(window=7, ngram=5, guesses=2, seed=3),
    LookaheadConfig(window=0, ngram=3, guesses=4),  # prompt n-grams only
    LookaheadConfig(window=0, guesses=0),  # plain decoding through our loop
]


def random_prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


class ForwardRecorder:
    """Records how many tokens each of the model's forward passes was fed: the steps, seen from the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.sizes: list[int] = []
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.sizes.append(int(kwargs["input_ids"].numel()))

    def __enter__(self) -> ForwardRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"W{c.window}N{c.ngram}G{c.guesses}")
def test_identical_to_greedy(tiny_model, config):
    for seed, length in [(1, 30), (2, 5), (3, 1)]:
        prompt = random_prompt(length, seed)
        expected = reference_greedy(tiny_model, prompt, 48)
        cost_curve(HFModelRunner(tiny_model))  # measured (its own forwards) once per model shape, then cached
        with ForwardRecorder(tiny_model) as recorder:
            out = generate(tiny_model, prompt, max_new_tokens=48, config=config)
        assert torch.equal(out.sequences, expected)
        assert out.stats.new_tokens == expected.shape[1] - length
        steps = recorder.sizes[1:] if length > 1 else recorder.sizes  # a prompt of 1 token needs no prefill
        assert out.stats.steps == len(steps) and out.stats.tokens_fed == sum(steps)
        assert max(out.stats.accepted_per_step) <= config.ngram  # a step accepts at most N-1 guessed + 1


def _more_families():
    """Tiny models of architectures beyond FAMILIES, each with what sets it apart: partial rotary, learned
    positions, parallel attention, QK norms, scaled logits, hybrid sliding layers. (A tiny random Gemma 2 repeats
    one token whatever its prompt: no test of anything.)"""
    from transformers import (Cohere2Config, Cohere2ForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig, GPT2Config,
                              GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, GraniteConfig, GraniteForCausalLM,
                              Olmo2Config, Olmo2ForCausalLM, OPTConfig, OPTForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    plain = dict(vocab_size=TINY_VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    sliding = dict(sliding_window=12, layer_types=["sliding_attention", "full_attention"])
    return {
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16)),
        "olmo2": lambda: Olmo2ForCausalLM(Olmo2Config(**_COMMON)),
        "granite": lambda: GraniteForCausalLM(GraniteConfig(**_COMMON, attention_multiplier=0.2, logits_scaling=2.0,
                                                            residual_multiplier=0.5, embedding_multiplier=3.0)),
        "cohere2": lambda: Cohere2ForCausalLM(Cohere2Config(**_COMMON, **sliding)),
        "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**plain, hidden_size=64, intermediate_size=128,
                                                             num_hidden_layers=2, num_attention_heads=4)),
        "opt": lambda: OPTForCausalLM(OPTConfig(**plain, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                num_attention_heads=4, word_embed_proj_dim=64, pad_token_id=0)),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=TINY_VOCAB, n_positions=512, n_embd=64, n_layer=2,
                                                   n_head=4, bos_token_id=1, eos_token_id=2)),
        # a heterogeneous config: head_dim is read per layer (16 sliding, 32 full), not from the whole config
        "gemma4": lambda: Gemma4ForCausalLM(Gemma4TextConfig(**_COMMON, **sliding, head_dim=16, global_head_dim=32,
                                                             hidden_size_per_layer_input=16,
                                                             vocab_size_per_layer_input=TINY_VOCAB)),
    }


@pytest.mark.parametrize("family", list(_more_families()))
def test_more_families_decode_as_greedy_generate(family):
    """Greedy output equals transformers' on architectures the other tests do not build, through a fixed step
    (window, pool, guesses) and the automatic one."""
    torch.manual_seed(0)
    model = peaked(_more_families()[family](), 0.15)
    prompt = random_prompt(20, 1).repeat(1, 2)  # repeated: the pool has n-grams to guess from
    expected = reference_greedy(model, prompt, 40, eos_token_id=[])
    for config in (LookaheadConfig(5, 4, 5), None):
        out = generate(model, prompt, max_new_tokens=40, config=config, eos_token_id=[])
        assert out.sequences.tolist() == expected.tolist(), (family, config)


def test_mla_values_of_another_head_size_batch_and_engine_as_greedy_generate():
    """DeepSeek-V3's multi-head latent attention gives values a smaller head size than queries and keys (24 to
    16 here, as 128 to 192 in its checkpoints): a batch of prompts of different lengths (the ragged path) and an
    engine whose requests join at different steps both decode as transformers does, prompt by prompt."""
    from lookahead.engine import Engine, RequestParams

    torch.manual_seed(0)
    model = peaked(make_mla_model(), 0.15)
    prompts = [random_prompt(n, seed) for seed, n in enumerate((7, 23, 15))]
    expected = [reference_greedy(model, p, 30, eos_token_id=[])[0, p.shape[1]:].tolist() for p in prompts]
    out = generate(model, [p[0] for p in prompts], max_new_tokens=30, config=LookaheadConfig(5, 4, 5),
                   eos_token_id=[])
    for row, prompt, tokens in zip(out.sequences, prompts, expected):  # rows right-padded to the longest
        assert row[prompt.shape[1]:prompt.shape[1] + len(tokens)].tolist() == tokens
    engine = Engine(model, max_batch=3, max_length=128)
    outputs: dict[int, list[int]] = {}
    ids = []
    for prompt in prompts:  # one joins per step, beside those decoding
        ids.append(engine.add_request(prompt[0], RequestParams(max_new_tokens=30, eos_token_id=[])))
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.tokens)
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.tokens)
    assert [outputs[i] for i in ids] == expected


def test_lookahead_accepts_guesses_on_some_family(drafts_always):
    """Exactness alone cannot tell a working guess path from one that never matches: make sure that,
    across families and prompts, verified guesses are accepted (more than one token per step)."""
    accepted = 0
    for family in ("qwen2", "phi3", "mistral"):
        model = make_tiny_model(family)
        for seed in range(3):
            out = generate(model, random_prompt(30, seed), max_new_tokens=60)
            accepted += out.stats.new_tokens - out.stats.steps
    assert accepted > 10


def prefilled_store(runner: HFModelRunner, prompts: list[torch.Tensor], capacity: int = 512):
    """A KV store whose slot b holds prompts[b]."""
    store = runner.new_store(len(prompts), capacity)
    runner.forward(store, pack_steps(range(len(prompts)), [0] * len(prompts), [causal_step(p) for p in prompts]))
    for slot, prompt in enumerate(prompts):
        store.extend(slot, prompt.numel())
    return store


def test_step_predictions_equal_plain_forward(tiny_model):
    """Every row of a lookahead step predicts what a plain forward over that row's context predicts."""
    runner = HFModelRunner(tiny_model)
    prompt = random_prompt(40, 5)[0]
    store = prefilled_store(runner, [prompt[:-1]])
    layout = step_layout(3, 4, build_guess_tree([(9, 8, 7), (9, 6, 5), (4, 3, 2)]))
    tokens = torch.randint(3, 128, (layout.size,), generator=torch.Generator().manual_seed(6))
    tokens[0] = prompt[-1]
    step = StepInput(tokens, layout.offsets, layout.allowed, torch.arange(layout.size))
    logits = runner.forward(store, pack_steps([0], store.lengths[:1], [step]))[0]
    for row in range(layout.size):
        context_rows = torch.nonzero(layout.allowed[row]).flatten()
        context_rows = context_rows[layout.offsets[context_rows].argsort()]
        sequence = torch.cat([prompt[:-1], tokens[context_rows]])
        with torch.inference_mode():
            expected = tiny_model(sequence.view(1, -1)).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


def test_keep_leaves_exactly_the_committed_tokens_in_each_slot(llama_tiny):
    """Three sequences of different lengths step together (padded to one height); each slot then holds what
    a fresh prefill of its committed tokens computes, whatever its neighbours fed."""
    runner = HFModelRunner(llama_tiny)
    prompts = [random_prompt(length, 7 + length)[0] for length in (20, 250, 3)]
    store = prefilled_store(runner, [p[:-1] for p in prompts])
    trees = [build_guess_tree([(9, 8, 7), (9, 6, 5)]), build_guess_tree([(4,)]), build_guess_tree([])]
    layouts = [step_layout(2, 3, trees[0]), step_layout(0, 0, trees[1]), step_layout(1, 2, trees[2])]
    steps = []
    for index, (prompt, layout) in enumerate(zip(prompts, layouts)):
        tokens = torch.randint(3, 128, (layout.size,), generator=torch.Generator().manual_seed(8 + index))
        tokens[0] = prompt[-1]
        steps.append(StepInput(tokens, layout.offsets, layout.allowed, layout.logit_rows))
    runner.forward(store, pack_steps([0, 1, 2], list(store.lengths), steps))
    kept_rows = [torch.cat([torch.zeros(1, dtype=torch.long), trees[0].paths[1, :2] + layouts[0].tree_start]),
                 torch.tensor([0, layouts[1].tree_start]), torch.zeros(1, dtype=torch.long)]
    for slot, kept in enumerate(kept_rows):
        store.keep(slot, kept)
    committed = [torch.cat([p[:-1], s.tokens[k]]) for p, s, k in zip(prompts, steps, kept_rows)]
    fresh = prefilled_store(runner, committed)
    assert store.lengths == fresh.lengths == [c.numel() for c in committed]
    for ours, reference in zip(store.key_buffers + store.value_buffers, fresh.key_buffers + fresh.value_buffers):
        for slot, length in enumerate(store.lengths):
            torch.testing.assert_close(ours[slot, :, :length], reference[slot, :, :length], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[0, 1], [2, 0]])
def test_store_writes_each_sequence_at_its_own_length(dtype, slots):
    """A layer's new keys and values land in their slots after each slot's own length (consecutive slots or
    not, in either dtype), nothing else in the buffer changes, and the layer reads back each slot's prefix."""
    store = KVStore(num_layers=1, slots=3, capacity=16)
    store.lengths = [5, 2, 9]
    rows, heads, head_dim = 3, 2, 4
    store.begin(slots, rows, attend=12, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(len(slots), heads, rows, head_dim, generator=generator).to(dtype) for _ in range(2))
    read_keys, read_values = store.update(keys, values, 0)
    for buffer, new, read in ((store.key_buffers[0], keys, read_keys), (store.value_buffers[0], values, read_values)):
        expected = torch.zeros(3, heads, 16, head_dim, dtype=dtype)
        for b, slot in enumerate(slots):
            start = store.lengths[slot]
            expected[slot, :, start : start + rows] = new[b]
        assert torch.equal(buffer, expected)
        assert torch.equal(read, expected[slots][:, :, :12])


def test_the_store_takes_a_step_up_to_its_last_position_and_refuses_one_past_it():
    """A row past a slot's capacity would land on the next head's first position (the heads of a slot are laid
    out one after the other): refused, at the exact boundary."""
    store = KVStore(num_layers=1, slots=2, capacity=8)
    store.lengths = [6, 0]
    cpu = torch.device("cpu")
    store.begin([0, 1], rows=2, attend=8, device=cpu)  # positions 6 and 7 of slot 0: its last two
    with pytest.raises(ValueError, match="capacity"):
        store.begin([0, 1], rows=3, attend=8, device=cpu)
    with pytest.raises(ValueError, match="capacity"):
        store.begin([0, 1], rows=1, attend=9, device=cpu)


@settings(max_examples=12, deadline=None)  # each example runs two forwards on a tiny model
@given(seed=st.integers(0, 2**16), sizes=st.lists(st.integers(1, 9), min_size=2, max_size=5), order=st.randoms())
def test_a_ragged_step_computes_what_the_padded_step_computes(tiny_model, seed, sizes, order):
    """Sequences of different heights flattened into one sequence (the layers compute no padding rows, attention
    lays the rows out per sequence again) get the logits, and write the keys and values, that the same step
    padded to its tallest sequence gets and writes, in any slots."""
    generator = torch.Generator().manual_seed(seed)
    every = list(range(len(sizes) + 1))
    lengths = [int(torch.randint(1, 20, (1,), generator=generator)) for _ in every]
    prompts = [causal_step(torch.randint(3, 128, (n,), generator=generator)) for n in lengths]
    runners = [HFModelRunner(tiny_model, packed_linear=False) for _ in range(2)]
    runners[1].ragged_steps = False
    stores = [runner.new_store(len(every), 64) for runner in runners]
    for runner, store in zip(runners, stores):
        for slot, prompt in zip(every, prompts):
            runner.forward(store, pack_steps([slot], [0], [prompt]))
            store.extend(slot, prompt.tokens.numel())
    slots = order.sample(every, len(sizes))
    batch = pack_steps(slots, [lengths[s] for s in slots], [random_tree_step(n, generator) for n in sizes])
    output_rows = []
    hook = tiny_model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, output: output_rows.append(inputs[0].shape[:-1].numel()))
    try:
        with ForwardRecorder(tiny_model) as recorder:
            ragged = runners[0].step_logits(stores[0], batch)
    finally:
        hook.remove()
    padded = runners[1].step_logits(stores[1], batch)
    assert runners[0].ragged and recorder.sizes == [sum(sizes)]
    # The output layer computes each distinct row once (a shorter sequence's reads past its rows repeat its last),
    # and they stay so: the step's logits are not spread to every sequence's share of the tallest's rows.
    distinct = sum(len({min(row, size - 1) for row in batch.logit_rows.tolist()}) for size in sizes)
    assert output_rows == [distinct] and ragged.computed.shape[:-1].numel() == distinct and padded.index is None
    torch.testing.assert_close(ragged.dense(), runners[0].forward(stores[0], batch), rtol=0, atol=0)
    for b, size in enumerate(sizes):
        rows = batch.picks[b] if batch.picks[b] is not None else torch.arange(size)
        torch.testing.assert_close(ragged.of(b, batch.picks[b])[: rows.numel()], padded.of(b, rows),
                                   rtol=1e-5, atol=1e-5)
    written = {slot: lengths[slot] + size for slot, size in zip(slots, sizes)}
    for ours, theirs in zip(stores[0].key_buffers + stores[0].value_buffers,
                            stores[1].key_buffers + stores[1].value_buffers):
        for slot in every:
            end = written.get(slot, lengths[slot])
            torch.testing.assert_close(ours[slot, :, :end], theirs[slot, :, :end], rtol=1e-5, atol=1e-5)


@given(sized=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 40)), min_size=1, max_size=9))
def test_a_ragged_layout_puts_every_row_in_one_attention_call_at_its_own_mask_row(sized):
    sizes, cached = [size for size, _ in sized], [length for _, length in sized]
    layout = RaggedLayout.of(sizes, cached, torch.device("cpu"))
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    seen = []
    for part in layout.parts:
        sequences = range(*part.sequences.indices(len(sizes)))
        # The keys a call reads reach as far as its farthest sequence's rows, and no farther.
        assert part.keys == max(cached[b] + sizes[b] for b in sequences)
        for index, b in enumerate(sequences):
            for place, row in zip(range(*part.mask_rows.indices(max(sizes))), part.rows[index].tolist()):
                if row == layout.count:  # padding: the zero row
                    assert place >= sizes[b]
                else:
                    assert row == starts[b] + place
                    seen.append(row)
    assert sorted(seen) == list(range(sum(sizes))) == list(range(layout.count))
    # One call padded to the tallest, or one for the rows all have and one per taller sequence: the cheaper.
    common, taller = min(sizes), [size for size in sizes if size > min(sizes)]
    padded = len(sizes) * (max(sizes) - common)  # rows one call adds
    split = sum(RaggedLayout.CALL_IN_ROWS + size - common for size in taller)  # what the calls of the taller cost
    assert len(layout.parts) == (1 if padded <= split else 1 + len(taller))


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
    # A left-padded row: the prompt comes with its padding, as generate's streamer gets its input ids (it had come
    # without).
    padded, recorder = torch.cat([torch.zeros(1, 2, dtype=torch.long), prompt], dim=1), Recorder()
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    generate(llama_tiny, padded, attention_mask=mask, max_new_tokens=5, streamer=recorder)
    assert recorder.chunks[0] == padded[0].tolist()


@st.composite
def prompts(draw) -> list[int]:
    """Random tokens, or a motif repeated with noise: repeats give the n-gram pool something to find."""
    if draw(st.booleans()):
        return draw(st.lists(st.integers(3, 127), min_size=1, max_size=60))
    motif = draw(st.lists(st.integers(3, 127), min_size=1, max_size=8))
    text = (motif * draw(st.integers(1, 8)))[:60]
    for _ in range(draw(st.integers(0, 3))):
        text[draw(st.integers(0, len(text) - 1))] = draw(st.integers(3, 127))
    return text


class NoisyOracle:
    """A draft source that copies the reference output with random errors at random depths: drafts of any
    length, some accepted in full, some in part, some not at all."""

    name = "oracle"

    def __init__(self, reference: list[int], seed: int) -> None:
        self.reference = reference
        self.rng = random.Random(seed)

    def propose(self, text, limit):
        truth = self.reference[len(text) : len(text) + limit]
        drafts = []
        for _ in range(self.rng.randint(0, 3)):
            draft = truth[: self.rng.randint(1, limit)] or [self.rng.randrange(3, 128)]
            if self.rng.random() < 0.6:
                draft[self.rng.randrange(len(draft))] = self.rng.randrange(3, 128)
            drafts.append(Draft(tuple(draft), self.name, self.rng.randint(1, 16)))
        return drafts

    def observe(self, text, new):
        pass


@given(
    family=st.sampled_from(FAMILIES),
    prompt=prompts(),
    window=st.integers(0, 7),
    ngram=st.integers(2, 6),
    guesses=st.integers(0, 7),
    suffix=st.sampled_from([0, 1, 8, 32]),
    recycle=st.sampled_from([0, 1, 4]),
    budget=st.booleans(),
    oracle_seed=st.none() | st.integers(0, 2**16),
    max_new_tokens=st.integers(1, 48),
    data=st.data(),
)
def test_fuzz_identical_to_greedy(family, prompt, window, ngram, guesses, suffix, recycle, budget, oracle_seed,
                                  max_new_tokens, data):
    """Every tested family x random (W, N, G), suffix and recycle sources and budget x random drafts of random lengths x
    random prompt, length and EOS ids, greedy: token-identical to transformers' `generate`. Examples: 50 in
    the quick tier, 1,000 in the full one (conftest)."""
    model = _cached_model(family)
    ids = torch.tensor([prompt])
    free_run = reference_greedy(model, ids, max_new_tokens, eos_token_id=[])[0, len(prompt):].tolist()
    # EOS: none, the model's own (generation config), or one or more ids the output does contain.
    eos_choice = data.draw(st.sampled_from(["none", "model", "from output"]), label="eos")
    eos = {"none": [], "model": None}.get(eos_choice)
    if eos_choice == "from output":
        eos = data.draw(st.lists(st.sampled_from(free_run + [0]), min_size=1, max_size=3, unique=True), label="eos ids")
    expected = reference_greedy(model, ids, max_new_tokens, eos_token_id=eos)
    config = LookaheadConfig(window=window, ngram=ngram, guesses=guesses, suffix=suffix, recycle=recycle,
                             budget=budget)
    oracle = [] if oracle_seed is None else [NoisyOracle(prompt + free_run, oracle_seed)]
    stops = {} if eos is None else {"eos_token_id": eos}  # the model's left out: None given would mean none
    out = generate(model, ids, max_new_tokens=max_new_tokens, config=config, proposers=oracle, **stops)
    assert out.sequences.tolist() == expected.tolist()


_MODELS: dict[str, torch.nn.Module] = {}


def _cached_model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = make_tiny_model(family)
    return _MODELS[family]


def test_default_config_is_the_automatic_one(llama_tiny, monkeypatch):
    """config=None decodes with AUTO_CONFIG. (Which drafts a step feeds also depends on the step times the
    engine observes, so tokens per step may differ between two calls.)"""
    from lookahead.config import AUTO_CONFIG
    from lookahead.core import decoder

    configs = []
    original = decoder.LookaheadDecoder.__init__
    monkeypatch.setattr(decoder.LookaheadDecoder, "__init__",
                        lambda self, config, *args, **kwargs: configs.append(config) or original(self, config, *args, **kwargs))
    prompt = random_prompt(20, 19)
    implicit = generate(llama_tiny, prompt, max_new_tokens=30)
    explicit = generate(llama_tiny, prompt, max_new_tokens=30, config=AUTO_CONFIG)
    assert implicit.sequences.tolist() == explicit.sequences.tolist() == reference_greedy(llama_tiny, prompt, 30).tolist()
    assert configs == [AUTO_CONFIG, AUTO_CONFIG]


needs_native = pytest.mark.skipif(kernels.library() is None, reason="our kernel needs AVX-512 and a C compiler")
PACKERS = ["mkl", "onednn", pytest.param("native", marks=needs_native)]


@pytest.mark.parametrize("packer", [*PACKERS, None])
def test_packed_linear_path_is_exact_and_leaves_the_model_as_it_was(tiny_model, packer, monkeypatch):
    """packed_linear=True through each packer (the only one offered), and False."""
    monkeypatch.setattr(PackedLinears, "packers", staticmethod(lambda model: (packer,)))
    prompt = random_prompt(25, 23)
    expected = reference_greedy(tiny_model, prompt, 40)
    out = generate(tiny_model, prompt, max_new_tokens=40, config=LookaheadConfig(), packed_linear=packer is not None)
    assert torch.equal(out.sequences, expected)
    linears = [m for m in tiny_model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" not in vars(m) for m in linears)


@pytest.mark.parametrize("packer", PACKERS)
def test_a_linear_whose_forward_another_library_set_keeps_it(tiny_model, packer, monkeypatch):
    """A forward set on a layer's instance by someone else (accelerate's hooks do so) is not packed over nor
    removed: it runs in our steps, and the output is still greedy's."""
    monkeypatch.setattr(PackedLinears, "packers", staticmethod(lambda model: (packer,)))
    hooked = next(m for m in tiny_model.modules() if type(m) is torch.nn.Linear)
    calls: list[int] = []

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[-2])
        return torch.nn.Linear.forward(hooked, x)

    hooked.forward = counting
    try:
        prompt = random_prompt(25, 23)
        expected = reference_greedy(tiny_model, prompt, 30)
        before = len(calls)
        out = generate(tiny_model, prompt, max_new_tokens=30, config=LookaheadConfig(), packed_linear=True)
        assert torch.equal(out.sequences, expected)
        assert len(calls) > before and vars(hooked)["forward"] is counting
    finally:
        del hooked.forward


@pytest.mark.parametrize("packer", PACKERS)
def test_a_packed_forward_computes_the_linear_layer(packer):
    """Each packer's forward, for 1-130 rows in leading dimensions of any shape, with and without a bias, is
    the linear layer's (features that fill no whole panel of our kernel's included); it is set on the layer
    inside `active()` only."""
    generator = torch.Generator().manual_seed(0)
    for bias, features in ((True, 80), (False, 80), (True, 37), (False, 5)):
        linear = torch.nn.Linear(48, features, bias=bias)
        packed = PackedLinears(linear, packer)
        for shape in [(1, 48), (1, 3, 48), (2, 4, 48), (5, 48), (9, 48), (64, 48), (2, 65, 48)]:
            x = torch.randn(shape, generator=generator)
            with packed.active():
                assert "forward" in vars(linear)
                torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
            assert "forward" not in vars(linear)


@needs_native
def test_our_kernel_computes_every_row_count_and_panel_remainder():
    """Each block of rows (1-8 at a time) against each run of panels (1-4 of 16 features at a time) that the
    kernel dispatches to, the last panel full or not."""
    generator = torch.Generator().manual_seed(0)
    for features in (5, 16, 23, 32, 48, 55, 64, 80, 96, 119):
        weight, bias = torch.randn(features, 40, generator=generator), torch.randn(features, generator=generator)
        packed = kernels.pack(weight)
        for rows in range(1, 20):
            x = torch.randn(rows, 40, generator=generator)
            torch.testing.assert_close(kernels.linear(x, packed, bias, features),
                                       torch.nn.functional.linear(x, weight, bias), msg=f"{rows} x {features}")


@needs_native
def test_our_kernel_is_a_torch_operator_that_refuses_what_it_cannot_compute():
    """`torch.ops.lookahead.linear_f32` (registered from C++) is the linear layer, and names the problem with a
    float64 input, a weight packed for another input size or not in panels of 16, or a bias of the wrong length."""
    weight, bias, x = torch.randn(40, 24), torch.randn(40), torch.randn(2, 3, 24)
    packed = kernels.pack(weight)
    torch.testing.assert_close(torch.ops.lookahead.linear_f32(x, packed, bias, 40),
                               torch.nn.functional.linear(x, weight, bias))
    with pytest.raises(RuntimeError, match="float32 input"):
        kernels.linear(x.double(), packed, bias, 40)
    with pytest.raises(RuntimeError, match="does not fit an input of 23"):
        kernels.linear(x[..., :23], packed, bias, 40)
    with pytest.raises(RuntimeError, match=r"packed weight \[6, 24, 8\] does not fit"):
        kernels.linear(x, packed.view(3, 24, 2, 8).transpose(1, 2).reshape(6, 24, 8).contiguous(), bias, 40)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 tensor of 40 features"):
        kernels.linear(x, packed, bias[:39], 40)


class _SharedInput(torch.nn.Module):
    """Three linears on one input (as a layer's query, key and value), one on another; `order` picks the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(48, n) for n in (64, 16, 16))
        self.out = torch.nn.Linear(48, 48)

    def forward(self, x: torch.Tensor, order: str = "qkv") -> list[torch.Tensor]:
        return [getattr(self, name)(x) for name in order] + [self.out(x * 2)]


@pytest.mark.parametrize("packer", PACKERS[1:])
def test_linears_called_on_one_input_run_as_one_stacked_linear(packer):
    """oneDNN's packs and ours: after the first forward, the linears that took the same input run as one
    linear over their weights stacked, each member's output its own layer's, whatever the order of the calls,
    a member called twice, or on another input; the linear on another input stays apart; the MKL packer never
    stacks."""
    module = _SharedInput()
    packed = PackedLinears(module, packer)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 48, generator=generator)
    with packed.active():
        first = module(x)  # each linear on its own pack, the inputs noted
    for got, linear, inputs in zip(first, [module.q, module.k, module.v, module.out], [x, x, x, x * 2]):
        torch.testing.assert_close(got, torch.nn.functional.linear(inputs, linear.weight, linear.bias))
    assert [group.members for group in packed.groups] == [[module.q, module.k, module.v]]
    for order in ("qkv", "vkq", "kk", "qvqk", "v"):
        x = torch.randn(2, 3, 48, generator=generator)
        with packed.active():
            outputs = module(x, order)
            other = module.k(x + 1)  # another input after the group's
        expected = [torch.nn.functional.linear(x, getattr(module, n).weight, getattr(module, n).bias) for n in order]
        for got, want in zip(outputs, expected + [module.out(x * 2)]):
            torch.testing.assert_close(got, want)
            assert got.is_contiguous()
        torch.testing.assert_close(other, torch.nn.functional.linear(x + 1, module.k.weight, module.k.bias))
    assert all(group._output is None for group in packed.groups)  # nothing held between forwards
    mkl = PackedLinears(module, "mkl")
    with mkl.active():
        module(x)
    assert mkl.groups == []


@pytest.mark.parametrize("packer", PACKERS)
def test_another_threads_forward_runs_the_models_own_linears_while_ours_are_active(packer):
    """While a forward of ours has our packs active, transformers' own forward of the same model in another
    thread (its `generate` beside a server's engine) runs the model's own linears; and a second forward of
    ours, from another thread, waits for the first to finish."""
    module = _SharedInput()
    packed = PackedLinears(module, packer)
    x = torch.randn(2, 3, 48)
    with packed.active():
        module(x)  # the linears that share an input found (oneDNN's packs and ours)
    calls: list[torch.nn.Module] = []
    packed._forwards = [(m, lambda x, m=m, f=f: calls.append(m) or f(x)) for m, f in packed._forwards]
    packed._guarded = None
    own = module(x)
    theirs: list[list[torch.Tensor]] = []
    trying, holding, seen = threading.Event(), [False], []

    def ours_too() -> None:
        trying.set()
        with packed.active():
            seen.append(holding[0])  # True: it got in while the first thread's forward still held ours

    with packed.active():
        holding[0] = True
        module(x)
        assert calls  # ours, in the thread that made them active
        calls.clear()
        thread = threading.Thread(target=lambda: theirs.append(module(x)))
        thread.start()
        thread.join()
        second = threading.Thread(target=ours_too)
        second.start()
        assert trying.wait(10)
        time.sleep(0.3)  # time for it to reach `active()`: without the wait there, it would get in meanwhile
        holding[0] = False
    second.join()
    assert seen == [False]  # it waited for the first to finish
    assert calls == []  # the other thread's forward ran none of ours
    for got, want in zip(theirs[0], own):  # (the two threads' BLAS may split sums differently: not bit for bit)
        torch.testing.assert_close(got, want)
    assert all("forward" not in vars(m) for m, _ in packed._forwards)


def test_decoding_follows_weights_changed_in_place_since_the_last_call():
    """Our packed copies of the weights are made again when the weights change in place (a training step,
    `load_state_dict`): the next `generate` decodes with the new weights, as transformers' own does."""
    model = make_tiny_model("llama", seed=3)
    prompt = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    before = generate(model, prompt, max_new_tokens=10, packed_linear=True).sequences
    model.load_state_dict(make_tiny_model("llama", seed=4).state_dict())
    after = generate(model, prompt, max_new_tokens=10, packed_linear=True).sequences
    assert torch.equal(after, reference_greedy(model, prompt, 10))
    assert not torch.equal(after, before)


def test_a_runner_can_be_made_while_a_forward_of_ours_runs_in_another_thread(llama_tiny):
    """During a forward of ours the model's attention is ours by name (`attention.stacked_heads`): a runner
    made meanwhile (another thread's `generate`) takes it for the SDPA it stands for."""
    config = llama_tiny.config
    assert config._attn_implementation == "sdpa"
    try:
        config._attn_implementation = attention.NAME
        HFModelRunner(llama_tiny)
    finally:
        config._attn_implementation = "sdpa"


def _argmax_layer(weight: torch.Tensor) -> tuple[ArgmaxOutputLayer, list[int]]:
    """An `ArgmaxOutputLayer` over `weight`, and a list noting each call of its float32 fallback (the rows fed)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    fallbacks: list[int] = []
    full = lambda x: fallbacks.append(x.shape[-2]) or torch.nn.functional.linear(x, weight)  # noqa: E731
    return ArgmaxOutputLayer(linear, full), fallbacks


def _near_ties(seed: int, rows: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A random 8192 x 64 output layer's weight and inputs whose best logits are close (median top-2 gap about
    0.3 at scale 1): bfloat16's products alone pick another token in a few rows in a hundred."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8192, 64, generator=generator) * 0.2, torch.randn(rows, 64, generator=generator) * scale


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 64), scale=st.sampled_from([0.3, 1.0, 3.0, 30.0]))
def test_argmax_output_layer_keeps_float32s_argmax(seed, rows, scale):
    """Greedy rows' output layer (bfloat16 products, float32 ones where its error bound leaves a doubt): each
    row's argmax is float32's, and so is every logit that could have been it."""
    weight, x = _near_ties(seed, rows, scale)
    layer, fallbacks = _argmax_layer(weight)
    logits, expected = layer(x.unsqueeze(0))[0], torch.nn.functional.linear(x, weight)
    assert logits.shape == expected.shape and not fallbacks
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    near = expected >= expected.amax(-1, keepdim=True) - 0.01 * scale
    torch.testing.assert_close(logits[near], expected[near])


def test_argmax_output_layer_corrects_bfloat16s_wrong_picks():
    """Where bfloat16's products alone pick another token than float32's (3 rows of these 64), the layer does not."""
    weight, x = _near_ties(0, 64, 1.0)
    layer, _ = _argmax_layer(weight)
    expected = torch.nn.functional.linear(x, weight).argmax(-1)
    approximate = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float().argmax(-1)
    assert (approximate != expected).sum() == 3
    assert torch.equal(layer(x).argmax(-1), expected)


def test_argmax_output_layer_runs_float32_where_too_many_tokens_are_in_doubt():
    """Rows so alike that every token might be the argmax: the float32 product, as it is."""
    weight = torch.ones(256, 32) + torch.randn(256, 32, generator=torch.Generator().manual_seed(0)) * 1e-4
    layer, fallbacks = _argmax_layer(weight)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight)) and fallbacks == [3]


def test_greedy_steps_alone_read_the_argmax_output_layer(llama_tiny, monkeypatch):
    """Where the output layer is faster so (forced here), greedy decoding runs through it and stays identical to
    `generate`; a sampling request's steps never do (it reads every logit)."""
    calls: list[int] = []
    original = ArgmaxOutputLayer.__call__
    monkeypatch.setattr(ArgmaxOutputLayer, "__call__", lambda self, x: calls.append(x.shape[-2]) or original(self, x))
    monkeypatch.setattr(ArgmaxOutputLayer, "of", classmethod(lambda cls, model, packed: cls(
        model.get_output_embeddings(), packed[model.get_output_embeddings()])))
    monkeypatch.setattr(PackedLinears, "packers", staticmethod(lambda model: ("onednn",)))
    monkeypatch.setitem(hf_module._PACKED, llama_tiny, {})  # packs made afresh, with the layer forced
    prompt = random_prompt(25, 29)
    generate(llama_tiny, prompt, max_new_tokens=2, packed_linear=True)  # the cost curve measured (and cached)
    calls.clear()
    out = generate(llama_tiny, prompt, max_new_tokens=40, packed_linear=True)
    assert torch.equal(out.sequences, reference_greedy(llama_tiny, prompt, 40))
    assert len(calls) == out.stats.steps and sum(calls) > out.stats.steps  # taller steps too
    calls.clear()
    generate(llama_tiny, prompt, max_new_tokens=20, config=LookaheadConfig(), packed_linear=True, do_sample=True,
             generator=torch.Generator().manual_seed(3))
    assert calls == []


def test_packed_linear_refused_where_unsupported():
    model = make_tiny_model("llama").to(torch.float16)
    with pytest.raises(ValueError, match="packed_linear=True needs a model on CPU, unsharded, with 4-bit layers"):
        generate(model, [5, 6, 7], packed_linear=True)

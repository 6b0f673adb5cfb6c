"""The engine's padded steps (`runner.ragged` False: ragged_steps off, compile=True, or attention that is not
SDPA on a CPU): prompt chunks of several joining requests padded to the tallest one in a forward of their own,
the prefill budget counting the padding, slots freed and reused while others prefill, aborts mid-prefill.
Every request's tokens are transformers' greedy output of its prompt alone."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import _COMMON, make_tiny_model, peaked
from transformers import LlamaConfig, LlamaForCausalLM

from lookahead import LookaheadConfig
from lookahead.engine import Engine, RequestParams

CONFIGS = [None, LookaheadConfig(window=0, guesses=0), LookaheadConfig(window=3, ngram=3, guesses=3)]


@functools.cache
def _model():
    return make_tiny_model("llama")


@functools.cache
def _reference(prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _model().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def _engine(max_batch: int, max_length: int) -> Engine:
    return Engine(_model(), max_batch=max_batch, max_length=max_length)


def padded_engine(max_batch: int, max_length: int, prefill_chunk: int) -> Engine:
    """An engine (one per shape, reused: the cost curves are measured once) whose steps run padded."""
    engine = _engine(max_batch, max_length)
    assert not engine.has_unfinished()
    engine.runner.ragged_steps = False
    engine.prefill_chunk = prefill_chunk
    assert not engine.runner.ragged
    return engine


class Watch:
    """Records every prompt-chunk forward (its chunks, each request's slot and prefilled count) and checks the
    prefill budget counted the padding and that the padding fits every slot's store."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.forwards: list[list[tuple[int, int, int, int]]] = []  # (request id, slot, prefilled, chunk)
        feed = engine._feed_prompts

        def feed_and_check(chunks):
            height = max(c for _, c in chunks)
            if len(chunks) > 1:
                assert height * len(chunks) <= engine.prefill_chunk
            assert all(r.prefilled + height <= engine.store.capacity for r, _ in chunks)
            self.forwards.append([(r.id, r.slot, r.prefilled, c) for r, c in chunks])
            return feed(chunks)

        monkeypatch.setattr(engine, "_feed_prompts", feed_and_check)


def drive(engine: Engine, schedule, aborts=()) -> dict[int, list[int]]:
    """schedule: (step, prompt, max_new_tokens, config) per request; aborts: (step, index into schedule).
    Steps until all is done; checks each request not aborted against its greedy output."""
    pending = sorted(enumerate(schedule), key=lambda item: item[1][0])
    aborts = sorted(aborts)
    ids, outputs, finished, aborted = {}, {}, set(), set()
    step = 0
    try:
        _steps(engine, pending, aborts, ids, outputs, finished, aborted, step)
    finally:  # a failure leaves nothing behind in the shared engine
        for rid in list(engine.running_ids()) + [r.id for r in engine._waiting]:
            engine.abort(rid)
    assert engine.store.lengths == [0] * engine.max_batch
    for index, (_, prompt, new, _) in enumerate(schedule):
        if index not in aborted:
            assert outputs.get(index, []) == _reference(tuple(prompt), new), index
    return outputs


def _steps(engine, pending, aborts, ids, outputs, finished, aborted, step) -> None:
    while pending or aborts or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            index, (_, prompt, new, config) = pending.pop(0)
            ids[index] = engine.add_request(prompt, RequestParams(max_new_tokens=new, eos_token_id=[], config=config))
        while aborts and aborts[0][0] <= step:
            _, index = aborts.pop(0)
            if index in ids and index not in finished and index not in aborted:
                assert engine.abort(ids[index])
                aborted.add(index)
        by_id = {rid: index for index, rid in ids.items()}
        for output in engine.step():
            assert output.error is None
            index = by_id[output.request_id]
            assert index not in aborted
            outputs.setdefault(index, []).extend(output.tokens)
            if output.finished:
                finished.add(index)
        step += 1
        assert step < 1000


@pytest.mark.parametrize("prefill_chunk", [1, 2, 3, 7, 16])
def test_joining_prompts_padded_to_the_tallest_chunk_inside_the_budget(prefill_chunk, monkeypatch):
    """Four prompts join at once under a tight max_length: their chunks go together only while the padded rows
    fit the budget; the last chunks (shorter ones padded) complete prompts that decode in the same step."""
    engine = padded_engine(4, 24, prefill_chunk)
    watch = Watch(engine, monkeypatch)
    lengths = [2, 9, 20, 5]
    drive(engine, [(0, prompt_of(n, n), 24 - n, CONFIGS[i % 3]) for i, n in enumerate(lengths)])
    assert watch.forwards
    if prefill_chunk == 16:  # the 2-token prompt's chunk beside the 9-token one's, padded to 8 rows
        assert any(len(f) > 1 for f in watch.forwards)
    fed = {}
    for forward in watch.forwards:
        for rid, _, prefilled, chunk in forward:
            assert prefilled == fed.get(rid, 0)
            fed[rid] = prefilled + chunk
    assert sorted(fed.values()) == sorted(n - 1 for n in lengths if n > 1)


def test_a_prompt_at_max_length_beside_others_prefilling_and_decoding(monkeypatch):
    """Prompts of max_length - 1 tokens (one new token) join while others decode and others prefill."""
    engine = padded_engine(3, 20, 7)
    Watch(engine, monkeypatch)
    drive(engine, [(0, prompt_of(3, 1), 17, None), (1, prompt_of(19, 2), 1, None), (1, prompt_of(18, 3), 2, None),
                   (2, prompt_of(19, 4), 1, CONFIGS[2]), (4, prompt_of(1, 5), 19, None)])


def test_a_request_moved_below_an_earlier_one_still_prefilling(monkeypatch):
    """A short request finishes (aborted) while two later ones prefill: the newest moves into its slot, below the
    older one, and their chunks (fed in the order the requests came) go to slots out of order."""
    engine = padded_engine(3, 40, 4)
    watch = Watch(engine, monkeypatch)
    # Step 1: the 7-token prompt's first chunk alone (beside the other's, padded, it would take 8 rows); step 2:
    # the first request gone, the newest moves to slot 0, and both last chunks (2 rows each) go together.
    drive(engine, [(0, prompt_of(1, 1), 30, None), (1, prompt_of(7, 2), 10, None), (1, prompt_of(3, 3), 12, None)],
          aborts=[(2, 0)])
    assert any([slot for _, slot, _, _ in f] == [1, 0] for f in watch.forwards)


def test_abort_in_the_middle_of_prefill_frees_the_slot_for_a_waiting_request(monkeypatch):
    engine = padded_engine(2, 32, 3)
    watch = Watch(engine, monkeypatch)
    drive(engine, [(0, prompt_of(20, 1), 8, None), (0, prompt_of(9, 2), 20, CONFIGS[2]),
                   (1, prompt_of(11, 3), 15, None), (2, prompt_of(4, 4), 10, None)], aborts=[(2, 0), (3, 2)])
    assert watch.forwards


@pytest.mark.slow  # 20-25 s; a review ran 900 such schedules (with eager attention and compiled steps too)
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_schedule_of_padded_steps_gives_each_request_its_greedy_output(data):
    max_batch = data.draw(st.integers(1, 4), "max_batch")
    max_length = data.draw(st.sampled_from([21, 30]), "max_length")
    prefill_chunk = data.draw(st.sampled_from([1, 2, 3, 7]), "prefill_chunk")
    engine = padded_engine(max_batch, max_length, prefill_chunk)
    schedule = []
    for index in range(data.draw(st.integers(1, 5), "requests")):
        length = data.draw(st.integers(1, 20))
        new = data.draw(st.integers(1, max_length - length))
        schedule.append((data.draw(st.integers(0, 8)), prompt_of(length, 1000 + 37 * index + length), new,
                         data.draw(st.sampled_from(CONFIGS))))
    aborts = data.draw(st.lists(st.tuples(st.integers(0, 10), st.integers(0, len(schedule) - 1)), max_size=2))
    drive(engine, schedule, aborts)


def test_padding_that_would_overrun_a_slots_store_waits_for_a_forward_of_its_own(monkeypatch):
    """A long prompt's last chunk (1 row) beside a new prompt's 512-row one: padded to 512 rows after 1024
    cached positions it would overrun the first slot (capacity 1040 + 256), so they go in forwards of their own."""
    torch.manual_seed(0)
    model = peaked(LlamaForCausalLM(LlamaConfig(**{**_COMMON, "max_position_embeddings": 2048})), 0.15)
    engine = Engine(model, max_batch=2, max_length=1040, prefill_chunk=1024)
    engine.runner.ragged_steps = False
    watch = Watch(engine, monkeypatch)
    long, short = prompt_of(1026, 1), prompt_of(513, 2)
    params = RequestParams(max_new_tokens=6, config=LookaheadConfig(window=0, guesses=0), eos_token_id=[])
    ids = [engine.add_request(long, params)]
    engine.step()
    ids.append(engine.add_request(short, params))
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.tokens)
    assert [len(f) for f in watch.forwards] == [1, 1, 1]  # 1024 rows, then 1 (not padded to 512), then 512
    for rid, prompt in zip(ids, (long, short)):
        ids_ = torch.tensor([prompt])
        with torch.no_grad():
            expected = model.generate(ids_, attention_mask=torch.ones_like(ids_), max_new_tokens=6, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert outputs[rid] == expected

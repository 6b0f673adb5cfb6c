"""The recycle source: the successor table against a replay of what it was taught, its drafts, the decoder
feeding it every logit row's top tokens, and a corpus sharing it across calls."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lookahead import Corpus, LookaheadConfig, generate
from lookahead.core.decoder import LookaheadDecoder
from lookahead.core.recycle import RECYCLED_DEPTH, RecycleProposer, SuccessorTable
from lookahead.core.verify import top_tokens

from conftest import reference_greedy
from test_exact_tiny import random_prompt

tokens = st.integers(0, 6)
lessons = st.lists(st.tuples(st.lists(tokens, min_size=1, max_size=4),
                             st.lists(st.lists(tokens, min_size=1, max_size=3), min_size=4, max_size=4)), max_size=6)


def _replayed(taught) -> dict[int, tuple[int, ...]]:
    """What the table should hold: each token's predictions from the last row that had it as input."""
    latest: dict[int, tuple[int, ...]] = {}
    for inputs, predicted in taught:
        for token, successors in zip(inputs, predicted):
            latest[token] = tuple(successors)
    return latest


@given(taught=lessons, first=tokens, length=st.integers(1, 12))
def test_the_table_keeps_the_latest_predictions_and_chains_their_best(taught, first, length):
    table = SuccessorTable()
    for inputs, predicted in taught:
        table.learn(inputs, predicted)
    latest = _replayed(taught)
    assert len(table) == len(latest)
    assert all(table.successors(token) == latest.get(token, ()) for token in range(7))
    expected = [first]  # by hand: follow each token's best successor while there is one
    while len(expected) < length and latest.get(expected[-1]):
        expected.append(latest[expected[-1]][0])
    assert table.chain(first, length) == tuple(expected)


def test_drafts_branch_at_the_first_two_tokens_up_to_the_branches_and_depth():
    table = SuccessorTable()
    table.learn([5, 6, 7, 8], [(6, 7, 8), (7, 8, 5), (8, 5), (6,)])
    chains = [(6, 7, 8, 6), (6, 8, 6, 7), (7, 8, 6, 7), (8, 6, 7, 8)]  # 6 best after 5, then 8 best after 6's 7
    assert [d.tokens for d in RecycleProposer(table, branches=3).propose([1, 5], 4)] == chains
    assert all(d.source == "recycle" for d in RecycleProposer(table, branches=3).propose([1, 5], 4))
    assert [d.tokens for d in RecycleProposer(table, branches=2).propose([1, 5], 4)] == [chains[0], chains[2]]
    assert [d.tokens for d in RecycleProposer(table, branches=3).propose([1, 5], 2)] == [(6, 7), (6, 8), (7, 8), (8, 6)]
    assert [d.tokens for d in RecycleProposer(table, branches=3).propose([1, 5], 1)] == [(6,), (7,), (8,)]
    assert RecycleProposer(table, branches=1).propose([5], 100)[0].tokens == ((6, 7, 8) * 10)[:RECYCLED_DEPTH]
    assert RecycleProposer(table, branches=3).propose([1, 2], 4) == []  # nothing was ever predicted after 2


def test_the_decoder_teaches_the_table_every_logit_rows_top_tokens_after_its_input():
    vocab = 16
    config = LookaheadConfig(window=2, ngram=3, guesses=2, recycle=3)
    decoder = LookaheadDecoder(config, [5, 6, 7, 5, 6, 8, 5])
    plan = decoder.plan()
    inputs = plan.tokens[plan.layout.logit_rows].tolist()
    logits = torch.randn(len(inputs), vocab, generator=torch.Generator().manual_seed(0))
    decoder.update(plan, logits)
    top = logits.topk(3, dim=-1).indices.tolist()
    assert {token: decoder.recycle.table.successors(token) for token in inputs} == _replayed([(inputs, top)])
    assert any(d.source == "recycle" for d in decoder.propose().drafts) == bool(
        decoder.recycle.table.successors(decoder.sequence[-1]))


def test_without_the_recycle_source_no_table_is_kept():
    decoder = LookaheadDecoder(LookaheadConfig(window=0, recycle=0), [1, 2, 3])
    assert decoder.recycle is None and [p.name for p in decoder.proposers] == ["pool"]


def test_a_corpus_shares_the_predictions_across_calls_and_clear_forgets_them(llama_tiny):
    prompt = random_prompt(20, 7)
    config = LookaheadConfig(window=0, ngram=3, guesses=2, recycle=2)
    corpus = Corpus()
    out = generate(llama_tiny, prompt, max_new_tokens=12, config=config, corpus=corpus)
    assert torch.equal(out.sequences, reference_greedy(llama_tiny, prompt, 12))
    assert len(corpus.successors) > 0  # the call's predictions stayed with the corpus
    # A later request over the same corpus starts with them: its first step can draft from the table.
    later = LookaheadDecoder(config, out.sequences[0].tolist(), corpus=corpus)
    assert later.recycle.table is corpus.successors
    corpus.clear()
    assert len(corpus.successors) == 0
    # A request still running keeps its table: had clear emptied it in place, that request would go on filling
    # the table of the cleared corpus, whose next model (of a smaller vocabulary, say) got ids past its own.
    assert later.recycle.table is not corpus.successors and len(later.recycle.table) > 0
    assert LookaheadDecoder(config, [1, 2, 3], corpus=corpus).recycle.table is corpus.successors


def _a_request_one_step_in(model):
    """An engine whose request (12 tokens, drafting from a new corpus) has taken its first step; its text so far."""
    from lookahead.engine import Engine, RequestParams

    prompt = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])
    corpus = Corpus()
    engine = Engine(model, max_batch=1, max_length=64)
    engine.add_request(prompt, RequestParams(max_new_tokens=12, eos_token_id=[], corpus=corpus,
                                             config=LookaheadConfig(window=3, ngram=3, guesses=3, suffix=8)))
    return engine, corpus, prompt, prompt.tolist() + [t for out in engine.step() for t in out.tokens]


@pytest.mark.parametrize("next_vocabulary", [1000, 64])
def test_a_request_running_when_its_corpus_is_cleared_drafts_from_it_no_more_and_adds_nothing(llama_tiny,
                                                                                            next_vocabulary):
    """The corpus, cleared mid-request, then serves a model of another vocabulary. Its new text continued the request's
    with ids past the request's model (its suffix source had drafted them: an IndexError in the embedding), or the
    request's text fell outside the new vocabulary (its add at the end raised, the output lost)."""
    engine, corpus, prompt, text = _a_request_one_step_in(llama_tiny)
    corpus.clear()
    corpus.serve(next_vocabulary)
    if next_vocabulary > 128:
        corpus.add(text + [500, 501, 502, 503])  # another model's text, continuing this one's
    held = corpus.tokens
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            text += out.tokens
    assert text == reference_greedy(llama_tiny, prompt.view(1, -1), 12, eos_token_id=[])[0].tolist()
    assert corpus.tokens == held  # nothing of the request's


@given(rows=st.integers(1, 6), vocab=st.integers(4, 40), count=st.integers(1, 4), seed=st.integers(0, 2**16),
       levels=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_top_tokens_start_with_the_argmax_and_hold_the_largest_scores(rows, vocab, count, seed, levels, dtype):
    """Few distinct values, so ties are common: column 0 must still be torch's argmax (the first maximum),
    which greedy verification relies on; the rest are the next largest scores, no token twice."""
    scores = torch.randint(0, levels, (rows, vocab), generator=torch.Generator().manual_seed(seed)).to(dtype)
    top = top_tokens(scores, count)
    assert top.shape == (rows, count)
    assert torch.equal(top[:, 0], scores.argmax(dim=-1))
    picked = scores.gather(1, top)
    assert torch.equal(picked, scores.topk(count, dim=-1).values)  # the largest scores, best first
    assert all(len(set(row)) == count for row in top.tolist())


def test_a_clear_by_another_thread_lands_before_or_after_a_step_of_the_suffix_source_never_inside(llama_tiny,
                                                                                                 monkeypatch):
    """Another thread clears the corpus, serves a model of a larger vocabulary and adds its text, right after the
    request's suffix source checked the corpus's epoch (forced here): it had then matched in the new text, drafting
    ids past its own model's vocabulary (an IndexError in the embedding). The check is now made under the lock."""
    import threading

    from lookahead.core import suffix
    engine, corpus, prompt, text = _a_request_one_step_in(llama_tiny)
    checked, others = suffix.SuffixProposer._corpus_in_use, []

    def check_then_clear(self) -> bool:
        in_use = checked(self)
        if in_use and not others:
            def clear_and_refill() -> None:
                corpus.clear()
                corpus.serve(1000)
                corpus.add(text + [500, 501, 502, 503])
            others.append(threading.Thread(target=clear_and_refill))
            others[0].start()
            others[0].join(0.5)  # it waits for the lock where the check holds it
        return in_use

    monkeypatch.setattr(suffix.SuffixProposer, "_corpus_in_use", check_then_clear)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            text += out.tokens
    others[0].join()
    assert text == reference_greedy(llama_tiny, prompt.view(1, -1), 12, eos_token_id=[])[0].tolist()


def test_a_clear_by_another_thread_while_a_request_is_added_leaves_the_corpus_free_for_any_model(llama_tiny,
                                                                                                monkeypatch):
    """Another thread clears the corpus (to serve another tokenizer's model) just after the request's decoder is
    made: the request's serve() had then bound the cleared corpus to its model's vocabulary, and the model the clear
    was for was refused. The request is now added under the corpus's lock, the clear landing before or after."""
    import threading

    from lookahead import engine as engine_module
    from lookahead.engine import Engine, RequestParams

    corpus, others = Corpus(), []
    made = engine_module.LookaheadDecoder

    def made_then_cleared(*args, **kwargs):
        decoder = made(*args, **kwargs)
        others.append(threading.Thread(target=corpus.clear))
        others[-1].start()
        others[-1].join(0.5)
        return decoder

    monkeypatch.setattr(engine_module, "LookaheadDecoder", made_then_cleared)
    Engine(llama_tiny, max_batch=1, max_length=64).add_request(
        torch.tensor([5, 6, 7, 8]), RequestParams(max_new_tokens=4, eos_token_id=[], corpus=corpus))
    others[0].join()
    assert corpus.vocabulary is None and corpus.epoch == 1
    corpus.serve(1000)  # the model the clear was for

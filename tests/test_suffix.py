"""The suffix source: the automaton and the corpus matcher against brute-force search, the corpus's bound,
and the drafts the source proposes."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.core.drafts import Draft
from lookahead.core.suffix import BYTES_PER_TOKEN, Corpus, MatchCursor, SuffixAutomaton, SuffixProposer, continuation

texts = st.lists(st.integers(0, 3), min_size=1, max_size=40)  # a small alphabet: many repeats


def occurrences(text: list[int], pattern: list[int]) -> list[int]:
    """End positions of every occurrence of `pattern` in `text`, by brute force."""
    size = len(pattern)
    return [end for end in range(size - 1, len(text)) if text[end - size + 1 : end + 1] == pattern]


@given(text=texts)
@settings(max_examples=200)
def test_earlier_matches_are_the_longest_earlier_occurrences(text):
    automaton = SuffixAutomaton()
    for end in range(len(text)):
        automaton.append(text[end])
        prefix = text[: end + 1]
        earlier = [length for length in range(1, end + 1) if occurrences(prefix[:-1], prefix[end + 1 - length :])]
        matches = automaton.earlier_matches(100)
        assert [length for length, _ in matches[:1]] == [max(earlier)] if earlier else matches == []
        lengths = [length for length, _ in matches]
        assert lengths == sorted(set(lengths), reverse=True)
        for length, position in matches:  # the first occurrence of that suffix, which ends before the text does
            assert position == occurrences(prefix, prefix[end + 1 - length :])[0] < end


@given(other=texts, text=texts)
@settings(max_examples=200)
def test_cursor_finds_the_longest_suffix_that_occurs_in_the_other_text(other, text):
    cursor = MatchCursor(SuffixAutomaton(other))
    for end in range(len(text)):
        cursor.feed([text[end]])
        prefix = text[: end + 1]
        longest = max(length for length in range(len(prefix) + 1) if length == 0 or occurrences(other, prefix[-length:]))
        assert cursor.length == longest
        for length, position in cursor.matches(10):
            assert other[position - length + 1 : position + 1] == prefix[-length:]


def test_continuation_stops_at_the_limit_the_end_and_separators():
    tokens = [5, 6, 7, 8, -2, 9, 10]
    assert continuation(tokens, 0, 2) == (6, 7)
    assert continuation(tokens, 1, 10) == (7, 8)  # a separator ends the document
    assert continuation(tokens, 4, 10) == (9, 10)
    assert continuation(tokens, 1, 10, stop=3) == (7,)


def test_suffix_source_drafts_the_continuation_of_the_longest_match():
    text = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 7, 1, 2, 3]
    source = SuffixProposer()
    source.observe(text, len(text))
    drafts = source.propose(text, 4)
    assert drafts[0].tokens == (4, 5, 9, 9) and drafts[0].context == 3 and drafts[0].source == "suffix"
    assert [d.context for d in drafts] == sorted((d.context for d in drafts), reverse=True)
    assert len({d.tokens for d in drafts}) == len(drafts)


def test_corpus_drafts_come_from_earlier_documents_and_never_cross_them():
    corpus = Corpus()
    corpus.add([10, 11, 12, 13, 14])
    corpus.add([20, 21, 22])
    source = SuffixProposer(corpus)
    text = [5, 11, 12]
    source.observe(text, len(text))
    assert [(d.tokens, d.source, d.context) for d in source.propose(text, 8)][0] == ((13, 14), "corpus", 2)
    text.append(22)
    source.observe(text, 1)
    assert source.propose(text, 8) == []  # 22 ends its document: nothing follows it there


def test_corpus_added_mid_request_is_matched_from_the_text_end():
    corpus = Corpus()
    source = SuffixProposer(corpus)
    text = [7, 8]
    source.observe(text, 2)
    corpus.add([8, 9, 1, 2])  # e.g. another request finished meanwhile
    text.append(9)
    source.observe(text, 1)
    assert [(d.tokens, d.context) for d in source.propose(text, 4)] == [((1, 2), 2)]  # matched [8, 9], not only [9]


def test_corpus_keeps_the_newest_documents_within_its_cap():
    corpus = Corpus(max_megabytes=50 * BYTES_PER_TOKEN / 2**20)  # room for 50 tokens
    for start in range(0, 100, 20):
        corpus.add(list(range(start, start + 19)))  # 20 tokens each with the separator
    assert corpus.tokens <= corpus.max_tokens == 50
    assert len(corpus) == 1  # the fifth did not fit beside the third and fourth: down to 3/4 of the cap
    cursor = MatchCursor(corpus.automaton)
    cursor.feed([80, 81])
    assert cursor.length == 2  # the newest documents are still there
    cursor.feed([0, 1])
    assert cursor.length == 0  # the oldest are gone
    corpus.clear()
    assert corpus.tokens == 0 and len(corpus) == 0


@pytest.mark.parametrize("text", ["random", "one token repeated"])
def test_bytes_per_token_bounds_a_corpus_memory(text):
    """Random text makes about one automaton state a token; documents each of one token repeated, two (the worst
    case: such a corpus had grown to 1.15x its cap). Ids as a tensor's `tolist` gives them: an int object each."""
    import torch

    rng = random.Random(0)
    documents = [[rng.randrange(50000) for _ in range(500)] if text == "random" else [40000 + i] * 500
                 for i in range(40)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    corpus = Corpus()
    for document in documents:
        corpus.add(torch.tensor(document).tolist())
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert corpus.tokens == 40 * 501 and len(corpus.automaton.length) > (1.9 if text != "random" else 1) * 20000
    assert used / corpus.tokens <= BYTES_PER_TOKEN


@pytest.mark.parametrize("value", [0, -1, "8", True, float("nan"), float("inf")])
def test_corpus_cap_must_be_positive(value):
    with pytest.raises(ValueError, match=r"max_megabytes must be a number in \(0, 2\*\*40\]"):
        Corpus(max_megabytes=value)


@pytest.mark.parametrize("value", ["int64", "float32", 1e308])
def test_a_corpus_cap_may_be_any_real_number_and_a_huge_one_is_refused(value):
    import numpy as np

    if value == 1e308:  # refused as a value, not by an OverflowError
        with pytest.raises(ValueError, match=r"max_megabytes must be a number in \(0, 2\*\*40\], got 1e\+308"):
            Corpus(max_megabytes=value)
    else:
        assert Corpus(max_megabytes=getattr(np, value)(2)).max_tokens == Corpus(max_megabytes=2).max_tokens


def test_a_corpus_cap_too_small_for_one_token_is_refused_and_the_smallest_holds_one():
    smallest = 2 * BYTES_PER_TOKEN / 2**20
    with pytest.raises(ValueError, match=rf"max_megabytes must hold at least one token \({smallest:.4f} MB"):
        Corpus(max_megabytes=1.5 * BYTES_PER_TOKEN / 2**20)  # room for 1 token: the separator alone
    corpus = Corpus(max_megabytes=2 * BYTES_PER_TOKEN / 2**20)
    corpus.add([5, 6, 7])
    assert corpus.tokens == 2 and corpus.automaton.tokens[1:] == [7]  # the newest token, after its separator


def test_threads_adding_to_one_corpus_leave_it_the_automaton_of_its_documents():
    """Two threads adding documents at once, switching every microsecond so that they interleave inside an add: the
    corpus holds every document, and its automaton is the one built afresh over them. Without its lock, the
    tokens and suffix links parted from a fresh build's (and two `generate` calls sharing a small corpus raised
    "deque mutated during iteration" from an eviction)."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    corpus = Corpus()

    def add(offset: int) -> None:
        for i in range(3000):
            corpus.add([offset + i % 50, offset + i * 7 % 50, 3])

    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=add, args=(offset,)) for offset in (0, 100)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    fresh = SuffixAutomaton()
    for document in corpus._documents:
        fresh.append(-1 - len(fresh))
        fresh.extend(document)
    assert len(corpus) == 6000 and corpus.automaton.tokens == fresh.tokens and corpus.automaton.link == fresh.link


def _chain(other: list[int], text: list[int], longest: int) -> list[tuple[int, int]]:
    """By brute force: (length, end of its first occurrence in `other`) for each suffix length of `text` up to
    `longest` whose occurrences in `other` differ from those of the suffix one longer, longest first."""
    def ends(length):
        return occurrences(other, text[len(text) - length :]) if length <= min(longest, len(text)) else []
    return [(length, ends(length)[0]) for length in range(longest, 0, -1) if ends(length) != ends(length + 1)]


def test_cursor_and_earlier_matches_list_every_distinct_match_up_to_most():
    rng = random.Random(0)
    for _ in range(60):
        other = [rng.randrange(3) for _ in range(rng.randrange(1, 25))]
        text = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        cursor = MatchCursor(SuffixAutomaton(other))
        cursor.feed(text)
        full = _chain(other, text, cursor.length)
        assert cursor.matches(100) == full
        for most in range(len(full) + 1):
            assert cursor.matches(most) == full[:most]
        # in the text itself: the suffixes that also end earlier (the whole text's own occurrence left out)
        automaton = SuffixAutomaton(other)
        earlier = [(length, end) for length, end in _chain(other, other, len(other)) if end < len(other) - 1]
        assert automaton.earlier_matches(100) == earlier
        for most in range(len(earlier) + 1):
            assert automaton.earlier_matches(most) == earlier[:most]


def test_continuation_keeps_token_zero():
    assert continuation([0, 0, 1, -3, 2], 0, 5) == (0, 1)  # 0 is a token id like any other; only negatives separate
    assert continuation([4, 0], 0, 5) == (0,)


def test_suffix_source_drafts_at_most_three_branches_longest_first():
    # "1" first continues with 9, "2 1" with 8, "3 2 1" with 7, "4 3 2 1" with 6: four earlier matches
    text = [1, 9, 2, 1, 8, 3, 2, 1, 7, 4, 3, 2, 1, 6, 5, 4, 3, 2, 1]
    source = SuffixProposer()
    source.observe(text, len(text))
    assert source.propose(text, 1) == [Draft((6,), "suffix", 4), Draft((7,), "suffix", 3), Draft((8,), "suffix", 2)]


def test_own_and_corpus_drafts_are_merged_longest_match_first():
    corpus = Corpus()
    corpus.add([2, 3, 4, 50])
    source = SuffixProposer(corpus)
    text = [90, 90, 90, 90, 3, 4, 60, 90, 2, 3, 4]  # "3 4" also ends at 5 in the text; "2 3 4" is in the corpus
    source.observe(text, len(text))
    assert source.propose(text, 2) == [Draft((50,), "corpus", 3), Draft((60, 90), "suffix", 2)]


def test_corpus_default_cap_is_64_megabytes():
    assert Corpus().max_tokens == int(64 * 2**20 / BYTES_PER_TOKEN)


def test_corpus_keeps_exactly_the_newest_documents_that_fit(monkeypatch):
    """Reference: each document keeps its last max_tokens - 1 tokens (one more for its separator); documents
    are added while they fit in max_tokens; one that does not fit drops the oldest, down to the longest run of
    newest documents that fits in three quarters of it (the newest one always kept). The automaton is built
    again only then."""
    corpus = Corpus(max_megabytes=200 * BYTES_PER_TOKEN / 2**20)
    assert corpus.max_tokens == 200
    rebuilds = []
    rebuild = corpus._rebuild
    monkeypatch.setattr(corpus, "_rebuild", lambda: rebuilds.append(1) or rebuild())
    rng = random.Random(0)
    kept: list[list[int]] = []
    for _ in range(600):
        size = rng.choice([0, 1, 2, 5, 10, 18, 19, 23, 24, 25, 26, 30, 47, 48, 49, 50, 51, 60, 100, 149, 150, 151,
                           199, 200, 300])
        document = [rng.randrange(1000) for _ in range(size)]
        before = len(rebuilds)
        corpus.add(document)
        kept.append(document[-199:])
        total = sum(len(d) + 1 for d in kept)
        evicting = total > 200
        while evicting and len(kept) > 1 and total > 150:
            total -= len(kept.pop(0)) + 1
        assert len(rebuilds) == before + evicting
        held = corpus.automaton.tokens
        assert len(corpus) == len(kept) and corpus.tokens == total <= corpus.max_tokens
        assert [t for t in held if t >= 0] == [t for d in kept for t in d]
        assert [t >= 0 for t in held] == [flag for d in kept for flag in [False] + [True] * len(d)]
        separators = [t for t in held if t < 0]
        assert len(set(separators)) == len(separators)  # distinct: no match runs across a separator


def test_corpus_version_changes_on_every_add_and_clear():
    corpus = Corpus()
    versions = [corpus.version]
    for step in range(6):
        corpus.clear() if step % 3 == 2 else corpus.add([step])
        versions.append(corpus.version)
    assert len(set(versions)) == len(versions)


def test_the_source_follows_every_change_of_the_corpus():
    # the source is made after one document was added
    corpus = Corpus()
    corpus.add([1, 2, 3, 4])
    source = SuffixProposer(corpus)
    text = [9, 1, 2]
    source.observe(text, 3)
    assert source.propose(text, 4) == [Draft((3, 4), "corpus", 2)]
    corpus.clear()
    text.append(3)
    source.observe(text, 1)
    assert source.propose(text, 4) == []  # the cleared document is gone

    # cleared and refilled between two observations: the new text is not for a request begun before (it may be of
    # another model's vocabulary); one begun after drafts from it
    corpus = Corpus()
    corpus.add([1, 2, 3, 4])
    source = SuffixProposer(corpus)
    text = [9, 1, 2]
    source.observe(text, 3)
    corpus.clear()
    corpus.add([2, 7, 8])
    text.append(7)
    source.observe(text, 1)
    assert source.propose(text, 4) == []
    later = SuffixProposer(corpus)
    later.observe(text, len(text))
    assert later.propose(text, 4) == [Draft((8,), "corpus", 2)]  # "2 7", matched in the new document

    # a second document added between two observations: the text's end is matched afresh
    corpus = Corpus()
    corpus.add([1, 2, 3, 4])
    source = SuffixProposer(corpus)
    text = [9, 8]
    source.observe(text, 2)
    corpus.add([8, 7, 6, 5])
    text.append(7)
    source.observe(text, 1)
    assert source.propose(text, 4) == [Draft((6, 5), "corpus", 2)]  # "8 7", not only "7"


def test_corpus_match_grows_past_64_tokens_and_restarts_from_the_last_64():
    document = list(range(100, 200))
    corpus = Corpus()
    corpus.add(document)
    source = SuffixProposer(corpus)
    text = [1] + document[:10]
    source.observe(text, len(text))
    for token in document[10:80]:
        text.append(token)
        source.observe(text, 1)
    assert source.propose(text, 3) == [Draft((180, 181, 182), "corpus", 80)]  # matched token by token
    corpus.add([5])  # a changed corpus: the text's end is matched afresh, from its last 64 tokens
    text.append(180)
    source.observe(text, 1)
    assert source.propose(text, 3) == [Draft((181, 182, 183), "corpus", 64)]


def test_a_corpus_rebuilt_between_observe_and_propose_is_matched_afresh():
    corpus = Corpus(max_megabytes=10 * BYTES_PER_TOKEN / 2**20)  # room for 10 tokens
    corpus.add([1, 2, 3, 4])
    source = SuffixProposer(corpus)
    text = [9, 1, 2]
    source.observe(text, len(text))
    corpus.add([70, 1, 2, 73, 74, 75])  # evicts the first document and rebuilds, e.g. another request ended
    assert source.propose(text, 8) == [Draft((73, 74, 75), "corpus", 2)]


@given(documents=st.lists(texts, min_size=1, max_size=3), added=texts, text=texts)
@settings(max_examples=200)
def test_corpus_drafts_match_as_long_as_they_say_after_a_document_is_added_before_propose(documents, added, text):
    """A document added in place splits automaton states under the text's last match; every corpus draft must
    still continue an occurrence of the text's last `context` tokens (by brute force)."""
    corpus = Corpus()
    for document in documents:
        corpus.add(document)
    source = SuffixProposer(corpus)
    source.observe(text, len(text))
    corpus.add(added)
    held = corpus.automaton.tokens
    for draft in source.propose(text, 4):
        if draft.source == "corpus":
            pattern = text[len(text) - draft.context :] if draft.context <= len(text) else None
            assert pattern is not None and any(
                tuple(held[end + 1 : end + 1 + len(draft.tokens)]) == draft.tokens
                for end in occurrences(held, pattern)), draft


def test_a_corpus_takes_token_ids_as_lists_arrays_or_tensors_and_refuses_anything_else():
    import numpy as np
    import torch

    corpus = Corpus(max_megabytes=1)
    assert corpus.largest_token == -1  # nothing held
    for document in ([3, 7, 2], (4, 1), np.array([5, 6]), torch.tensor([8, 0]), []):
        corpus.add(document)
    assert [list(d) for d in corpus._documents] == [[3, 7, 2], [4, 1], [5, 6], [8, 0], []]
    assert corpus.largest_token == 8
    for bad in ([1, -1], [1, True], [1, 2.0], [[1, 2]], "12", torch.tensor([[1, 2]]), 5):
        with pytest.raises(ValueError, match=r"a corpus document must be a 1-D sequence of token ids \(integers >= 0\)"
                                             rf".*; got {type(bad).__name__}"):
            corpus.add(bad)
    assert len(corpus._documents) == 5  # nothing of a refused document was kept
    version = corpus.version
    corpus.clear()
    assert corpus.largest_token == -1 and corpus.version == version + 1


def test_an_empty_document_holds_no_token_id():
    corpus = Corpus(max_megabytes=1)
    corpus.add([])
    assert corpus.largest_token == -1  # still none held
    corpus.add([0])
    corpus.add([])
    assert corpus.largest_token == 0


def test_a_refused_corpus_document_is_told_what_a_document_is_in_full():
    with pytest.raises(ValueError) as refused:
        Corpus(max_megabytes=1).add([1, -1])
    assert str(refused.value) == ("a corpus document must be a 1-D sequence of token ids (integers >= 0), e.g. a "
                                  "tokenizer's input_ids for one text; got list")


def test_a_corpus_serves_one_vocabulary_and_refuses_ids_outside_it():
    """At the boundaries: the largest id a vocabulary of 10 takes is 9 (survivors of a mutation run, checked
    only through `generate` before)."""
    corpus = Corpus()
    corpus.add([3, 9])
    with pytest.raises(ValueError, match=r"the corpus holds token id 9, outside the model's vocabulary \[0, 9\)"):
        corpus.serve(9)
    assert corpus.vocabulary is None
    corpus.check(10)  # a check binds nothing
    assert corpus.vocabulary is None
    corpus.serve(10)
    corpus.serve(10)  # the same size again
    assert corpus.vocabulary == 10
    with pytest.raises(ValueError, match=r"serves models of a 10-token vocabulary, and this model's has 11 tokens"):
        corpus.serve(11)
    corpus.add([])  # nothing outside it
    with pytest.raises(ValueError, match=r"a corpus document holds token id 10, outside the vocabulary \[0, 10\)"):
        corpus.add([4, 10])
    corpus.add([9, 0])
    assert Corpus(max_megabytes=2**40).max_tokens > 0  # the largest cap allowed


def test_a_corpus_match_whose_first_occurrence_ends_a_document_drafts_a_later_one():
    """The automaton kept a state's first occurrence only: one at a document's end had nothing after it, and the
    later document that goes on after the same tokens was never drafted from (in either of the two documents'
    orders below, and for the shorter match of the second corpus, a state on the suffix chain)."""
    for documents, text, draft in [([[5, 6], [5, 6, 7, 8, 9]], [1, 2, 5, 6], Draft((7, 8, 9), "corpus", 2)),
                                   ([[5, 6, 7, 8, 9], [5, 6]], [1, 2, 5, 6], Draft((7, 8, 9), "corpus", 2)),
                                   ([[5, 6], [8, 6], [5, 6, 7]], [9, 6], Draft((7,), "corpus", 1))]:
        corpus = Corpus()
        for document in documents:
            corpus.add(document)
        source = SuffixProposer(corpus)
        source.observe(text, len(text))
        assert source.propose(text, 8) == [draft], documents


@given(documents=st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=4),
       text=st.lists(st.integers(0, 3), min_size=1, max_size=12))
@settings(max_examples=300)
def test_the_longest_corpus_match_drafts_whenever_one_of_its_occurrences_goes_on(documents, text):
    """By brute force: where some occurrence of the text's longest match in the corpus has a token after it in its
    document, a draft continues one such occurrence (a corpus draft, or the same tokens drafted from the text)."""
    corpus = Corpus()
    for document in documents:
        corpus.add(document)
    source = SuffixProposer(corpus, branches=1)
    source.observe(text, len(text))
    held = corpus.automaton.tokens
    longest = max((n for n in range(1, len(text) + 1) if occurrences(held, text[-n:])), default=0)
    continuations = {continuation(held, end, 4) for end in occurrences(held, text[len(text) - longest :])} - {()}
    drafts = source.propose(text, 4)
    assert bool(continuations & {d.tokens for d in drafts}) == bool(longest and continuations), (drafts, continuations)

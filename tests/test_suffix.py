"""The suffix source: the automaton and the corpus matcher against brute-force search, the corpus's bound,
and the drafts the source proposes."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    assert len(corpus) == 2
    cursor = MatchCursor(corpus.automaton)
    cursor.feed([60, 61])
    assert cursor.length == 2  # the newest documents are still there
    cursor.feed([0, 1])
    assert cursor.length == 0  # the oldest are gone
    corpus.clear()
    assert corpus.tokens == 0 and len(corpus) == 0


def test_bytes_per_token_bounds_the_automaton_memory():
    tokens = [random.Random(0).randrange(1000) for _ in range(20000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    automaton = SuffixAutomaton(tokens)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(automaton) == 20000
    assert used / 20000 <= BYTES_PER_TOKEN


@pytest.mark.parametrize("value", [0, -1, "8", True])
def test_corpus_cap_must_be_positive(value):
    with pytest.raises(ValueError, match="max_megabytes must be a number > 0"):
        Corpus(max_megabytes=value)

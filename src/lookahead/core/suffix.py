"""Suffix automata over token sequences: the longest earlier match of a growing text, found in amortised
O(1) per appended token, and its continuation as a draft of any length."""

from __future__ import annotations

import threading
from collections import deque
from contextlib import nullcontext
from collections.abc import Iterable, Sequence

from ..arguments import checked_number, integer
from .drafts import Draft
from .recycle import SuccessorTable


class SuffixAutomaton:
    """The suffix automaton of a token sequence that grows at its end (Blumer et al., 1985).

    Each state stands for a set of substrings that end at the same positions; `end[s]` is where the
    first occurrence of state s's substrings ends (a later one where the first ends a document, before a separator:
    a corpus's), `length[s]` the longest of them, `link[s]` the state of
    the longest suffix that ends at more positions. Appending a token is amortised O(1).
    """

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self.length = [0]
        self.link = [-1]
        self.end = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.last = 0  # the state of the whole sequence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        position = len(self.tokens)
        self.tokens.append(token)
        current = self._new_state(self.length[self.last] + 1, position)
        state = self.last
        while state != -1 and token not in self.next[state]:
            self.next[state][token] = current
            state = self.link[state]
        if state == -1:
            self.link[current] = 0
        else:
            following = self.next[state][token]
            if self.length[state] + 1 == self.length[following]:
                self.link[current] = following
            else:  # split: the shorter strings of `following` also end here
                clone = self._new_state(self.length[state] + 1, self.end[following])
                self.next[clone] = dict(self.next[following])
                self.link[clone] = self.link[following]
                while state != -1 and self.next[state].get(token) == following:
                    self.next[state][token] = clone
                    state = self.link[state]
                self.link[following] = self.link[current] = clone
            self._move_off_document_ends(self.link[current], position)
        self.last = current

    def _move_off_document_ends(self, state: int, position: int) -> None:
        """States on the suffix chain from `state` (whose strings all end at `position` too) that end a document,
        a separator after them, get this occurrence: one at a document's end has no continuation to draft."""
        while state > 0 and self.end[state] + 1 < position and self.tokens[self.end[state] + 1] < 0:
            self.end[state] = position
            state = self.link[state]

    def _new_state(self, length: int, end: int) -> int:
        self.length.append(length)
        self.link.append(-1)
        self.end.append(end)
        self.next.append({})
        return len(self.length) - 1

    def earlier_matches(self, most: int) -> list[tuple[int, int]]:
        """Up to `most` (match length, end position) pairs, longest first: suffixes of the whole sequence
        that also end at an earlier position, each with the end of its first occurrence."""
        found: list[tuple[int, int]] = []
        state = self.link[self.last]
        while state > 0 and len(found) < most:
            found.append((self.length[state], self.end[state]))
            state = self.link[state]
        return found


class MatchCursor:
    """The longest suffix of a text (fed token by token) that occurs in another sequence's automaton:
    matching statistics, amortised O(1) per token."""

    def __init__(self, automaton: SuffixAutomaton) -> None:
        self.automaton = automaton
        self.state = 0
        self.length = 0

    def feed(self, tokens: Iterable[int]) -> None:
        automaton = self.automaton
        for token in tokens:
            while self.state > 0 and token not in automaton.next[self.state]:
                self.state = automaton.link[self.state]
                self.length = automaton.length[self.state]
            following = automaton.next[self.state].get(token)
            if following is None:
                self.state, self.length = 0, 0
            else:
                self.state, self.length = following, self.length + 1

    def matches(self, most: int) -> list[tuple[int, int]]:
        """Up to `most` (match length, end position in the other sequence), longest first."""
        found: list[tuple[int, int]] = []
        state, length = self.state, self.length
        automaton = self.automaton
        while state > 0 and len(found) < most:
            found.append((length, automaton.end[state]))
            state = automaton.link[state]
            length = automaton.length[state]
        return found


def continuation(tokens: Sequence[int], end: int, limit: int, stop: int | None = None) -> tuple[int, ...]:
    """The up to `limit` tokens after position `end`, not reaching `stop` (default: the sequence's end)
    and not crossing a document separator (a negative token)."""
    stop = len(tokens) if stop is None else stop
    out: list[int] = []
    for token in tokens[end + 1 : min(stop, end + 1 + limit)]:
        if token < 0:
            break
        out.append(token)
    return tuple(out)


# Memory of one token of a `Corpus` at worst: two automaton states a token (documents each of one token repeated),
# each a dict and three list slots, 704 bytes measured with tracemalloc; random text over a vocabulary of 1,000 to
# 152,064 ids takes 440-470 bytes (tests/test_suffix.py checks it stays an upper bound on both). 600 had let a corpus
# of one token repeated grow to 1.15x its cap.
BYTES_PER_TOKEN = 720


class Corpus:
    """Text shared across `generate` calls, so that a request drafts from earlier requests' prompts and
    outputs (the same document, the same codebase). Bounded: past `max_megabytes` the oldest documents
    are dropped first, down to three quarters of the cap. Documents are kept apart by separators, so no
    match crosses two of them. `successors`: the model's predictions after each token, shared the same way by the recycle source
    (one entry per vocabulary token at most, outside the cap). It serves the models of one vocabulary: the
    first request's model sets its size (`serve`), and a model of another size is refused. Threads may share it:
    `lock` is held while it changes and while a request matches in it (a document is added in place)."""

    KEPT_AFTER_EVICTION = 0.75

    def __init__(self, max_megabytes: float = 64.0) -> None:
        checked_number("max_megabytes", max_megabytes, lambda v: 0 < v <= 2**40, "a number in (0, 2**40]")
        self.max_tokens = int(max_megabytes * 2**20 / BYTES_PER_TOKEN)
        if self.max_tokens < 2:  # a separator and one token
            raise ValueError(f"max_megabytes must hold at least one token ({2 * BYTES_PER_TOKEN / 2**20:.4f} MB, "
                             f"at {BYTES_PER_TOKEN} bytes a token), got {max_megabytes!r}")
        self._documents: deque[tuple[int, ...]] = deque()
        self.automaton = SuffixAutomaton()
        self.successors = SuccessorTable()
        self.version = 0  # changes whenever the automaton is replaced or grows
        # Changes at every clear(): requests begun before it neither draft from nor add to what it holds since.
        self.epoch = 0
        self.largest_token = -1  # the largest token id held (-1: none)
        self.vocabulary: int | None = None  # the vocabulary size of the models it serves (None: none yet)
        self.lock = threading.RLock()

    def add(self, tokens: Sequence[int]) -> None:
        """Add one document: token ids (a sequence of ints, or a 1-D array or tensor of them); the oldest
        documents go if the corpus outgrows its cap. Raises ValueError for anything else, and for ids
        outside the vocabulary it serves."""
        tokens = _token_ids(tokens)
        with self.lock:
            if self.vocabulary is not None and max(tokens, default=-1) >= self.vocabulary:
                raise ValueError(f"a corpus document holds token id {max(tokens)}, outside the vocabulary [0, "
                                 f"{self.vocabulary}) of the models this corpus serves")
            document = tuple(tokens[-self.max_tokens + 1 :]) if len(tokens) >= self.max_tokens else tuple(tokens)
            self._documents.append(document)
            if len(self.automaton) + len(document) + 1 > self.max_tokens:
                # Down to the newest documents that fit in KEPT_AFTER_EVICTION of the cap (the newest always): the
                # automaton is built again over all that is kept (0.2 s at the default cap), so once per quarter of
                # the cap added, not at every document once the corpus is full (a server adds one per reply).
                held = sum(len(d) + 1 for d in self._documents)
                keep = int(self.max_tokens * self.KEPT_AFTER_EVICTION)
                while len(self._documents) > 1 and held > keep:
                    held -= len(self._documents.popleft()) + 1
                self._rebuild()
            else:
                self._append(document)
            self.version += 1

    def clear(self) -> None:
        """Empty, as new: it may then serve the models of another vocabulary. Requests begun before no longer draft
        from it, nor add their text to it (`epoch`)."""
        with self.lock:
            self._documents.clear()
            # A new table, not the old one emptied: requests still running on it (of a model of another
            # vocabulary, maybe) go on teaching theirs, and their predictions must not reach the models served next.
            self.successors = SuccessorTable()
            self._rebuild()
            self.vocabulary = None
            self.version += 1
            self.epoch += 1

    def serve(self, vocabulary: int) -> None:
        """Serve a model of a vocabulary of this size from now on (a request's, before it drafts from the
        corpus). Raises ValueError as `check` does."""
        with self.lock:
            self.check(vocabulary)
            self.vocabulary = vocabulary

    def check(self, vocabulary: int) -> None:
        """Raise ValueError where the corpus serves another vocabulary size, or holds ids outside this one: the ids
        of one tokenizer mean nothing to another, and a draft of ids past a model's vocabulary cannot be fed."""
        if self.vocabulary is None and self.largest_token < vocabulary:
            return
        if self.vocabulary is None:
            raise ValueError(f"the corpus holds token id {self.largest_token}, outside the model's vocabulary "
                             f"[0, {vocabulary}): a corpus serves the models of one tokenizer")
        elif self.vocabulary != vocabulary:
            raise ValueError(f"the corpus serves models of a {self.vocabulary}-token vocabulary, and this model's "
                             f"has {vocabulary} tokens: a corpus serves the models of one tokenizer")

    @property
    def tokens(self) -> int:
        """Tokens held, separators included."""
        return len(self.automaton)

    def __len__(self) -> int:
        """Documents held."""
        return len(self._documents)

    def _append(self, document: tuple[int, ...]) -> None:
        self.automaton.append(-1 - len(self.automaton))  # a separator no other position shares
        self.automaton.extend(document)
        self.largest_token = max(self.largest_token, max(document, default=-1))

    def _rebuild(self) -> None:
        self.automaton = SuffixAutomaton()
        self.largest_token = -1
        for document in self._documents:
            self._append(document)


def _token_ids(tokens: object) -> list[int]:
    """`tokens` as a list of ints >= 0 (arrays and tensors through `tolist`)."""
    given = tokens
    if hasattr(tokens, "tolist") and not isinstance(tokens, (list, tuple)):
        tokens = tokens.tolist()
    ids = [integer(t) for t in tokens] if isinstance(tokens, (list, tuple)) else [None]
    if None in ids or any(t < 0 for t in ids):
        raise ValueError("a corpus document must be a 1-D sequence of token ids (integers >= 0), e.g. a "
                         f"tokenizer's input_ids for one text; got {type(given).__name__}")
    return ids


class SuffixProposer:
    """Drafts from the longest earlier occurrences of the text's end: in the text itself (prompt and
    output so far) and, with a corpus, in earlier requests. Several branches, longest match first; each
    draft is the continuation of one occurrence, up to the step's limit."""

    name = "suffix"

    def __init__(self, corpus: Corpus | None = None, branches: int = 3) -> None:
        self.own = SuffixAutomaton()
        self.corpus = corpus
        self._epoch = corpus.epoch if corpus is not None else 0
        self.branches = branches
        self._cursor: MatchCursor | None = None
        self._corpus_version = -1

    def observe(self, text: Sequence[int], new: int) -> None:
        tokens = text[len(text) - new :]
        self.own.extend(tokens)
        corpus = self.corpus
        if corpus is not None:
            with corpus.lock:  # the epoch read under the lock: a clear() cannot land between the check and the use
                if self._corpus_in_use() and not self._rematched(text):
                    self._cursor.feed(tokens)

    def _corpus_in_use(self) -> bool:
        """Whether the proposer drafts from a corpus: one cleared since it began is dropped for good (it holds
        other requests' text now, of another model's vocabulary maybe)."""
        if self.corpus is not None and self.corpus.epoch != self._epoch:
            self.corpus, self._cursor = None, None
        return self.corpus is not None

    def _rematched(self, text: Sequence[int]) -> bool:
        """Whether the corpus changed since the text was last matched in it, and its end was matched afresh:
        a document added in place splits automaton states, which leaves an old cursor's lengths wrong."""
        if self._corpus_version == self.corpus.version:
            return False
        self._cursor = MatchCursor(self.corpus.automaton)
        self._corpus_version = self.corpus.version
        self._cursor.feed(text[-64:])
        return True

    def propose(self, text: Sequence[int], limit: int) -> list[Draft]:
        corpus = self.corpus
        found = [(self.own.tokens, length, end, "suffix") for length, end in self.own.earlier_matches(self.branches)]
        drafts: list[Draft] = []
        seen: set[tuple[int, ...]] = set()
        with corpus.lock if corpus is not None else nullcontext():  # the epoch read under the lock, as in observe
            if self._corpus_in_use():
                self._rematched(text)  # e.g. another request ended and added its text since this one's last step
                found += [(self._cursor.automaton.tokens, length, end, "corpus")  # the automaton it matched in
                          for length, end in self._cursor.matches(self.branches)]
            for tokens, length, end, source in sorted(found, key=lambda f: -f[1]):
                draft = continuation(tokens, end, limit)
                if draft and draft not in seen:
                    seen.add(draft)
                    drafts.append(Draft(draft, source, length))
        return drafts

"""The server's reply text: stop strings cut it even when they complete across steps (quick, no model)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lookahead.serve import _Reply, _stop_started


class _Pieces:
    """A tokenizer whose token i decodes to PIECES[i]."""

    PIECES = ["\n    if", " n", " <", "=", " 1", "\u00e9"]

    def decode(self, ids: list[int], **options) -> str:
        return "".join(self.PIECES[i] for i in ids)


def _sent(steps: list[list[int]], stops: list[str]) -> tuple[str, bool]:
    reply = _Reply(_Pieces(), stops)
    text = "".join(reply.add(tokens, finished=index == len(steps) - 1) for index, tokens in enumerate(steps))
    return text, reply.stopped


def test_a_stop_string_that_completes_in_a_later_step_is_not_sent():
    assert _sent([[0, 1], [2, 3]], ["n <"]) == ("\n    if ", True)  # " n" held back, then cut
    assert _sent([[0], [1], [2], [3]], ["n <"]) == ("\n    if ", True)
    assert _sent([[0, 1, 2, 3]], ["n <"]) == ("\n    if ", True)


def test_a_held_back_tail_is_sent_when_it_turns_out_not_to_be_a_stop_string_or_the_reply_ends():
    reply = _Reply(_Pieces(), ["n >"])
    assert reply.add([0, 1]) == "\n    if "  # the "n" may start "n >": held back
    assert reply.add([2]) == "n <"  # it did not
    assert _sent([[0], [1]], ["n >"]) == ("\n    if n", False)  # the request ended: nothing held back
    assert _sent([[4], [5]], []) == (" 1\u00e9", False)


def test_a_reply_cut_by_a_stop_string_counts_the_tokens_up_to_the_one_that_completed_it():
    """Usage counts the reply's tokens: where a step brought tokens past a stop string, not those."""
    for steps in ([[0, 1, 2, 3, 4]], [[0], [1, 2, 3, 4]], [[0, 1], [2], [3, 4]]):
        reply = _Reply(_Pieces(), ["n <"])
        for tokens in steps:
            reply.add(tokens)
        assert reply.stopped and reply.tokens == 3  # "\n    if", " n", " <"
    reply = _Reply(_Pieces(), ["n >"])
    reply.add([0, 1, 2, 3, 4], finished=True)
    assert not reply.stopped and reply.tokens == 5


class _Texts:
    """A tokenizer whose token i decodes to TEXTS[i]."""

    TEXTS = ["Answer: 42", "\n", "\n\n", "###", " Next", "#", "a"]

    def decode(self, ids: list[int], **options) -> str:
        return "".join(self.TEXTS[i] for i in ids)


def _reply_in_steps(ids: list[int], cuts: list[int], stops: list[str]) -> tuple[str, bool, int]:
    reply = _Reply(_Texts(), stops)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    steps = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
    text = ""
    for index, tokens in enumerate(steps):
        text += reply.add(tokens, finished=index == len(steps) - 1)
        if reply.stopped:
            break
    return text, reply.stopped, reply.tokens


def test_several_stop_strings_cut_where_the_first_to_complete_does_however_the_tokens_arrive():
    """An earlier-listed stop string that starts later in the text must not cut first: one that completed before
    it is what ends the reply (text and usage), as when tokens arrive one a step."""
    ids, stops = [0, 2, 3, 4], ["\n###", "\n\n"]
    assert _reply_in_steps(ids, [1, 2, 3], stops) == ("Answer: 42", True, 2)
    assert _reply_in_steps(ids, [], stops) == ("Answer: 42", True, 2)
    assert _reply_in_steps(ids, [2], stops) == ("Answer: 42", True, 2)


@given(ids=st.lists(st.integers(0, len(_Texts.TEXTS) - 1), max_size=12),
       cuts=st.lists(st.integers(0, 12), max_size=6),
       stops=st.lists(st.sampled_from(["\n###", "\n\n", "##", "# N", "a\n", "Next", "42\n"]), max_size=3))
def test_a_reply_is_the_same_however_its_tokens_are_grouped_into_steps(ids, cuts, stops):
    assert _reply_in_steps(ids, cuts, stops) == _reply_in_steps(ids, list(range(len(ids))), stops)


class _Bytes:
    """A byte-level tokenizer: token i is byte i; a character cut between tokens decodes to U+FFFD. Counts the
    tokens it is asked to decode."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: list[int], **options) -> str:
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


class _Words:
    """A SentencePiece-like tokenizer: token i is WORDS[i]; a text's leading space is dropped."""

    WORDS = [" Hello", " world", ",", " caf", "\u00e9", " \u4e16\u754c", "!"]

    def decode(self, ids: list[int], **options) -> str:
        text = "".join(self.WORDS[i] for i in ids)
        return text[1:] if text.startswith(" ") else text


def _streamed(tokenizer, ids: list[int], cuts: list[int], stops: list[str] = ()) -> str:
    reply = _Reply(tokenizer, list(stops))
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    steps = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
    return "".join(reply.add(tokens, finished=index == len(steps) - 1) for index, tokens in enumerate(steps))


@given(text=st.text(max_size=40), cuts=st.lists(st.integers(0, 160), max_size=12))
def test_a_streamed_reply_is_its_whole_decoded_text_even_with_characters_split_across_steps(text, cuts):
    ids = list(text.encode("utf-8"))
    assert _streamed(_Bytes(), ids, cuts) == text


def test_a_reply_held_at_a_split_character_sends_it_once_complete():
    reply = _Reply(_Bytes(), [])
    euro = list("\u20ac".encode("utf-8"))  # 3 bytes
    assert reply.add([ord("a")]) == "a"
    assert reply.add([euro[0]]) == ""
    assert reply.add([euro[1]]) == ""
    assert reply.add([euro[2], ord("b")]) == "\u20acb"
    assert reply.add([euro[0]], finished=True) == "\ufffd"  # the reply ended inside a character: as decoded


@given(ids=st.lists(st.integers(0, len(_Words.WORDS) - 1), max_size=12), cuts=st.lists(st.integers(0, 12), max_size=6))
def test_a_streamed_reply_keeps_the_spaces_a_tokenizer_drops_at_the_start_of_a_text(ids, cuts):
    assert _streamed(_Words(), ids, cuts) == _Words().decode(ids)


def test_a_long_reply_is_decoded_a_few_tokens_at_a_time_not_whole_at_each_step():
    tokenizer = _Bytes()
    reply = _Reply(tokenizer, ["STOP"])
    text = "".join(reply.add([byte]) for byte in ("\u00e9t\u00e9 " * 1000).encode("utf-8"))
    assert text == "\u00e9t\u00e9 " * 1000
    assert tokenizer.decoded < 4 * 6000  # decoded whole at each step: ~18 million tokens


def test_a_stop_string_completed_by_a_step_that_ends_inside_a_character_counts_its_own_tokens():
    """The step completing "b" ends inside the next character, whose text waits: the cut and the usage are still
    those of the token that completed it, not of a later step's."""
    euro = list("\u20ac".encode("utf-8"))
    for steps in ([[ord("a")], [ord("b"), euro[0]], euro[1:]], [[ord("a"), ord("b"), euro[0]], euro[1:]]):
        reply = _Reply(_Bytes(), ["b", "b\u20ac"])
        text = "".join(reply.add(tokens) for tokens in steps)
        assert (text, reply.stopped, reply.tokens) == ("a", True, 2)


@given(text=st.text(alphabet="ab \u00e9\u20ac\U0001F600", max_size=12), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="ab \u00e9\u20ac\U0001F600", min_size=1, max_size=3), max_size=3))
def test_a_reply_with_split_characters_cuts_at_the_same_stop_however_its_tokens_group(text, cuts, stops):
    ids = list(text.encode("utf-8"))

    def streamed(step_cuts: list[int]) -> tuple[str, bool, int]:
        reply = _Reply(_Bytes(), stops)
        bounds = [0, *sorted(set(c for c in step_cuts if 0 < c < len(ids))), len(ids)]
        steps = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
        sent = ""
        for index, tokens in enumerate(steps):
            sent += reply.add(tokens, finished=index == len(steps) - 1)
            if reply.stopped:
                break
        return sent, reply.stopped, reply.tokens

    assert streamed(cuts) == streamed(list(range(len(ids))))


def test_a_tokenizer_that_cleans_up_spaces_streams_one_text_and_cuts_at_its_stop_strings():
    """A SentencePiece-style tokenizer with the legacy clean-up of spaces (" ." -> "."), which a later token can
    undo in text already sent: the reply is decoded without it throughout, so the pieces add up and a stop
    string found in them is found again where the reply is cut (it raised StopIteration before)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.Unigram())
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    model.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    model.train_from_iterator(["Hello world . It is a test , is it ?"] * 20,
                              trainers.UnigramTrainer(vocab_size=40, special_tokens=["<unk>"], unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", clean_up_tokenization_spaces=True)
    ids = tokenizer.encode("world . It is", add_special_tokens=False)
    assert tokenizer.decode(ids) == "world. It is"  # cleaned up, whole
    reply = _Reply(tokenizer, [])
    assert "".join(reply.add([token], finished=i == len(ids) - 1) for i, token in enumerate(ids)) == "world . It is"
    reply = _Reply(tokenizer, [" ."])
    assert "".join(reply.add([token]) for token in ids) == "world" and reply.stopped


@given(st.text("ab ", max_size=14), st.lists(st.text("ab ", min_size=1, max_size=7), max_size=4))
def test_the_tail_held_back_is_the_longest_end_of_the_text_that_a_stop_string_starts_with(text, stops):
    """What `_stop_started` finds by searching for each stop string's first character, as the definition
    says it: the longest k < len(stop) with text ending in stop[:k], over every stop."""
    defined = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    assert _stop_started(text, stops) == defined

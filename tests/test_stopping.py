"""Stop strings and stopping criteria in `generate`, against transformers' `generate` with the same ones: a
sequence ends at the same token, whatever tokens lookahead's steps commit at once."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from lookahead import generate
from lookahead.prompts import encode_prompt

from conftest import reference_greedy

NEW_TOKENS = 48


class StopAtLength(StoppingCriteria):
    """Stops once a sequence holds `length` tokens; records the shapes it was called with."""

    def __init__(self, length: int) -> None:
        self.length, self.shapes = length, []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.shapes.append(tuple(input_ids.shape))
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def _their_generate(model, prompt: torch.Tensor, **options) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=NEW_TOKENS, **options)


@pytest.fixture(scope="module")
def story(default_model):
    """A prompt whose reply lookahead drafts well (a copy), the reply's ids, and stop strings taken from the
    reply: one that begins inside a token and ends inside the next, and one made of two whole tokens."""
    model, tokenizer = default_model
    prompt = encode_prompt(tokenizer, "Repeat this text exactly, twice: The small coastal town was abuzz with laughter, "
                                      "and the smell of saltwater filled the evening air as the fishing boats came home.")
    reply = reference_greedy(model, prompt, NEW_TOKENS)[0, prompt.shape[1]:].tolist()
    words = [tokenizer.decode([token]) for token in reply]
    first = next(i for i in range(4, len(reply) - 1) if min(len(words[i]), len(words[i + 1])) >= 4)
    across = (words[first] + words[first + 1])[2:-1]  # " fishing boats" -> "shing boat"
    whole = words[11] + words[12]
    return prompt, reply, [across, whole]


@pytest.mark.parametrize("which", [0, 1])
def test_a_stop_string_ends_the_reply_where_generate_ends_it(default_model, story, which):
    model, tokenizer = default_model
    prompt, reply, stops = story
    theirs = _their_generate(model, prompt, stop_strings=stops[which], tokenizer=tokenizer)
    assert theirs.shape[1] - prompt.shape[1] < NEW_TOKENS  # the string is met: the reply was cut
    ours = generate(model, prompt, max_new_tokens=NEW_TOKENS, stop_strings=stops[which], tokenizer=tokenizer)
    assert ours.sequences.tolist() == theirs.tolist()
    assert sum(ours.stats.accepted_by_source.values()) > 0  # drafts were accepted: steps of several tokens


def test_the_models_generation_config_stop_strings_end_the_reply_as_in_generate(default_model, story, monkeypatch):
    """`stop_strings=None` means the generation config's, as in `model.generate`; no test had met one (a
    generate that ignored them passed them all)."""
    model, tokenizer = default_model
    prompt, reply, stops = story
    monkeypatch.setattr(model.generation_config, "stop_strings", stops[1])
    theirs = _their_generate(model, prompt, tokenizer=tokenizer)
    assert theirs.shape[1] - prompt.shape[1] < NEW_TOKENS  # the config's string is met: the reply was cut
    ours = generate(model, prompt, max_new_tokens=NEW_TOKENS, tokenizer=tokenizer)
    assert ours.sequences.tolist() == theirs.tolist()
    assert sum(ours.stats.accepted_by_source.values()) > 0


def test_several_stop_strings_and_one_never_met(default_model, story):
    model, tokenizer = default_model
    prompt, reply, stops = story
    for given in (stops, stops[::-1], ["zebra crossing qq"]):
        theirs = _their_generate(model, prompt, stop_strings=given, tokenizer=tokenizer)
        ours = generate(model, prompt, max_new_tokens=NEW_TOKENS, stop_strings=given, tokenizer=tokenizer)
        assert ours.sequences.tolist() == theirs.tolist(), given
    assert ours.sequences[0, prompt.shape[1]:].tolist() == reply  # never met: the whole reply


def test_a_batch_stops_each_sequence_at_its_own_stop(default_model, story):
    model, tokenizer = default_model
    prompt, _, stops = story
    other = encode_prompt(tokenizer, "List three facts about the moon.")
    ours = generate(model, [prompt[0], other[0]], max_new_tokens=NEW_TOKENS, stop_strings=stops[0], tokenizer=tokenizer)
    pad = model.generation_config.pad_token_id
    for row, single in zip(ours.sequences.tolist(), (prompt, other)):
        theirs = _their_generate(model, single, stop_strings=stops[0], tokenizer=tokenizer)[0].tolist()
        assert row[: len(theirs)] == theirs and set(row[len(theirs):]) <= {pad}


def test_a_stopping_criterion_is_called_after_every_token_as_generate_calls_it(default_model, story):
    model, _ = default_model
    prompt, _, _ = story
    length = prompt.shape[1] + 17
    theirs = _their_generate(model, prompt, stopping_criteria=StoppingCriteriaList([StopAtLength(length)]))
    criterion = StopAtLength(length)
    ours = generate(model, prompt, max_new_tokens=NEW_TOKENS, stopping_criteria=[criterion])
    assert ours.sequences.tolist() == theirs.tolist() and theirs.shape[1] == length
    assert criterion.shapes == [(1, n) for n in range(prompt.shape[1] + 1, length + 1)]  # every length, in order


def test_a_criterion_may_answer_a_plain_bool(llama_tiny):
    """transformers combines criteria with `|`, so a Python bool does; it had failed here (`.any()` of a bool)."""
    def after_six(input_ids, scores):
        return input_ids.shape[1] >= 9

    theirs = llama_tiny.generate(torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=20,
                                 stopping_criteria=StoppingCriteriaList([after_six]))
    ours = generate(llama_tiny, [5, 6, 7], max_new_tokens=20, stopping_criteria=[after_six])
    assert ours.sequences.tolist() == theirs.tolist() and theirs.shape[1] == 9


def test_criteria_see_a_left_padded_row_as_generate_hands_it_to_them(llama_tiny):
    """A criterion reading the length stops a padded row where generate stops it: the row's padding is in front."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]])
    mask = (ids != 0).long()
    theirs = llama_tiny.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0,
                                 stopping_criteria=StoppingCriteriaList([StopAtLength(12)]))
    ours = generate(llama_tiny, ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                    stopping_criteria=[StopAtLength(12)])
    assert theirs.shape[1] == 12 and ours.sequences[:, :12].tolist() == theirs.tolist()
    assert set(ours.sequences[:, 12:].view(-1).tolist()) <= {0}


def test_a_callers_stop_string_criterion_takes_the_place_of_stop_strings(default_model, story):
    """As in generate: a StopStringCriteria among the caller's criteria replaces the one stop_strings would make."""
    from transformers import StopStringCriteria
    model, tokenizer = default_model
    prompt, _, stops = story
    own = StopStringCriteria(tokenizer, [stops[1]])
    theirs = _their_generate(model, prompt, stop_strings=stops[0], tokenizer=tokenizer,
                             stopping_criteria=StoppingCriteriaList([own]))
    ours = generate(model, prompt, max_new_tokens=NEW_TOKENS, stop_strings=stops[0], tokenizer=tokenizer,
                    stopping_criteria=[own])
    assert ours.sequences.tolist() == theirs.tolist()
    alone = generate(model, prompt, max_new_tokens=NEW_TOKENS, stop_strings=stops[0], tokenizer=tokenizer)
    assert alone.sequences.shape[1] != theirs.shape[1]  # the two stop strings end the reply at different tokens


def test_engine_requests_take_none_or_a_list_of_criteria(llama_tiny):
    from lookahead.engine import Engine, RequestParams
    engine = Engine(llama_tiny, max_batch=1)
    engine.add_request([5, 6, 7], RequestParams(max_new_tokens=3, stopping_criteria=None))
    with pytest.raises(TypeError, match="stopping_criteria must be a list of transformers StoppingCriteria"):
        engine.add_request([5, 6, 7], RequestParams(max_new_tokens=3, stopping_criteria=StopAtLength(5)))


def test_a_failing_criterion_fails_the_call(llama_tiny):
    def broken(input_ids, scores):
        raise RuntimeError("criterion broke")

    with pytest.raises(RuntimeError, match="criterion broke"):
        generate(llama_tiny, [5, 6, 7], max_new_tokens=4, stopping_criteria=[broken])


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"stop_strings": "\n"}, ValueError, "stop_strings need the model's tokenizer: pass tokenizer="),
        ({"stop_strings": [""], "tokenizer": "tok"}, ValueError, "stop_strings must be a non-empty string"),
        ({"stop_strings": [3], "tokenizer": "tok"}, ValueError, "stop_strings must be a non-empty string"),
        ({"stopping_criteria": "stop"}, TypeError, "stopping_criteria must be a list of transformers StoppingCriteria"),
        ({"stopping_criteria": [3]}, TypeError, "stopping_criteria must be a list of transformers StoppingCriteria"),
        ({"stopping_criteria": StopAtLength(5)}, TypeError, "stopping_criteria must be a list of transformers"),
    ],
)
def test_bad_stop_options(llama_tiny, options, error, message):
    with pytest.raises(error, match=message):
        generate(llama_tiny, [5, 6, 7], max_new_tokens=4, **options)

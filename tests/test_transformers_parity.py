"""What transformers' `generate` does around greedy search, done the same: the processors a model's generation
config asks for, the pad id of finished rows, the padding inferred without a mask, and steps at the very end
of a context of learned positions."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_tiny_model, reference_greedy
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

from lookahead import LookaheadConfig, generate

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
NEW = 24
# Draft-accepting configs: the processors must hold at tree nodes deeper than the step's first token.
CONFIGS = [None, LookaheadConfig(window=3, ngram=3, guesses=3)]


def free_run() -> list[int]:
    """The tiny model's greedy continuation of PROMPT with nothing configured, and no stop token."""
    return reference_greedy(make_tiny_model("llama"), PROMPT, NEW, eos_token_id=[])[0, PROMPT.shape[1]:].tolist()


def generation_options() -> list[tuple[str, object]]:
    """Generation-config options, each set to a value that changes the free run's greedy output."""
    free = free_run()
    repeated = next(t for i, t in enumerate(free) if t in free[:i])
    return [
        ("no_repeat_ngram_size", 2),
        ("min_new_tokens", 6),  # with the free run's second token as the stop token
        ("suppress_tokens", [free[0]]),
        ("begin_suppress_tokens", [free[0]]),
        ("bad_words_ids", [[free[0]], [free[1], free[2]]]),
        ("sequence_bias", [[[repeated], -50.0]]),
        ("repetition_penalty", 1.5),
        ("forced_eos_token_id", 3),
        # transformers hands a decoder-only model's prompt to these as its "encoder" ids; they had been ignored
        ("encoder_repetition_penalty", 1.8),
        ("encoder_no_repeat_ngram_size", 1),
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=["auto", "W3N3G3"])
def test_the_processors_of_the_models_generation_config_apply_as_in_generate(config):
    for name, value in generation_options():
        eos = [free_run()[1]] if name == "min_new_tokens" else []
        unconfigured = reference_greedy(make_tiny_model("llama"), PROMPT, NEW, eos_token_id=eos)
        model = make_tiny_model("llama")  # a model of its own: references are keyed by the generation config
        setattr(model.generation_config, name, value)
        expected = reference_greedy(model, PROMPT, NEW, eos_token_id=eos)
        assert not torch.equal(expected, unconfigured), f"{name}={value!r} leaves generate's output as it was"
        out = generate(model, PROMPT, max_new_tokens=NEW, config=config, eos_token_id=eos)
        assert out.sequences.tolist() == expected.tolist(), f"{name}={value!r}"


def test_a_length_penalty_without_stop_tokens_changes_nothing_as_in_generate():
    """`exponential_decay_length_penalty` with `eos_token_id=[]` had raised transformers' "`eos_token_id` has to
    be a list of positive integers" (an empty list becomes a float tensor); generate decodes on unchanged."""
    model = make_tiny_model("llama")
    options = dict(max_new_tokens=NEW, eos_token_id=[], exponential_decay_length_penalty=(2, 1.5))
    with torch.inference_mode():
        expected = model.generate(PROMPT, do_sample=False, **options)
    assert generate(model, PROMPT, **options).sequences.tolist() == expected.tolist() == [PROMPT[0].tolist() + free_run()]


@pytest.mark.parametrize("name, value", [("forced_bos_token_id", 128), ("forced_bos_token_id", -1),
                                         ("forced_eos_token_id", torch.tensor(3)), ("min_new_tokens", -1),
                                         ("min_new_tokens", True), ("min_length", -1), ("no_repeat_ngram_size", -1),
                                         ("encoder_no_repeat_ngram_size", -2),
                                         ("exponential_decay_length_penalty", (5, 1.1, 0))])
def test_generation_config_values_generate_takes_are_taken(name, value):
    """Values generate decodes with (a forced first token acts only on a one-token prompt; sizes and lengths of 0
    or less leave their processors out; a decay penalty reads its first two items): this session's first checks
    of the generation config had refused them (a review of the change)."""
    model = make_tiny_model("llama")
    setattr(model.generation_config, name, value)
    with torch.inference_mode():
        expected = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=8, do_sample=False,
                                  eos_token_id=[2], pad_token_id=0)
    assert generate(model, PROMPT, max_new_tokens=8, eos_token_id=[2]).sequences.tolist() == expected.tolist()


def test_a_generation_config_asking_for_another_search_is_refused():
    model = make_tiny_model("llama")
    model.generation_config.num_beams = 3
    with pytest.raises(ValueError, match=r"generation config sets num_beams=3, which lookahead does not decode with; "
                                         r"set model.generation_config.num_beams = 1"):
        generate(model, PROMPT, max_new_tokens=4)


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def test_processors_see_a_rows_left_padding_as_in_generate():
    """`generate` hands its processors the padded rows: the pad tokens count for a no-repeat n-gram, and
    `min_length` counts them (they had seen each row without its padding); its repetition penalty skips them
    (the attention mask tells it where they are). The pad token here is one the short row would generate, so
    that it matters."""
    short = [11, 12, 13]
    free = reference_greedy(make_tiny_model("llama"), torch.tensor([short]), 8, eos_token_id=[])[0, 3:].tolist()
    pad = free[0]
    ids, mask = _left_padded([PROMPT[0].tolist(), short], pad)
    differ = {}
    for name, value in [("repetition_penalty", 3.0), ("no_repeat_ngram_size", 1), ("min_length", ids.shape[1] + 4)]:
        model = make_tiny_model("llama")
        eos = [free[1]] if name == "min_length" else []
        options = dict(max_new_tokens=8, eos_token_id=eos, pad_token_id=pad, **{name: value})
        with torch.inference_mode():
            expected = model.generate(ids, attention_mask=mask, do_sample=False, **options)
            with warnings.catch_warnings():  # min_length past the unpadded row's max_length, which is the point
                warnings.simplefilter("ignore")
                unpadded = model.generate(torch.tensor([short]), do_sample=False, **options)[0, 3:]
        out = generate(model, ids, attention_mask=mask, config=CONFIGS[1], **options)
        assert out.sequences.tolist() == expected.tolist(), name
        differ[name] = unpadded.tolist() != expected[1, ids.shape[1]:].tolist()[:len(unpadded)]
    # where the padding counts, the short row's output depends on it: the test can tell
    assert differ == {"repetition_penalty": False, "no_repeat_ngram_size": True, "min_length": True}


@pytest.mark.parametrize("model_eos, call_eos", [(2, [36, 2]), ([36, 2], None), (None, 36)],
                         ids=["call-eos", "config-eos-list", "no-config-eos"])
def test_finished_rows_are_padded_with_what_generate_pads_with(model_eos, call_eos):
    """Without a pad token, `generate` pads with the first stop token of the call (else of the config)."""
    model = make_tiny_model("llama")
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = model_eos
    ids, mask = _left_padded([[5, 6, 7, 8, 9], [11, 12, 13]], 0)
    given = {} if call_eos is None else {"eos_token_id": call_eos}  # None given would mean "no stop token"
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, **given)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=8, **given)
    assert out.sequences.tolist() == expected.tolist()
    assert 36 in out.sequences[:, ids.shape[1]:].tolist()[0][:-1]  # a row stopped early and was padded


def test_a_batch_without_attention_mask_is_padded_where_its_pad_tokens_are():
    model = make_tiny_model("llama")
    pad = model.generation_config.pad_token_id
    ids, mask = _left_padded([[5, 6, 7, 8, 9], [11, 12, 13]], pad)
    with torch.inference_mode():
        expected = model.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=[])  # mask inferred
    assert generate(model, ids, max_new_tokens=8, eos_token_id=[]).sequences.tolist() == expected.tolist()
    assert generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[]).sequences.tolist() \
        == expected.tolist()
    with pytest.raises(ValueError, match=rf"attention_mask \(inferred from the pad token, id {pad}, as generate does; "
                                         r"pass an attention_mask, or another pad_token_id\) must pad on the left"):
        generate(model, torch.tensor([[5, pad, 6], [7, 8, 9]]), max_new_tokens=2)


def test_a_batch_without_attention_mask_is_padded_where_the_pad_token_given_is():
    """`pad_token_id=` names the padding of a batch given without a mask, as it does for `generate`."""
    model = make_tiny_model("llama")
    other = 4
    assert other != model.generation_config.pad_token_id
    ids, _ = _left_padded([[5, 6, 7, 8, 9], [11, 12, 13]], other)
    with torch.inference_mode():
        expected = model.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=[], pad_token_id=other)
    out = generate(model, ids, max_new_tokens=8, eos_token_id=[], pad_token_id=other)
    assert out.sequences.tolist() == expected.tolist()


def test_one_padded_row_without_attention_mask_is_padded_where_its_pad_tokens_are():
    """`generate` infers the padding of a single [1, n] row as of a batch: the pad tokens are not text."""
    model = make_tiny_model("llama")
    pad = model.generation_config.pad_token_id
    padded = torch.tensor([[pad, pad, 5, 6, 7, 8]])
    with torch.inference_mode():
        expected = model.generate(padded, do_sample=False, max_new_tokens=8, eos_token_id=[])
        alone = model.generate(padded[:, 2:], do_sample=False, max_new_tokens=8, eos_token_id=[])
    assert expected[0, 2:].tolist() == alone[0].tolist()  # generate's own reading of it: padding
    assert generate(model, padded, max_new_tokens=8, eos_token_id=[]).sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("length", [("max_new_tokens", 7), ("max_length", 15)])
def test_the_length_of_the_models_generation_config_applies_where_the_call_sets_none(length):
    model = make_tiny_model("llama")
    setattr(model.generation_config, *length)
    with torch.inference_mode():
        expected = model.generate(PROMPT, do_sample=False, eos_token_id=[])
    assert expected.shape[1] == (PROMPT.shape[1] + 7 if length[0] == "max_new_tokens" else 15)
    assert generate(model, PROMPT, eos_token_id=[]).sequences.tolist() == expected.tolist()
    assert generate(model, PROMPT, max_new_tokens=3, eos_token_id=[]).sequences.shape[1] == PROMPT.shape[1] + 3


def test_no_length_anywhere_takes_ours_and_a_max_length_the_input_fills_is_refused():
    from lookahead.generation import DEFAULT_NEW_TOKENS

    model = make_tiny_model("llama")
    assert generate(model, PROMPT, eos_token_id=[]).sequences.shape[1] == PROMPT.shape[1] + DEFAULT_NEW_TOKENS
    model.generation_config.max_length = PROMPT.shape[1]
    with pytest.raises(ValueError, match=r"max_new_tokens is unset and the generation config sets "
                                         r"max_length=8, which leaves no room after the input's 8 positions"):
        generate(model, PROMPT)


def test_no_length_anywhere_takes_what_the_models_context_leaves_where_that_is_fewer():
    """128 new tokens after a prompt that leaves fewer had been refused, a length nobody asked for."""
    model = make_tiny_model("llama")
    model.config.max_position_embeddings = 100
    prompt = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(0))
    out = generate(model, prompt, eos_token_id=[])
    assert out.sequences.tolist() == reference_greedy(model, prompt, 10, eos_token_id=[]).tolist()
    with pytest.raises(ValueError, match="can be at most 10"):
        generate(model, prompt, max_new_tokens=11)


def test_a_generation_config_asking_for_sampling_samples():
    """`do_sample` unset: the generation config's, as `generate` reads it (many chat models ship do_sample=True)."""
    model = make_tiny_model("llama")
    model.generation_config.do_sample = True
    draws = [generate(model, PROMPT, max_new_tokens=12, generator=torch.Generator().manual_seed(seed)).sequences
             for seed in range(4)]
    assert all(torch.equal(draw, generate(model, PROMPT, max_new_tokens=12, do_sample=True,
                                          generator=torch.Generator().manual_seed(seed)).sequences)
               for seed, draw in enumerate(draws))
    assert len({tuple(draw[0].tolist()) for draw in draws}) > 1
    greedy = generate(model, PROMPT, max_new_tokens=12, do_sample=False).sequences
    model.generation_config.do_sample = None
    assert torch.equal(generate(model, PROMPT, max_new_tokens=12).sequences, greedy)


def test_objects_of_the_wrong_kind_are_refused_by_name():
    model = make_tiny_model("llama")
    for options, message in [
        ({"streamer": object()}, r"streamer must be a transformers streamer \(with put\(\) and end\(\)\), got object"),
        ({"logits_processor": NotImplemented}, "logits_processor must be a list of transformers LogitsProcessor"),
        ({"packed_linear": "yes"}, "packed_linear must be True, False or None, got 'yes'"),
        ({"attention_mask": "abc"}, "attention_mask must be a tensor of 0 and 1, got 'abc'"),
    ]:
        with pytest.raises(TypeError, match=message):
            generate(model, PROMPT, max_new_tokens=2, **options)
    model.generation_config.pad_token_id = -5
    with pytest.raises(ValueError, match=r"the model's pad token \(generation config\) must be a token id .* got -5"):
        generate(model, PROMPT, max_new_tokens=2)
    model = make_tiny_model("llama")
    model.generation_config.num_return_sequences = 2
    with pytest.raises(ValueError, match="generation config sets num_return_sequences=2"):
        generate(model, PROMPT, max_new_tokens=2)


@pytest.mark.parametrize("config", [None, LookaheadConfig(window=5, ngram=4, guesses=5)], ids=["auto", "W5N4G5"])
def test_steps_stay_inside_a_context_of_learned_positions(config, drafts_always):
    """GPT-2 has an embedding for positions below n_positions only: no row of a step (window, drafts,
    padding) and no cost measurement may reach past it, up to a request that ends at the last position."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=96, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=1, eos_token_id=2)).eval()
    prompt = torch.tensor([[5, 6, 7, 8] * 18])  # 72 tokens, repetitive: drafts are found and fed
    expected = reference_greedy(model, prompt, 24, eos_token_id=[])
    out = generate(model, prompt, max_new_tokens=24, config=config, eos_token_id=[])
    assert out.sequences.shape[1] == 96
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.steps < 24  # drafts were accepted, up to the end


class BansInPlace:
    """A user's processor that edits the scores it is handed, as many hand-written ones do."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.token] = -float("inf")
        return scores


@pytest.mark.parametrize("config", CONFIGS, ids=["auto", "W3N3G3"])
def test_a_processor_editing_its_scores_in_place_works_as_in_generate(config):
    """Alone and in a batch (where some steps are ragged and some are not): the scores a processor gets are
    its own to write, and writing them changes no other node's."""
    model = make_tiny_model("llama")
    banned = free_run()[0]
    ids, mask = _left_padded([PROMPT[0].tolist(), [11, 12, 13, 5, 6]], 0)
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=[],
                              logits_processor=[BansInPlace(banned)])
    assert banned not in expected[0, ids.shape[1]:].tolist()
    alone = generate(model, PROMPT, max_new_tokens=NEW, config=config, eos_token_id=[],
                     logits_processor=[BansInPlace(banned)])
    assert alone.sequences[0].tolist() == expected[0, ids.shape[1] - PROMPT.shape[1]:].tolist()
    batch = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, config=config, eos_token_id=[],
                     logits_processor=[BansInPlace(banned)])
    assert batch.sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("config", CONFIGS, ids=["auto", "W3N3G3"])
def test_scores_and_logits_are_generates(config):
    """`output_scores` / `output_logits` as `generate` returns them, for a batch whose first row stops early:
    the scores after a processor (repetition penalty: they differ from the logits), the raw logits, and
    past a row's end the pad token certain."""
    model = make_tiny_model("llama")
    model.generation_config.repetition_penalty = 1.5
    ids, mask = _left_padded([PROMPT[0].tolist(), [11, 12, 13, 5, 6]], 0)
    with torch.inference_mode():
        free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=[])
    first, second = free[:, ids.shape[1]:].tolist()
    end = next(i for i in range(3, NEW // 2) if first[i] not in second and first[i] not in first[:i]) + 1
    stop = first[end - 1]  # ends the first row only, after `end` tokens
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=stop,
                                  output_scores=True, output_logits=True, return_dict_in_generate=True)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, config=config, eos_token_id=stop,
                   output_scores=True, output_logits=True)
    assert out.sequences.tolist() == expected.sequences.tolist()
    assert len(out.scores) == len(out.logits) == len(expected.scores) == NEW
    ours, theirs = torch.stack(out.scores), torch.stack(expected.scores)
    assert not torch.equal(torch.stack(expected.logits), theirs)
    torch.testing.assert_close(ours[:, 1], theirs[:, 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(out.logits)[:, 1], torch.stack(expected.logits)[:, 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[:end, 0], theirs[:end, 0], rtol=1e-4, atol=1e-4)  # up to its stop token
    pad = model.generation_config.pad_token_id
    assert (ours[end:, 0, pad] == 0).all() and (ours[end:, 0].isinf().sum(dim=-1) == ours.shape[-1] - 1).all()
    transition = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert (transition[0, end:] == 0).all() and (transition[:, :end] < 0).all()


def test_scores_asked_by_the_generation_config_are_returned():
    """`output_scores` / `output_logits` set in a generation config (the call's or the model's), as `generate`
    takes them (they had been ignored: None came back)."""
    from transformers import GenerationConfig

    model = make_tiny_model("llama")
    asked = generate(model, PROMPT, max_new_tokens=4, eos_token_id=[], output_scores=True, output_logits=True)
    by_config = generate(model, PROMPT, max_new_tokens=4, eos_token_id=[],
                         generation_config=GenerationConfig(output_scores=True, output_logits=True))
    model.generation_config.output_scores = True
    by_model = generate(model, PROMPT, max_new_tokens=4, eos_token_id=[])
    for out in (by_config, by_model):
        torch.testing.assert_close(torch.stack(out.scores), torch.stack(asked.scores))
    torch.testing.assert_close(torch.stack(by_config.logits), torch.stack(asked.logits))
    assert by_model.logits is None and generate(model, PROMPT, max_new_tokens=4, output_scores=False).scores is None


def test_renormalized_scores_are_log_probabilities_as_in_generate():
    """`renormalize_logits=True`: the scores come out as log-probabilities, last of every processor (they had
    come out unnormalised, and `compute_transition_scores` positive)."""
    model = make_tiny_model("llama")
    ids, mask = _left_padded([PROMPT[0].tolist(), [11, 12, 13]], 0)
    options = dict(max_new_tokens=4, eos_token_id=[], renormalize_logits=True, repetition_penalty=1.5)
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True, **options)
    out = generate(model, ids, attention_mask=mask, output_scores=True, **options)
    assert out.sequences.tolist() == expected.sequences.tolist()
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-4)
    assert torch.stack(out.scores).logsumexp(-1).abs().max() < 1e-4


def test_the_generation_configs_max_time_stops_every_row():
    """`max_time` (by name or in a generation config) ends the call as `generate` ends it (it had been ignored)."""
    from transformers import GenerationConfig

    model = make_tiny_model("llama")
    ids, mask = _left_padded([PROMPT[0].tolist(), [11, 12, 13]], 0)
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, eos_token_id=[],
                                  max_time=1e-9)
    assert expected.shape[1] == ids.shape[1] + 1  # the first token, then the time is up
    for given in ({"max_time": 1e-9}, {"generation_config": GenerationConfig(max_time=1e-9)}):
        out = generate(model, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[], **given)
        assert out.sequences.tolist() == expected.tolist(), given
    with pytest.raises(ValueError, match="max_time must be a number of seconds > 0, got -1"):
        generate(model, ids, attention_mask=mask, max_new_tokens=2, max_time=-1)


def test_a_callers_processor_of_a_type_the_config_builds_takes_its_place():
    """A model whose generation config sets a repetition penalty, and a caller passing a penalty processor of
    their own: `generate` uses the caller's instead of the config's (both had applied)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    model = make_tiny_model("llama")
    model.generation_config.repetition_penalty = 2.0
    own = [RepetitionPenaltyLogitsProcessor(1.05)]
    with torch.inference_mode():
        expected = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, eos_token_id=[], logits_processor=own)
        configured = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, eos_token_id=[])
    assert not torch.equal(expected, configured)
    out = generate(model, PROMPT, max_new_tokens=NEW, eos_token_id=[], logits_processor=own, config=CONFIGS[1])
    assert out.sequences.tolist() == expected.tolist()


def test_prefix_allowed_tokens_fn_constrains_each_row_as_in_generate():
    """transformers' `prefix_allowed_tokens_fn(batch_id, input_ids)`: each row told its own index (it had been
    refused as an unknown option)."""
    model = make_tiny_model("llama")
    ids, mask = _left_padded([PROMPT[0].tolist(), [11, 12, 13]], 0)
    seen = set()

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        seen.add((batch_id, sent.shape[-1] >= ids.shape[1]))  # each row, its padding in front
        return list(range(20, 40)) if batch_id == 0 else list(range(60, 80))

    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=[],
                                  prefix_allowed_tokens_fn=allowed)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[],
                   prefix_allowed_tokens_fn=allowed, config=CONFIGS[1])
    assert out.sequences.tolist() == expected.tolist()
    new = out.sequences[:, ids.shape[1]:]
    assert ((20 <= new[0]) & (new[0] < 40)).all() and ((60 <= new[1]) & (new[1] < 80)).all()
    assert seen == {(0, True), (1, True)}
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn must be a callable"):
        generate(model, PROMPT, max_new_tokens=2, prefix_allowed_tokens_fn=[1, 2])


def test_scores_are_refused_unless_asked_with_a_bool():
    with pytest.raises(ValueError, match="output_scores must be a bool, got 1"):
        generate(make_tiny_model("llama"), PROMPT, max_new_tokens=2, output_scores=1)


class Oracle:
    """Drafts the next `length` tokens of a known output: every step accepts deep tree nodes."""

    name = "oracle"

    def __init__(self, output: list[int], length: int = 4) -> None:
        self.output, self.length = output, length

    def propose(self, text: list[int], limit: int):
        from lookahead.core.drafts import Draft

        following = self.output[len(text) : len(text) + min(limit, self.length)]
        return [Draft(tuple(following), self.name)] if following else []

    def observe(self, text: list[int], new: int) -> None:
        pass


def test_scores_of_tokens_accepted_deep_in_the_tree_are_generates():
    """Each token's scores come from the row of the accepted node before it, with that node's own prefix
    seen by the processors (a repetition penalty)."""
    model = make_tiny_model("llama")
    model.generation_config.repetition_penalty = 1.5
    with torch.inference_mode():
        expected = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, eos_token_id=[], output_scores=True,
                                  output_logits=True, return_dict_in_generate=True)
    out = generate(model, PROMPT, max_new_tokens=NEW, config=CONFIGS[1], eos_token_id=[], output_scores=True,
                   output_logits=True, proposers=[Oracle(expected.sequences[0].tolist())])
    assert out.sequences.tolist() == expected.sequences.tolist()
    assert out.stats.tokens_per_step == 3  # two drafted tokens accepted every step (the config drafts 2)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4)


def test_scores_of_a_batch_accepting_deep_nodes_in_shared_steps_are_generates():
    """The engine's batch, both requests drafting their own outputs (so that each step accepts deep nodes of
    both, at different heights): each token's scores (after a repetition penalty) and logits are those of
    `generate`'s left-padded batch."""
    from lookahead.engine import Engine, RequestParams

    model = make_tiny_model("llama")
    ids, mask = _left_padded([PROMPT[0].tolist(), [11, 12, 13, 5, 6]], 0)
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=[],
                                  repetition_penalty=1.5, output_scores=True, output_logits=True,
                                  return_dict_in_generate=True)
    engine = Engine(model, max_batch=2, max_length=ids.shape[1] + NEW)
    config = LookaheadConfig(window=0, ngram=6, guesses=1)  # drafts of up to 5 tokens, the oracle's alone
    requests, lengths = [], (4, 2)  # drafts of different lengths: ragged steps
    for row, drafted in enumerate(lengths):
        prompt, padding = ids[row][mask[row].bool()], ids[row][~mask[row].bool()]
        output = expected.sequences[row, ids.shape[1]:].tolist()
        params = RequestParams(max_new_tokens=NEW, config=config, eos_token_id=[], repetition_penalty=1.5,
                               output_scores=True, output_logits=True,
                               proposers=[Oracle(prompt.tolist() + output, drafted)])
        requests.append(engine.add_request(prompt, params, padding=padding))
    tokens, scores, logits, steps = ({r: [] for r in requests} for _ in range(4))
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.tokens
            scores[out.request_id].append(out.scores)
            logits[out.request_id].append(out.logits)
            steps[out.request_id].append(len(out.tokens))
    for row, (request, drafted) in enumerate(zip(requests, lengths)):
        assert tokens[request] == expected.sequences[row, ids.shape[1]:].tolist()
        assert steps[request][1:-1] == [drafted + 1] * (len(steps[request]) - 2)  # every drafted node accepted
        torch.testing.assert_close(torch.cat(scores[request]), torch.stack(expected.scores)[:, row],
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.cat(logits[request]), torch.stack(expected.logits)[:, row],
                                   rtol=1e-4, atol=1e-4)


def test_sampled_scores_are_the_warped_ones():
    """Sampling: the scores are what the token was drawn from (temperature and top-k applied), as `generate`
    returns them; the first position's, which no draw before it changes, equal `generate`'s."""
    model = make_tiny_model("llama")
    options = {"do_sample": True, "temperature": 0.7, "top_k": 5}
    with torch.inference_mode():
        expected = model.generate(PROMPT, max_new_tokens=4, eos_token_id=[], output_scores=True,
                                  return_dict_in_generate=True, **options)
    out = generate(model, PROMPT, max_new_tokens=NEW, config=CONFIGS[1], eos_token_id=[], output_scores=True,
                   generator=torch.Generator().manual_seed(0), **options)
    torch.testing.assert_close(out.scores[0], expected.scores[0], rtol=1e-4, atol=1e-4)
    scores = torch.cat(out.scores)
    assert (scores.isfinite().sum(dim=-1) == 5).all()  # top-k: five candidates at every position
    new = out.sequences[0, PROMPT.shape[1]:]
    assert scores[torch.arange(NEW), new].isfinite().all()  # every token drawn from its own candidates


@pytest.mark.parametrize("how", ["by-name", "generation-config"])
def test_generation_options_passed_to_the_call_apply_as_in_generate(how):
    """`generate(model, ids, no_repeat_ngram_size=2)` or `generation_config=GenerationConfig(...)`, as
    `model.generate` takes them; the model's own generation config is left as it was."""
    from transformers import GenerationConfig

    model = make_tiny_model("llama")
    before = model.generation_config.to_dict()
    for name, value in generation_options():
        eos = [free_run()[1]] if name == "min_new_tokens" else []
        given = {name: value} if how == "by-name" else {"generation_config": GenerationConfig(**{name: value})}
        with torch.inference_mode():
            expected = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, **given)
        assert expected.tolist() != reference_greedy(model, PROMPT, NEW, eos_token_id=eos).tolist(), name
        out = generate(model, PROMPT, max_new_tokens=NEW, config=CONFIGS[1], eos_token_id=eos, **given)
        assert out.sequences.tolist() == expected.tolist(), f"{name}={value!r}"
    assert model.generation_config.to_dict() == before


def test_a_generation_config_gives_its_length_and_stop_token_and_the_models_fills_the_rest():
    from transformers import GenerationConfig

    model = make_tiny_model("llama")
    model.generation_config.repetition_penalty = 1.5  # unset in the given config: the model's applies
    given = GenerationConfig(max_new_tokens=NEW, no_repeat_ngram_size=2)
    with torch.inference_mode():
        expected = model.generate(PROMPT, do_sample=False, generation_config=given, eos_token_id=[])
    assert expected.shape[1] == PROMPT.shape[1] + NEW
    assert generate(model, PROMPT, generation_config=given, eos_token_id=[]).sequences.tolist() == expected.tolist()
    unpenalised = generate(model, PROMPT, generation_config=given, eos_token_id=[], repetition_penalty=1.0)
    assert unpenalised.sequences.tolist() != expected.tolist()  # the model's penalty did apply
    stop = expected[0, PROMPT.shape[1] + 6].item()
    given = GenerationConfig(max_new_tokens=NEW, no_repeat_ngram_size=2, eos_token_id=stop)
    with torch.inference_mode():
        expected = model.generate(PROMPT, do_sample=False, generation_config=given)
    assert expected[0, -1] == stop and expected.shape[1] < PROMPT.shape[1] + NEW
    assert generate(model, PROMPT, generation_config=given).sequences.tolist() == expected.tolist()


def test_options_that_are_no_generation_config_field_or_ask_for_another_search_are_refused():
    model = make_tiny_model("llama")
    with pytest.raises(TypeError, match="neither its arguments nor generation config fields: no_such_option"):
        generate(model, PROMPT, max_new_tokens=2, no_such_option=1)
    with pytest.raises(TypeError, match="generation_config must be a transformers GenerationConfig or None, got dict"):
        generate(model, PROMPT, max_new_tokens=2, generation_config={"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"num_beams=4 asks for a search, which lookahead does not do; leave it at 1"):
        generate(model, PROMPT, max_new_tokens=2, num_beams=4)
    with pytest.raises(ValueError, match=r"num_beams=4 \(generation config\) asks for a search"):
        generate(model, PROMPT, max_new_tokens=2, generation_config=GenerationConfig(num_beams=4))
    # Constrained beam search and other drafting had been ignored without a word: the output was plain greedy.
    for option, asks_for in [({"force_words_ids": [[99]]}, "a search"), ({"constraints": [object()]}, "a search"),
                             ({"prompt_lookup_num_tokens": 10}, "drafting of another kind"),
                             ({"use_mtp": True}, "drafting of another kind"),
                             ({"assistant_early_exit": 2}, "drafting of another kind"),
                             ({"watermarking_config": {"bias": 2.0}}, "watermarking"),
                             # transformers rewrites the prompt's last token; it had been decoded unhealed
                             ({"token_healing": True}, r"token healing .* model.heal_tokens\(input_ids, tokenizer\)")]:
        with pytest.raises(ValueError, match=f"{next(iter(option))}=.* asks for {asks_for}"):
            generate(model, PROMPT, max_new_tokens=2, **option)


def test_integer_lengths_and_pad_ids_may_come_as_numpy_or_0_d_tensors():
    """As the stop token ids may: `max_new_tokens=np.int64(4)` from a config array had been refused."""
    import numpy as np

    model = make_tiny_model("llama")
    expected = generate(model, PROMPT, max_new_tokens=4, pad_token_id=0).sequences
    for new, pad in ((np.int64(4), np.int32(0)), (torch.tensor(4), torch.tensor(0))):
        assert torch.equal(generate(model, PROMPT, max_new_tokens=new, pad_token_id=pad).sequences, expected)


def test_scores_of_a_list_of_prompts_have_a_row_per_new_position():
    """A list of prompts of different lengths (it had crashed): one [B, vocab] tensor per new position."""
    model = make_tiny_model("llama")
    out = generate(model, [[5, 6, 7], [8, 9, 10, 11, 12]], max_new_tokens=4, eos_token_id=[], output_logits=True)
    assert len(out.logits) == 4 and out.logits[0].shape == (2, model.config.vocab_size)
    alone = generate(model, [8, 9, 10, 11, 12], max_new_tokens=4, eos_token_id=[], output_logits=True)
    torch.testing.assert_close(torch.stack(out.logits)[:, 1], torch.stack(alone.logits)[:, 0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["temperature", "top_k", "top_p", "repetition_penalty"])
def test_a_sampling_option_given_as_none_is_off_over_the_generation_config_as_in_generate(name):
    """`model.generate(top_p=None)` sets the field to None over the model's generation config (top_k=None over
    transformers' default of 50, which the config leaves unset): no such warper. Left out, the config's (or the
    default) applies. Each way, the first position's scores are `generate`'s."""
    model = make_tiny_model("llama")
    if name != "top_k":
        setattr(model.generation_config, name, {"temperature": 0.5, "top_p": 0.5, "repetition_penalty": 1.5}[name])
    scores = []
    for given in ({name: None}, {}):
        with torch.inference_mode():
            expected = model.generate(PROMPT, do_sample=True, max_new_tokens=1, eos_token_id=[], output_scores=True,
                                      return_dict_in_generate=True, **given).scores[0]
        out = generate(model, PROMPT, do_sample=True, max_new_tokens=2, eos_token_id=[], output_scores=True,
                       config=CONFIGS[1], **given)
        torch.testing.assert_close(out.scores[0], expected, rtol=1e-4, atol=1e-4)
        scores.append(out.scores[0])
    assert not torch.equal(*scores)  # the option given as None made a difference


def test_keywords_given_as_none_clear_the_generation_configs_value_as_in_generate():
    """eos_token_id=None: no stop token; max_new_tokens=None: the config's max_length, not its max_new_tokens;
    do_sample=None: greedy where the config samples; output_scores=None: no scores where it asks for them; a field
    by name (no_repeat_ngram_size=None): its processor off. (The engine had completed the call's config again with
    the model's, undoing a None.)"""
    free = free_run()
    model = make_tiny_model("llama")
    config = model.generation_config
    config.eos_token_id, config.pad_token_id, config.max_new_tokens = free[3], 0, 6
    config.max_length, config.do_sample, config.output_scores = PROMPT.shape[1] + 10, True, True
    config.no_repeat_ngram_size = 1
    left_out = generate(model, PROMPT, config=CONFIGS[1], generator=torch.Generator().manual_seed(0))
    assert left_out.scores is not None and left_out.sequences.shape[1] <= PROMPT.shape[1] + 6
    given = {"eos_token_id": None, "max_new_tokens": None, "do_sample": None, "output_scores": None,
             "no_repeat_ngram_size": None}
    with torch.inference_mode():
        expected = model.generate(PROMPT, return_dict_in_generate=True, **given)
    out = generate(model, PROMPT, config=CONFIGS[1], **given)
    assert expected.scores is None and out.scores is None
    assert out.sequences.tolist() == expected.sequences.tolist() == [PROMPT[0].tolist() + free[:10]]


@pytest.mark.parametrize("criterion, keyword", [("EosTokenCriteria", "eos_token_id"),
                                                ("MaxLengthCriteria", "max_new_tokens")])
def test_a_callers_stop_token_or_length_criterion_is_refused_naming_its_keyword(criterion, keyword):
    """In `generate` it would take the place of the stop tokens or the length for stopping alone (the processors,
    min_new_tokens say, keep the config's); it had been added beside them, stopping where `generate` does not."""
    import transformers

    settings = {"eos_token_id": 3} if criterion == "EosTokenCriteria" else {"max_length": 30}
    made = getattr(transformers, criterion)(**settings)
    with pytest.raises(ValueError, match=rf"stopping_criteria: .* a caller's {criterion} .* pass {keyword}= instead"):
        generate(make_tiny_model("llama"), PROMPT, max_new_tokens=4, stopping_criteria=[made])


def test_a_callers_stop_token_criterion_stops_where_generate_builds_none():
    """Without stop tokens `generate` builds no EosTokenCriteria: the caller's stops the sequence, as any criterion."""
    from transformers import EosTokenCriteria

    model = make_tiny_model("llama")
    stop = free_run()[3]
    for given in ({"eos_token_id": None}, {"eos_token_id": []}):
        with torch.inference_mode():
            expected = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                                      stopping_criteria=[EosTokenCriteria(stop)], **given)
        out = generate(model, PROMPT, max_new_tokens=NEW, config=CONFIGS[1], stopping_criteria=[EosTokenCriteria(stop)],
                       **given)
        assert out.sequences.tolist() == expected.tolist() == [PROMPT[0].tolist() + free_run()[:4]], given

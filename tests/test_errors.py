"""Bad input gives a clear error naming the argument and what is allowed, before any work is done."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import reference_greedy, run_cli
from test_exact_tiny import ForwardRecorder
from transformers import (BertConfig, BertLMHeadModel, FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration)

from lookahead import Corpus, LookaheadConfig, UnsupportedModelError, generate
from lookahead.hf import is_causal
from lookahead.models import ModelLoadError, load_model


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window": -1}, "window must be an integer >= 0"),
        ({"ngram": 1}, "ngram must be an integer >= 2"),
        ({"guesses": -2}, "guesses must be an integer >= 0"),
        ({"window": 2.5}, "window must be an integer"),
        ({"ngram": True}, "ngram must be an integer"),
        ({"seed_from_prompt": "yes"}, "seed_from_prompt must be a bool"),
        ({"learn_from_output": 1}, "learn_from_output must be a bool"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"window": 100}, r"the window of 100 x 3 rows is too large for one step; window x \(ngram - 1\) must be below 128"),
        ({"window": 43, "ngram": 4}, "the window of 43 x 3 rows is too large"),
    ],
)
def test_invalid_config_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LookaheadConfig(**kwargs)


class Recorder:
    def __init__(self):
        self.calls = 0

    def put(self, value):
        self.calls += 1

    def end(self):
        self.calls += 1


@pytest.mark.parametrize(
    "input_ids, message",
    [
        (torch.zeros(1, 0, dtype=torch.long), "input_ids is empty"),
        ([], "input_ids is empty"),
        (torch.ones(2, 5, dtype=torch.long), "streamer takes one sequence"),
        (torch.ones(1, 1, 5, dtype=torch.long), r"shape \[n\] or \[B, n\], or be a list of 1-D prompts; got shape \[1, 1, 5\]"),
        (torch.ones(1, 5), "integer token ids"),
    ],
)
def test_bad_prompts(llama_tiny, input_ids, message):
    recorder = Recorder()
    with pytest.raises(ValueError, match=message):
        generate(llama_tiny, input_ids, streamer=recorder)
    assert recorder.calls == 0  # nothing half-done: the streamer never saw a token


def test_token_ids_stored_unsigned_are_taken(llama_tiny):
    """numpy's uint16 and uint32 arrays (a tokenised dataset's) had been refused as not "integer token ids": torch
    compares none of its unsigned dtypes but uint8. An unsigned id past int64 is outside the vocabulary."""
    import numpy as np

    expected = generate(llama_tiny, [5, 6, 7, 8], max_new_tokens=4, eos_token_id=[]).sequences
    for dtype in (np.uint16, np.uint32, np.uint64):
        out = generate(llama_tiny, np.array([5, 6, 7, 8], dtype=dtype), max_new_tokens=4, eos_token_id=[])
        assert torch.equal(out.sequences, expected), dtype
    padded = generate(llama_tiny, np.array([[0, 5, 6, 7, 8]], dtype=np.uint32), attention_mask=[[0, 1, 1, 1, 1]],
                      max_new_tokens=4, eos_token_id=[])
    assert torch.equal(padded.sequences[:, 1:], expected)
    with pytest.raises(ValueError, match="input_ids holds a token id of 2\\*\\*63 or more"):
        generate(llama_tiny, np.array([5, 2**64 - 1], dtype=np.uint64), max_new_tokens=2)
    stop = int(expected[0, 5])  # the second new token: a stop token given unsigned ends the reply there
    for eos in (np.uint32(stop), np.array([stop], dtype=np.uint16)):
        out = generate(llama_tiny, [5, 6, 7, 8], max_new_tokens=4, eos_token_id=eos)
        assert out.sequences[0].tolist() == expected[0, :6].tolist(), eos


@pytest.mark.parametrize("value", [0, -3, 2.0, "3"])  # None: the generation config's length (test_transformers_parity)
def test_bad_max_new_tokens(llama_tiny, value):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate(llama_tiny, [5, 6, 7], max_new_tokens=value)


def test_bad_config_type(llama_tiny):
    with pytest.raises(TypeError, match="config must be a LookaheadConfig"):
        generate(llama_tiny, [5, 6, 7], config={"window": 3})


def test_attention_without_custom_masks_is_refused():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="'flash_attention_2' cannot take a custom 4-D mask.*'eager', 'sdpa'"):
        generate(model, [1, 2, 3])


def test_encoder_decoder_is_refused():
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16))
    with pytest.raises(UnsupportedModelError, match="decoder-only"):
        generate(model.eval(), [1, 2, 3])


def test_a_model_that_attends_to_later_tokens_is_refused():
    """BERT loads through AutoModelForCausalLM as BertLMHeadModel, attending both ways unless is_decoder: refused
    by name, where it would decode something other than `generate`; as a decoder it decodes exactly."""
    for is_decoder in (False, True):
        model = BertLMHeadModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64, is_decoder=is_decoder)).eval()
        if not is_decoder:
            with pytest.raises(UnsupportedModelError, match="BertLMHeadModel attends to later tokens.*is_decoder=True"):
                generate(model, [1, 2, 3])
        else:
            prompt = torch.tensor([[1, 2, 3, 4]])
            expected = reference_greedy(model, prompt, 8, eos_token_id=[])
            out = generate(model, prompt, max_new_tokens=8, config=LookaheadConfig(3, 3, 3), eos_token_id=[])
            assert out.sequences.tolist() == expected.tolist()


def test_a_causal_model_left_in_training_mode_is_not_taken_for_one_that_attends_ahead():
    """The causality probe runs without dropout: GPT-2 built from a config (training mode, dropout 0.1) is
    accepted, and left in the mode it was in."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=1, n_head=2))
    assert model.training
    generate(model, [1, 2, 3], max_new_tokens=4, config=LookaheadConfig(3, 3, 3))
    assert model.training


def test_falcon_with_alibi_is_refused():
    """Falcon's ALiBi reads positions from a 2-D attention mask, which a lookahead step does not have."""
    model = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           alibi=True)).eval()
    with pytest.raises(UnsupportedModelError, match="alibi=True takes its positions from a 2-D attention mask"):
        generate(model, [1, 2, 3])


def test_a_sliding_window_the_models_attention_ignores_is_refused_and_none_decodes_as_generate():
    """Llama's attention ignores a config's sliding_window (a config derived from Mistral's may carry one), but
    transformers' cache keeps only that many tokens after the prompt: generate attends fully over the prompt and
    through the window after it. Masked by the window everywhere, lookahead's first token differed from generate's;
    unmasked, its second. Refused up front; with the key unset, both attend fully and agree."""
    from conftest import _COMMON, peaked

    torch.manual_seed(0)
    model = peaked(LlamaForCausalLM(LlamaConfig(**_COMMON, sliding_window=8)), 0.15)
    prompt = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM's attention ignores its config's sliding_window=8"
                                                    ", but transformers' cache applies it"):
        generate(model, prompt, max_new_tokens=10)
    model.config.sliding_window = None
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, max_new_tokens=10, eos_token_id=[]).sequences, expected)
    wide = LlamaForCausalLM(LlamaConfig(**_COMMON, sliding_window=512)).eval()  # the whole context: no matter
    generate(wide, [5, 6, 7], max_new_tokens=2)

    class Mine(LlamaForCausalLM):  # a user's subclass is judged by its transformers base model
        pass

    with pytest.raises(UnsupportedModelError, match="Mine's attention ignores its config's sliding_window=8"):
        generate(Mine(LlamaConfig(**_COMMON, sliding_window=8)).eval(), prompt, max_new_tokens=2)


def test_gpt_neos_local_layers_are_refused_unless_their_band_spans_the_context():
    """GPT-Neo's local layers band keys by their index in the cache, whatever the mask and positions say: rows
    ahead of the text saw other keys than generate's, and the output parted from it without a word. A band as
    wide as the context bands nothing: that model decodes as generate."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    from conftest import peaked

    shape = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
                 max_position_embeddings=128, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    banded = GPTNeoForCausalLM(GPTNeoConfig(**shape, window_size=12)).eval()
    with pytest.raises(UnsupportedModelError, match="GPTNeoForCausalLM's local attention layers keep a band of "
                                                    "window_size=12 keys counted by their place in the cache"):
        generate(banded, [5, 6, 7], max_new_tokens=4)
    wide = peaked(GPTNeoForCausalLM(GPTNeoConfig(**shape, window_size=128)), 0.15)
    prompt = torch.tensor([[5, 6, 7, 8, 9] * 4])
    expected = wide.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(wide, prompt, max_new_tokens=30, config=LookaheadConfig(5, 4, 5),
                                eos_token_id=[]).sequences, expected)


def test_not_a_model_is_refused():
    with pytest.raises(UnsupportedModelError, match="must be a transformers causal LM"):
        generate(torch.nn.Linear(2, 2), [1, 2, 3])


def test_layers_whose_cache_cannot_roll_back_are_refused(llama_tiny):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    model.config.layer_types = ["linear_attention"]
    with pytest.raises(UnsupportedModelError, match=r"\['linear_attention'\]"):
        generate(model, [1, 2, 3])


@pytest.mark.parametrize("bad_id", [10**7, -5, 128])
def test_ids_outside_the_vocabulary(llama_tiny, bad_id):
    recorder = Recorder()
    with pytest.raises(ValueError, match=rf"token id {bad_id}, outside the model's vocabulary \[0, 128\)"):
        generate(llama_tiny, [[5, bad_id, 6]], streamer=recorder)
    assert recorder.calls == 0


def test_prompt_longer_than_the_context(llama_tiny):
    context = llama_tiny.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"the prompt has {context + 1} tokens, more than the model's context of {context}"):
        generate(llama_tiny, [5] * (context + 1))


def test_prompt_plus_new_tokens_past_the_context(llama_tiny):
    context = llama_tiny.config.max_position_embeddings
    prompt = [5] * (context - 10)
    with pytest.raises(ValueError, match=rf"\({context - 10} tokens\) \+ max_new_tokens \(11\) = {context + 1} exceeds "
                                         rf"the model's context of {context} positions; max_new_tokens can be at most 10"):
        generate(llama_tiny, prompt, max_new_tokens=11)
    assert generate(llama_tiny, prompt, max_new_tokens=10, eos_token_id=[]).sequences.shape[1] == context  # the edge fits


@pytest.mark.parametrize(
    "prompt, args, message",
    [
        ("hello", ["--max-new-tokens", "9000"], "max_new_tokens (9000) = "),
        ("word " * 9000, ["--raw", "--max-new-tokens", "1"], "more than the model's context of 8192 positions"),
    ],
    ids=["new-tokens-past-context", "prompt-past-context"],
)
def test_cli_reports_requests_past_the_context_in_one_line(prompt, args, message):
    result = run_cli("generate", prompt, *args)
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def _corpus_beyond_the_vocabulary() -> Corpus:
    corpus = Corpus()
    corpus.add([5, 6, 700])
    return corpus


@pytest.mark.parametrize("pad", [True, 2.7])
def test_a_generation_configs_pad_token_that_is_no_token_id_is_refused(llama_tiny, pad):
    """It was taken as int(pad): True padded with 1, 2.7 with 2."""
    from transformers import GenerationConfig

    with pytest.raises(ValueError, match=rf"the model's pad token \(generation config\) must be a token id \(an integer "
                                         rf">= 0\) or None, got {pad}"):
        generate(llama_tiny, [[5, 6, 7], [8, 9]], max_new_tokens=2, generation_config=GenerationConfig(pad_token_id=pad))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"do_sample": True, "temperature": -1.0}, ValueError, "temperature must be a number >= 0"),
        ({"do_sample": True, "top_p": 2.0}, ValueError, r"top_p must be a number in \(0, 1\]"),
        ({"eos_token_id": 2.0}, ValueError, "eos_token_id must be a token id or a list of token ids"),
        ({"eos_token_id": "</s>"}, ValueError, "eos_token_id must be a token id or a list of token ids"),
        ({"eos_token_id": [2, -1]}, ValueError, "eos_token_id must be a token id or a list of token ids"),
        ({"pad_token_id": -1}, ValueError, r"pad_token_id must be a token id \(an integer >= 0\) or None, got -1"),
        ({"corpus": [1, 2]}, TypeError, "corpus must be a lookahead Corpus"),
        ({"corpus": _corpus_beyond_the_vocabulary()}, ValueError,
         r"the corpus holds token id 700, outside the model's vocabulary \[0, 128\)"),
        ({"input_ids": torch.zeros(0, 5, dtype=torch.long)}, ValueError, r"input_ids holds no prompt \(shape \[0, 5\]\)"),
        ({"input_ids": "hello"}, ValueError, r"input_ids must be token ids \(a list of ints or an integer tensor\), got str "
                                             r"\(text: encode it with the tokenizer first"),
        ({"input_ids": ["hello", "hi"]}, ValueError, r"must be token ids .*, got list of str \(text: encode it"),
        ({"proposers": [object()]}, TypeError, r"proposers must be a list of draft sources with propose\(text, limit\)"),
        ({"proposers": 5}, TypeError, r"proposers must be a list of draft sources .*got int"),  # had been tuple(5)'s TypeError
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[0, 0, 0], [1, 1, 1]])},
         ValueError, "attention_mask leaves row 0 without a token"),
        ({"no_such_option": 1}, TypeError, "neither its arguments nor generation config fields: no_such_option"),
        ({"generation_config": {"top_k": 3}}, TypeError, "generation_config must be a transformers GenerationConfig"),
        ({"num_beams": 4}, ValueError, r"num_beams=4 asks for a search"),
        ({"force_words_ids": [[9]]}, ValueError, r"force_words_ids=\[\[9\]\] asks for a search, which lookahead does not do; leave it at None"),
        ({"do_sample": True, "num_return_sequences": 2}, ValueError,
         "num_return_sequences=2 asks for a search, .* several times in a list of prompts"),
        ({"assistant_model": object()}, TypeError, "assistant_model: assisted decoding is not what lookahead does"),
        ({"output_logits": "yes"}, ValueError, "output_logits must be a bool, got 'yes'"),
        ({"output_attentions": True}, ValueError, "output_attentions=True: lookahead's generate returns scores"),
        # Generation config values that failed only in the processors, after the engine had timed the model, or
        # at the last step (a forced token outside the vocabulary)
        ({"forced_eos_token_id": 999}, ValueError,
         r"forced_eos_token_id \(generation config\) must be a token id in \[0, 128\) or a list of them, got 999"),
        ({"forced_eos_token_id": [3, 1.5]}, ValueError, r"forced_eos_token_id \(generation config\) must be a token id"),
        ({"min_new_tokens": "3"}, ValueError, r"the generation config's options cannot be applied: unsupported operand"),
        ({"exponential_decay_length_penalty": (1,)}, ValueError,
         r"exponential_decay_length_penalty \(generation config\) must be a pair \(start index, decay factor\)"),
        ({"do_sample": True, "min_p": 2.0}, ValueError, r"the generation config's options cannot be applied: `min_p`"),
        ({"stop_strings": "x", "tokenizer": "gpt2"}, TypeError,
         "tokenizer must be the model's transformers tokenizer \\(for stop_strings\\), got str"),
        ({"input_ids": torch.tensor([[5, 6, 7], [-1, 8, 9]]), "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])},
         ValueError, r"padding holds token id -1, outside the model's vocabulary \[0, 128\)"),
        ({"packed_linear": "no"}, TypeError, "packed_linear must be True, False or None, got 'no'"),
    ],
    ids=["temperature", "top-p", "eos-float", "eos-string", "eos-negative", "pad", "corpus-type",
         "corpus-vocabulary", "no-prompt", "text-prompt", "texts-prompt", "proposer", "proposers-int", "empty-row", "unknown-option",
         "generation-config-type", "beam-search", "forced-words", "sampled-sequences", "assistant-model",
         "output-logits-type", "attentions", "forced-eos-vocabulary", "forced-eos-float", "min-new-tokens-type",
         "decay-pair", "min-p", "tokenizer-type", "padding-vocabulary", "packed-linear"],
)
def test_bad_options_are_refused_before_any_work(llama_tiny, tmp_path, monkeypatch, kwargs, error, message):
    """Even where nothing is measured yet (an empty cost-curve cache: the engine would first time the model),
    a bad option is reported before any forward pass."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    call = {"input_ids": [5, 6, 7], **kwargs}
    is_causal(llama_tiny)  # the model's own check, one forward per model: first in a process that ran no other test
    with ForwardRecorder(llama_tiny) as recorder, pytest.raises(error, match=message):
        generate(llama_tiny, call.pop("input_ids"), max_new_tokens=4, **call)
    assert recorder.sizes == []


@pytest.mark.parametrize("given", [lambda t: np.int64(t), lambda t: torch.tensor(t), lambda t: [torch.tensor(t)],
                                   lambda t: (t,), lambda t: {t}, lambda t: frozenset({t}), lambda t: (x for x in [t]),
                                   lambda t: {t: "eos"}.keys(), lambda t: np.array(t), lambda t: np.array([t])],
                         ids=["numpy", "tensor-0d", "list-of-tensors", "tuple", "set", "frozenset", "generator",
                              "dict-keys", "numpy-0d-array", "numpy-array"])
def test_stop_tokens_may_come_as_any_integer_type_or_iterable(llama_tiny, given):
    """A generator is read once (it had been used up by the first of several reads: no stop token at all)."""
    free = generate(llama_tiny, [5, 6, 7], max_new_tokens=12, eos_token_id=[]).sequences[0, 3:].tolist()
    stop = free[4]  # a token the output reaches
    expected = generate(llama_tiny, [5, 6, 7], max_new_tokens=12, eos_token_id=stop).sequences
    assert expected.shape[1] < 3 + 12  # it stopped there
    assert torch.equal(generate(llama_tiny, [5, 6, 7], max_new_tokens=12, eos_token_id=given(stop)).sequences, expected)


def test_corpus_documents_are_token_ids():
    as_list, as_tensor = Corpus(), Corpus()
    as_list.add([5, 6, 7, 8])
    as_tensor.add(torch.tensor([5, 6, 7, 8]))  # what a tokenizer returns
    assert as_tensor.tokens == as_list.tokens == 5 and as_tensor.largest_token == 8
    for document in ([5, "6"], [5, -1], [[5, 6]], torch.tensor([[5, 6]]), [5.0], "text"):
        with pytest.raises(ValueError, match="a corpus document must be a 1-D sequence of token ids"):
            Corpus().add(document)


def test_a_corpus_serves_the_models_of_one_vocabulary(llama_tiny):
    """The first model to draft from a corpus sets its vocabulary: a model of another size is refused before any
    work (the corpus's predictions and documents hold ids it may lack: a step fed one failed, the whole batch's),
    ids outside it are refused when added, and a cleared corpus serves any model again."""
    from conftest import _COMMON

    corpus = Corpus()
    generate(llama_tiny, [5, 6, 7, 5, 6], max_new_tokens=8, corpus=corpus)  # vocabulary 128
    assert len(corpus) == 1 and len(corpus.successors) > 0
    torch.manual_seed(0)
    larger = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "vocab_size": 256})).eval()
    with pytest.raises(ValueError, match="the corpus serves models of a 128-token vocabulary, and this model's has "
                                         "256 tokens: a corpus serves the models of one tokenizer"):
        generate(larger, [5, 6, 7], max_new_tokens=4, corpus=corpus)
    with pytest.raises(ValueError, match=r"a corpus document holds token id 200, outside the vocabulary \[0, 128\)"):
        corpus.add([5, 200])
    assert len(corpus) == 1  # nothing of the refused document was kept
    corpus.clear()
    out = generate(larger, [5, 6, 7], max_new_tokens=8, corpus=corpus)
    assert torch.equal(out.sequences, reference_greedy(larger, torch.tensor([[5, 6, 7]]), 8))
    assert corpus.vocabulary == 256


def test_a_gguf_file_name_needs_the_folder_it_is_in():
    with pytest.raises(ModelLoadError, match=r"gguf_file \(my-finetune.Q8_0.gguf\) names a file inside the model's "
                                             "folder"):
        load_model(gguf_file="my-finetune.Q8_0.gguf")


@pytest.mark.parametrize(
    "args, option",
    [
        (["generate", "hi", "--top-k", "5"], "--top-k"),
        (["generate", "hi", "--top-p", "0.5"], "--top-p"),
        (["bench", "--top-p", "0.5"], "--top-p"),
        (["bench", "--batch-size", "1,2", "--turns", "2"], "--turns"),
        (["bench", "--batch-size", "1", "--baselines", "greedy", "--profile"], "--baselines, --profile"),
        (["bench", "--batch-size", "1", "--config", "auto", "--config", "5,4,5"], "--config"),
    ],
    ids=["generate-top-k", "generate-top-p", "bench-top-p", "batch-turns", "batch-baselines-profile", "batch-configs"],
)
def test_cli_options_a_run_would_ignore_are_refused(args, option):
    result = run_cli(*args)
    assert result.returncode == 2
    assert option in result.stderr and "Traceback" not in result.stderr


def test_a_seed_may_be_a_numpy_integer(llama_tiny):
    from lookahead.engine import Engine, RequestParams
    engine = Engine(llama_tiny, max_batch=2)
    ids = [engine.add_request([5, 6, 7], RequestParams(max_new_tokens=10, do_sample=True, seed=seed, eos_token_id=[]))
           for seed in (4, np.int64(4))]
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] += output.tokens
    assert outputs[ids[0]] == outputs[ids[1]] and len(outputs[ids[0]]) == 10


def test_an_engine_request_with_a_generation_config_of_the_wrong_type_is_refused(llama_tiny):
    from lookahead.engine import Engine, RequestParams

    with pytest.raises(TypeError, match="generation_config must be a transformers GenerationConfig or None, got dict"):
        Engine(llama_tiny, max_batch=1, max_length=32).add_request([5, 6], RequestParams(generation_config={}))


def test_a_list_of_numpy_prompts_is_a_list_of_prompts(llama_tiny):
    """Rows of different lengths were refused as not token ids; rows of one length were stacked into a [B, n]
    tensor, whose pad tokens (0 here) were then taken for padding: the prompt [0, 6] lost its first token."""
    for prompts in ([[5, 6], [7]], [[0, 6], [7, 8]]):
        expected = generate(llama_tiny, prompts, max_new_tokens=3).sequences
        assert torch.equal(generate(llama_tiny, [np.array(p) for p in prompts], max_new_tokens=3).sequences, expected)
    assert generate(llama_tiny, [[0, 6], [7, 8]], max_new_tokens=3).sequences[0, :2].tolist() == [0, 6]


def test_a_pad_token_outside_the_vocabulary_pads_the_scores_too(llama_tiny):
    """generate takes such a pad id; the scores past a sequence's end set its score, and indexed past the
    vocabulary after all the decoding."""
    plain = generate(llama_tiny, [[5, 6, 7], [8]], max_new_tokens=6, eos_token_id=[])
    out = generate(llama_tiny, [[5, 6, 7], [8]], max_new_tokens=6, eos_token_id=[], pad_token_id=999,
                   output_scores=True)
    assert torch.equal(out.sequences[:, :7], plain.sequences[:, :7]) and len(out.scores) == 6
    assert out.sequences[1, 7:].tolist() == [999, 999]  # the shorter prompt's row, padded after its output


def test_an_engine_refuses_its_own_arguments_before_any_work(llama_tiny):
    from lookahead.engine import Engine

    is_causal(llama_tiny)
    with ForwardRecorder(llama_tiny) as recorder:
        with pytest.raises(ValueError, match="max_length must be an integer >= 2, got 1.5"):
            Engine(llama_tiny, max_batch=1, max_length=1.5)
        with pytest.raises(TypeError, match="packed_linear must be True, False or None, got 'no'"):
            Engine(llama_tiny, max_batch=1, max_length=32, packed_linear="no")
    assert recorder.sizes == []

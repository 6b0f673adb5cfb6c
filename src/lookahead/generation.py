"""`generate`: lookahead decoding of one prompt or a batch with a Hugging Face causal LM, on the engine."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import torch
from transformers import (EosTokenCriteria, GenerationConfig, LogitsProcessor, MaxLengthCriteria, MaxTimeCriteria,
                          PreTrainedModel, PreTrainedTokenizerBase, StopStringCriteria)

from .config import LookaheadConfig
from .core.drafts import Proposer
from .core.suffix import Corpus
from .engine import (Engine, GenerateOutput, GenerationStats, RequestParams, as_token_tensor, check_padding,
                     check_params, check_request, eos_ids, StoppingCriterion, pad_id, stop_token_list)
from .hf import check_model, context_length
from .arguments import checked_int, checked_number, integer
from .sampling import (check_generation_config, merged_by_type, unsupported_option, unsupported_search,
                       with_model_defaults)


class _Keyword(enum.Enum):
    """The default of `generate`'s generation config keywords: left out of the call, which takes the generation
    config's value, told apart from None given, which (as in `model.generate`) sets the field to None over it."""
    LEFT_OUT = "left out"

    def __repr__(self) -> str:
        return "<left out>"


LEFT_OUT = _Keyword.LEFT_OUT
# What `model.generate` does with a sampling option given as None: no such warper, as these values.
_SWITCHED_OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor | list[int] | list[list[int]] | list[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int | None | _Keyword = LEFT_OUT,
    config: LookaheadConfig | None = None,
    eos_token_id: int | Iterable[int] | None | _Keyword = LEFT_OUT,
    streamer=None,
    packed_linear: bool | None = None,
    compile: bool | str = False,
    do_sample: bool | None | _Keyword = LEFT_OUT,
    temperature: float | None | _Keyword = LEFT_OUT,
    top_k: int | None | _Keyword = LEFT_OUT,
    top_p: float | None | _Keyword = LEFT_OUT,
    repetition_penalty: float | None | _Keyword = LEFT_OUT,
    logits_processor: Sequence[LogitsProcessor] | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    corpus: Corpus | None = None,
    proposers: Sequence[Proposer] = (),
    pad_token_id: int | None | _Keyword = LEFT_OUT,
    stop_strings: str | Sequence[str] | None | _Keyword = LEFT_OUT,
    tokenizer: PreTrainedTokenizerBase | None = None,
    stopping_criteria: Sequence[StoppingCriterion] | None = None,
    output_scores: bool | None | _Keyword = LEFT_OUT,
    output_logits: bool | None | _Keyword = LEFT_OUT,
    generation_config: GenerationConfig | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    **generation_options,
) -> GenerateOutput:
    """Decoding with lookahead. Greedy gives `model.generate(do_sample=False)`'s output token for token;
    sampling (`do_sample=True`) draws from the same distribution as `model.generate(do_sample=True)` with the
    same options (docs/sampling.md). Options left out come from the generation config, as in `generate`; given
    as None, they set its field to None, as there too (top_k=None: no top-k, not transformers' default of 50;
    eos_token_id=None: no stop token; a config field by name, no_repeat_ngram_size=None: no such processor). Left out:
    do_sample (greedy where it sets none), the sampling options, and max_new_tokens (its max_new_tokens, else
    its max_length less the input's length, else DEFAULT_NEW_TOKENS, 128, or what the model's context leaves
    after the input where that is fewer; transformers' `generate` makes 20 there); `temperature=0` means greedy;
    `generator` seeds the sampling (one generator, drawn from by every sequence of a batch in turn), or `seed`, one
    prompt's, any integer in [-2**63, 2**64) (as an engine request's: in [0, 2**32), what `generator=torch.Generator()
    .manual_seed(seed)` draws; torch's generator keeps 32 bits of a seed, `seed` all 64). The
    generation config is the model's, or as `generate` makes it: `generation_config` with its unset fields from
    the model's, and any other generation config field passed by name over it (`min_new_tokens=5`,
    `no_repeat_ngram_size=3`, `bad_words_ids=...`: the processors they ask for apply as in `generate`; a name
    that is no field raises TypeError).

    input_ids: one prompt ([n] or [1, n]); a batch [B, n], left-padded where `attention_mask` (transformers'
    convention, 1 for a token, 0 for padding) says so (without one, any B: where the model's pad token is,
    unless it is a stop token, as `generate` infers it); or a list of 1-D prompts of any lengths. The batch is
    decoded together by an `Engine` (batch size 1 too). `sequences`: for a tensor, the input followed by the
    new tokens, [B, n + T], right-padded with the pad id after a sequence stops; for a list, each prompt
    followed by its new tokens, right-padded.

    config: None means `AUTO_CONFIG`: the n-gram pool, the window, the suffix and the recycle sources, each step
    sized to the model's forward cost on this device (measured once, cached) and shared across the batch.
    corpus: text shared across calls and sequences; the suffix source drafts from it and the recycle source from
    the predictions it keeps, and each sequence's prompt and output are added to it when it finishes. proposers:
    more draft sources (`lookahead.core.drafts.Proposer`), merged into the same tree (one prompt only: a
    proposer keeps one sequence's state). eos_token_id: one id or several; left out, the generation config's.
    pad_token_id: what fills a sequence after it stops; left out, the generation config's pad token, else the
    first stop token (as `generate`). stop_strings (left out: the generation config's), with the model's `tokenizer`,
    and stopping_criteria (transformers `StoppingCriteria`; `scores` reach them as None): as in `generate`, a
    sequence ends at the first token that completes a stop string or that a criterion stops at, that token
    kept (`RequestParams.stopping_criteria`); the generation config's `max_time` stops every sequence past that
    many seconds, as in `generate`. A caller's processor or criterion of the very type of one that `generate`
    builds from the generation config takes its place, as there (a `MaxLengthCriteria`, and an `EosTokenCriteria`
    where the call has stop tokens, is refused: there it would replace the length or the stop tokens for stopping
    alone, which max_new_tokens and eos_token_id set here). Processors, criteria and
    `prefix_allowed_tokens_fn` (transformers' constraint, called with each row's batch index and its ids) see
    one row at a time ([1, L], its left padding in front): a processor that indexes the batch sees row 0 alone.
    output_scores, output_logits (left out: the generation config's): `out.scores` / `out.logits` as in
    `generate(..., return_dict_in_generate=True)`: per new token position a [B, vocab] float32 tensor, the scores
    each token was picked from (its logits after the processors and warpers) or the raw logits; a row whose
    sequence has stopped holds 0 for the pad token and -inf elsewhere (`generate` would run the model on
    its pad tokens), so that `model.compute_transition_scores` gives 0 there. streamer: any transformers streamer (one prompt only); it gets the prompt, then every
    committed token. packed_linear: run the model's linear layers in eager steps on prepacked weights (CPU:
    MKL's for float32, oneDNN's for float32 or bfloat16; None: the packer and the step sizes that measured
    faster on this machine); see `hf.PackedLinears`. compile: run decoding steps through `torch.compile` of the
    model, padded to a few fixed heights (`HFModelRunner.compiled_heights`), each compiled on first use (seconds
    to minutes per graph on a CPU; a height whose compilation fails runs eagerly, with a warning). On a CPU where
    our float32 kernel runs (`lookahead.kernels`), the compiled graphs call it on one packed copy of the linear
    weights (a graph compiles in 30-60 s on 2 cores the first time, ~10 s from inductor's disk cache in later
    processes); elsewhere they freeze the weights, which inductor packs itself (a copy per graph, two graphs;
    35-70 s per graph in every process, frozen graphs are not reused from the disk cache). Off by default: the
    compilation costs more than a call of a few hundred tokens saves, though compiled steps are faster once
    compiled (our 2-core EPYC, session 29: plain decoding 1.17x eager in float32, 1.6x with int4 weights;
    lookahead 1.17x and 1.41x; docs/benchmarks.md).
    compile="cpp-wrapper": the same with the code that calls the compiled kernels in C++ rather than Python
    (3-7% faster int4 steps there; compiling a graph took up to 230 s).
    """
    check_model(model)
    keywords = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, do_sample=do_sample,
                    temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                    pad_token_id=pad_token_id, stop_strings=stop_strings, output_scores=output_scores,
                    output_logits=output_logits)
    # As in `model.generate`, a keyword given as None is None over the generation config (top_k=None: no top-k,
    # eos_token_id=None: no stop token); one left out is the config's, read from it below where the keyword is None.
    cleared = {name: None for name, value in keywords.items() if value is None}
    (max_new_tokens, eos_token_id, do_sample, temperature, top_k, top_p, repetition_penalty, pad_token_id,
     stop_strings, output_scores, output_logits) = (
        _SWITCHED_OFF.get(name) if name in cleared else None if value is LEFT_OUT else value
        for name, value in keywords.items())
    # do_sample in the config too: its checks take the sampling fields (min_p, ...) of a greedy config for ignored
    settings = _generation_config(model, generation_config,
                                  generation_options | cleared | ({"do_sample": do_sample} if do_sample else {}))
    eos_token_id = stop_token_list(eos_token_id)  # a generator of them read once, here
    criteria = _stopping_criteria(settings, stop_strings, tokenizer, stopping_criteria,
                                  bool(eos_ids(model, eos_token_id, settings)))
    _check_streamer(streamer)
    prompts, layout = _prompts(input_ids, attention_mask, inferred_padding(model, settings, eos_token_id,
                                                                           pad_token_id))
    width = layout.shape[1] if layout is not None else max(len(prompt) for prompt in prompts)
    max_new_tokens = new_token_count(settings, max_new_tokens, width, context_length(model))
    if do_sample is None:
        do_sample = bool(getattr(settings, "do_sample", None))
    if output_scores is None:
        output_scores = bool(getattr(settings, "output_scores", None))
    if output_logits is None:
        output_logits = bool(getattr(settings, "output_logits", None))
    params = RequestParams(max_new_tokens, config, eos_token_id, do_sample, temperature, top_k, top_p,
                           repetition_penalty, logits_processor, seed, generator, corpus,
                           tuple(proposers) if isinstance(proposers, (list, tuple)) else proposers, criteria,
                           output_scores, output_logits, None if settings is model.generation_config else settings,
                           prefix_allowed_tokens_fn)
    check_params(model, params)
    pad = pad_id(model, eos_token_id, settings) if pad_token_id is None else checked_int(
        "pad_token_id", pad_token_id, 0, allowed="a token id (an integer >= 0) or None")  # pad_id checks its own
    checked = [check_request(model, prompt, max_new_tokens) for prompt in prompts]
    if len(checked) > 1 and seed is not None:
        raise ValueError("seed seeds one prompt: pass one prompt, or a generator for the batch")
    if len(checked) > 1 and streamer is not None:
        raise ValueError("streamer takes one sequence: pass one prompt, or no streamer")
    if len(checked) > 1 and proposers:
        raise ValueError("proposers keep one sequence's state: pass one prompt, or no proposers")
    # A batch row's left padding goes in front of its prompt for the processors and stopping criteria, as generate
    # hands them rows.
    paddings = [check_padding(model, () if layout is None else layout[row, : layout.shape[1] - prompt.numel()])
                for row, prompt in enumerate(checked)]
    engine = Engine(model, max_batch=len(checked), max_length=max(p.numel() for p in checked) + max_new_tokens,
                    packed_linear=packed_linear, compile=compile)
    start = time.perf_counter()
    ids = [engine.add_request(prompt, _row_params(params, row), padding)
           for row, (prompt, padding) in enumerate(zip(checked, paddings))]
    generated: dict[int, list[int]] = {i: [] for i in ids}
    rows: dict[str, dict[int, list[torch.Tensor]]] = {"scores": {i: [] for i in ids}, "logits": {i: [] for i in ids}}
    finished: dict[int, GenerationStats] = {}
    if streamer is not None:
        streamer.put(layout if layout is not None else checked[0].view(1, -1))  # a padded row with its padding
    try:
        while engine.has_unfinished():
            for output in engine.step():
                if output.error is not None:
                    raise output.error
                generated[output.request_id].extend(output.tokens)
                for kind in ("scores", "logits"):
                    if getattr(output, kind) is not None:
                        rows[kind][output.request_id].append(getattr(output, kind))
                if streamer is not None and output.tokens:
                    streamer.put(torch.tensor(output.tokens))
                if output.finished:
                    finished[output.request_id] = output.stats
    finally:  # a failure ends the stream too: a reader of an iterator streamer would otherwise wait forever
        if streamer is not None:
            streamer.end()
    stats = engine.stats
    stats.seconds = time.perf_counter() - start
    stats.per_sequence = [finished[i] for i in ids]
    stats.window = max(s.window for s in stats.per_sequence)
    stats.accepted_by_source = dict(sum((Counter(s.accepted_by_source) for s in stats.per_sequence), Counter()))
    outputs = [generated[i] for i in ids]
    if layout is None:  # a list of prompts: each row is its prompt and its output
        texts = [prompt.tolist() + output for prompt, output in zip(checked, outputs)]
        width = max(map(len, texts))
        sequences = torch.tensor([text + [pad] * (width - len(text)) for text in texts], dtype=torch.long)
    else:
        width = max(map(len, outputs))
        new = torch.tensor([output + [pad] * (width - len(output)) for output in outputs], dtype=torch.long)
        sequences = torch.cat([layout, new.view(len(outputs), width)], dim=1)
    positions = max(map(len, outputs))
    return GenerateOutput(sequences, stats, *(_per_position(rows[kind], ids, pad, positions) if wanted else None
                                              for kind, wanted in (("scores", output_scores),
                                                                   ("logits", output_logits))))


def _row_params(params: RequestParams, row: int) -> RequestParams:
    """A batch row's request: its `prefix_allowed_tokens_fn` told the row (the engine calls it with batch_id 0)."""
    constraint = params.prefix_allowed_tokens_fn
    if constraint is None:
        return params
    return dataclasses.replace(params, prefix_allowed_tokens_fn=lambda _, ids: constraint(row, ids))


def _per_position(rows: dict[int, list[torch.Tensor]], ids: list[int], pad: int, width: int
                  ) -> tuple[torch.Tensor, ...]:
    """Each request's per-step [tokens, vocab] rows as `width` tensors [B, vocab], one per new token position;
    past a sequence's end, the pad token at 0 and -inf elsewhere. `rows` is emptied as they are copied (the
    scores of a long batch take gigabytes: held twice at most, not three times)."""
    out = torch.full((width, len(ids), rows[ids[0]][0].shape[-1]), -float("inf"))
    if pad < out.shape[-1]:  # a pad id outside the vocabulary (as generate takes it) has no score to set
        out[:, :, pad] = 0.0
    for b, i in enumerate(ids):
        at = 0
        for block in rows.pop(i):
            out[at : at + block.shape[0], b] = block
            at += block.shape[0]
    return tuple(out.unbind(0))


def _generation_config(model: PreTrainedModel, given: GenerationConfig | None, options: dict) -> GenerationConfig:
    """The generation config a call decodes by, as `model.generate` makes it: `given` (else a blank one), its
    unset fields from the model's, then `options` (generation config fields) over it; the model's own where the
    call sets nothing. Raises TypeError for an option that is not a generation config field, ValueError for
    attentions or hidden states asked for (nothing here returns them)."""
    check_generation_config(given)
    if given is None and not options:
        return model.generation_config
    if "assistant_model" in options:
        raise TypeError("assistant_model: assisted decoding is not what lookahead does; it drafts without a draft "
                        "model (leave assistant_model out)")
    found = unsupported_option(options.get)  # before the config is built: its own checks would say less
    if found is not None:
        raise unsupported_search(*found)
    config = with_model_defaults(model, given if given is not None else GenerationConfig())
    unknown = config.update(**options)
    if unknown:
        raise TypeError(f"generate() got options that are neither its arguments nor generation config fields: "
                        f"{', '.join(sorted(unknown))}")
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(config, name, False):
            raise ValueError(f"{name}=True: lookahead's generate returns scores and logits, not attentions or "
                             "hidden states")
    return config


# The stopping criteria `generate` builds from a keyword of its own: a caller's of the type replaces it.
_REPLACED_BY_KEYWORD = {EosTokenCriteria: ("eos_token_id", "stop tokens"),
                        MaxLengthCriteria: ("max_new_tokens", "length")}


def _stopping_criteria(settings: GenerationConfig, stop_strings: str | Sequence[str] | None,
                       tokenizer: PreTrainedTokenizerBase | None, criteria: Sequence[StoppingCriterion] | None,
                       has_stop_tokens: bool) -> tuple[StoppingCriterion, ...]:
    """The criteria a call stops by, as `generate` builds them: for the config's max_time (timed from now) and
    the stop strings, each replaced by the caller's one of its type, then the caller's others. A caller's
    `MaxLengthCriteria`, and its `EosTokenCriteria` where the call has stop tokens, is refused: in `generate` it
    would take the place of the length or the stop tokens (for stopping alone: the processors keep the config's),
    which the keywords here set. Without stop tokens `generate` builds no `EosTokenCriteria`: the caller's is one
    criterion among the others."""
    if isinstance(criteria, (str, bytes)) or not isinstance(criteria, (Sequence, type(None))):
        raise TypeError(f"stopping_criteria must be a list of transformers StoppingCriteria or None, got "
                        f"{type(criteria).__name__}")
    for criterion, keyword in ((c, _REPLACED_BY_KEYWORD.get(type(c))) for c in criteria or ()):
        if keyword is not None and (has_stop_tokens or type(criterion) is not EosTokenCriteria):
            raise ValueError(f"stopping_criteria: in transformers' generate, a caller's {type(criterion).__name__} "
                             f"replaces the {keyword[1]} it stops at, while its processors keep the generation "
                             f"config's; lookahead does not split the two: pass {keyword[0]}= instead")
    built = []
    max_time = getattr(settings, "max_time", None)
    if max_time is not None:
        checked_number("max_time", max_time, lambda v: v > 0, "a number of seconds > 0")
        built.append(MaxTimeCriteria(max_time))
    if stop_strings is None:
        stop_strings = getattr(settings, "stop_strings", None)
    if stop_strings is not None:
        stops = [stop_strings] if isinstance(stop_strings, str) else stop_strings
        if not isinstance(stops, Sequence) or not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop_strings must be a non-empty string or a non-empty list of them, got "
                             f"{stop_strings!r}")
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer= too (as generate does)")
        if not callable(getattr(tokenizer, "get_vocab", None)):
            raise TypeError(f"tokenizer must be the model's transformers tokenizer (for stop_strings), got "
                            f"{type(tokenizer).__name__}")
        if not any(type(c) is StopStringCriteria for c in criteria or ()):  # else built for nothing (tokenizer work)
            built.append(StopStringCriteria(tokenizer, list(stops)))
    return tuple(merged_by_type(built, criteria or ()))


def _prompts(input_ids, attention_mask: torch.Tensor | None, padding: int | None
             ) -> tuple[list, torch.Tensor | None]:
    """The prompts of a call, and the input tensor the output keeps (None for a list of prompts). Without
    an attention mask, the `padding` tokens of a [B, n] tensor are padding, as `generate` infers them (a 1-D
    prompt is taken whole)."""
    if (isinstance(input_ids, (list, tuple)) and input_ids
            and (isinstance(input_ids[0], (list, tuple)) or getattr(input_ids[0], "ndim", 0) >= 1)):  # numpy rows too
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a [B, n] tensor of input_ids, not with a list of prompts")
        return list(input_ids), None
    ids = as_token_tensor(input_ids)
    if ids.dim() != 2:
        if attention_mask is not None:
            raise ValueError(f"attention_mask needs input_ids of shape [B, n], got shape {list(ids.shape)}")
        return [ids], ids.reshape(1, -1).to(torch.long).cpu()
    if ids.shape[0] == 0:
        raise ValueError(f"input_ids holds no prompt (shape {list(ids.shape)}): give at least one")
    if attention_mask is None:
        if padding is None or not bool((ids == padding).any()):
            return list(ids), ids.to(torch.long).cpu()
        mask = (ids != padding).to(torch.long)
        given = (f" (inferred from the pad token, id {padding}, as generate does; pass an attention_mask, or another "
                 "pad_token_id)")
    else:
        try:
            mask, given = torch.as_tensor(attention_mask), ""
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"attention_mask must be a tensor of 0 and 1, got {attention_mask!r:.60}") from None
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {list(ids.shape)}, got {list(mask.shape)}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
        mask = mask.to(torch.long)
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise ValueError(f"attention_mask{given} must pad on the left (zeros before ones in every row); "
                         "pass a list of prompts for other layouts")
    empty = (mask.sum(dim=1) == 0).nonzero().view(-1)
    if empty.numel():
        raise ValueError(f"attention_mask{given} leaves row {int(empty[0])} without a token: every prompt "
                         "needs at least one")
    return [row[keep.bool()] for row, keep in zip(ids, mask)], ids.to(torch.long).cpu()


# max_new_tokens where neither the call nor the generation config sets a length
DEFAULT_NEW_TOKENS = 128


def new_token_count(config: GenerationConfig, max_new_tokens: int | None, width: int, context: int | None) -> int:
    """max_new_tokens, or where it is None what `model.generate` takes from the generation config: its
    max_new_tokens, else its max_length less the input's `width` (positions, padding included); else
    DEFAULT_NEW_TOKENS, or what the model's `context` leaves after the input where that is fewer: a length nobody
    asked for is not refused (a prompt that fills the context still is)."""
    if max_new_tokens is not None:
        return checked_int("max_new_tokens", max_new_tokens, 1)
    if getattr(config, "max_new_tokens", None) is not None:
        return config.max_new_tokens
    length = getattr(config, "max_length", None)
    if length is None:
        return DEFAULT_NEW_TOKENS if context is None or context <= width else min(DEFAULT_NEW_TOKENS, context - width)
    positions = integer(length)
    if positions is None or positions <= width:
        raise ValueError(f"max_new_tokens is unset and the generation config sets max_length={length!r}, "
                         f"which leaves no room after the input's {width} positions: pass max_new_tokens")
    return positions - width


def _check_streamer(streamer) -> None:
    """Raise, naming the argument, for an object of the wrong kind that would otherwise fail deep inside."""
    if streamer is not None and not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise TypeError(f"streamer must be a transformers streamer (with put() and end()), got {type(streamer).__name__}")


def inferred_padding(model: PreTrainedModel, settings: GenerationConfig, eos_token_id, pad_token_id: int | None
                     ) -> int | None:
    """The token `generate` reads as padding when it gets no attention mask: the pad token given, else the
    generation config's, unless it is a stop token too."""
    pad = getattr(settings, "pad_token_id", None) if pad_token_id is None else pad_token_id
    return None if pad is None or pad in eos_ids(model, eos_token_id, settings) else int(pad)

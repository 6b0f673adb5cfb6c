"""Decoding options: sampling and logits processors, resolved the way transformers' `generate` does."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    GenerationConfig,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.logits_process import TopHLogitsWarper

from .core.decoder import LogitsTransform
from .core.verify import ChooseRule, gumbel_noise, sample_choice
from .arguments import checked_int, checked_number, integer

# What `generate` uses when neither the call nor the model's generation config sets a value.
GENERATE_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
# Generation-config options that take `generate` away from greedy search or sampling (or ask for drafting of
# another kind), with the value that leaves them off.
UNSUPPORTED_CONFIG = {"num_beams": 1, "penalty_alpha": None, "dola_layers": None, "guidance_scale": 1,
                      "watermarking_config": None, "num_return_sequences": 1, "force_words_ids": None,
                      "constraints": None, "prompt_lookup_num_tokens": None, "assistant_early_exit": None,
                      "use_mtp": None, "token_healing": False}
# What to do instead of an option refused there, where there is something.
_INSTEAD = {"num_return_sequences": " (for several samples of a prompt, pass it several times in a list of prompts "
                                    "with do_sample=True: each row draws its own)",
            "prompt_lookup_num_tokens": " (lookahead's suffix source drafts from the prompt already)",
            "token_healing": " (heal the prompt first: model.heal_tokens(input_ids, tokenizer))"}
# What an option refused there asks for, where it is not a search.
_ASKS_FOR = {"prompt_lookup_num_tokens": "drafting of another kind", "assistant_early_exit": "drafting of another kind",
             "use_mtp": "drafting of another kind", "watermarking_config": "watermarking",
             "token_healing": "token healing (a rewritten prompt)"}


def unsupported_option(get: Callable[[str], object]) -> tuple[str, object] | None:
    """The first option of UNSUPPORTED_CONFIG that `get(name)` sets to a value that does not leave it off, with
    that value; None where there is none."""
    for name, plain in UNSUPPORTED_CONFIG.items():
        value = get(name)
        if value is not None and value != plain:
            return name, value
    return None


def unsupported_search(name: str, value: object, where: str = "") -> ValueError:
    """The refusal of an option `unsupported_option` found (`where`: where it was set, as said after it)."""
    return ValueError(f"{name}={value!r}{where} asks for {_ASKS_FOR.get(name, 'a search')}, which lookahead does not "
                      f"do; leave it at {UNSUPPORTED_CONFIG[name]!r}{_INSTEAD.get(name, '')}")


@dataclass(frozen=True)
class DecodingRule:
    choose: ChooseRule | None  # None: argmax
    transform: LogitsTransform | None  # None: the raw logits


@dataclass(frozen=True)
class DecodingOptions:
    """The options of `generate` that decide how a token is picked from a position's logits."""

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    logits_processor: Sequence[LogitsProcessor] | None = None
    generator: torch.Generator | None = None
    generation_config: GenerationConfig | None = None  # None: the model's
    # transformers' (batch_id, input_ids) -> allowed next tokens; called with this sequence's ids, batch_id 0
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None
    seed: int | None = None  # the sequence's own sampling seed (`noise_seed`); None: one drawn from `generator`

    def config(self, model: PreTrainedModel) -> GenerationConfig:
        return model.generation_config if self.generation_config is None else self.generation_config


def decoding_rule(model: PreTrainedModel, options: DecodingOptions, prompt: torch.Tensor, max_new_tokens: int,
                  eos: Sequence[int], padding: int = 0) -> DecodingRule:
    """Validate the options and build the processors `generate` would for the prompt's token ids (`[n]`, the
    first `padding` of them a batch row's left padding) stopping at `eos`, in transformers' order: those
    the model's generation config asks for (sequence bias, repetition penalties, no-repeat n-grams, bad words,
    minimum lengths, the prefix constraint, forced tokens, suppressed tokens), the
    user's processors (one of the same type as one of those replacing it, as in `generate`), then (sampling
    only) temperature, top-k, top-p and the other warpers the config sets, and last the config's
    `renormalize_logits`. temperature=0 means greedy."""
    check_decoding_options(model, options)
    config = options.config(model)

    def resolved(name: str, value):
        if value is not None:
            return value
        configured = getattr(config, name, None)
        return GENERATE_DEFAULTS[name] if configured is None else configured

    temperature = resolved("temperature", options.temperature)
    sampling = options.do_sample and temperature != 0
    processors = LogitsProcessorList(merged_by_type(
        _config_processors(config, resolved("repetition_penalty", options.repetition_penalty), prompt,
                           max_new_tokens, list(eos), model.device, padding, options.prefix_allowed_tokens_fn),
        options.logits_processor or []))
    if sampling:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if getattr(config, "top_h", None) is not None:
            processors.append(TopHLogitsWarper(config.top_h))
        k = resolved("top_k", options.top_k)
        if k:
            processors.append(TopKLogitsWarper(integer(k)))  # it takes a Python int alone
        p = resolved("top_p", options.top_p)
        if p < 1.0:
            processors.append(TopPLogitsWarper(p))
        processors.extend(_config_warpers(config, model.device))
    if getattr(config, "renormalize_logits", None) is True:  # last, as in generate: scores as log-probabilities
        processors.append(LogitNormalization())
    choose = None
    if sampling:
        # One seed for the sequence, every position then its own noise: the tokens drawn do not depend on the
        # guesses, the batch or the step sizes.
        seed = _drawn_seed(options.generator) if options.seed is None else noise_seed(int(options.seed))

        def choose(scores: torch.Tensor, candidates: list[tuple[int, int]], position: int):
            return sample_choice(scores, candidates, gumbel_noise(seed, position, scores.numel(), scores.device))
    return DecodingRule(choose, processors or None)


def _drawn_seed(generator: torch.Generator | None) -> int:
    """A sequence's noise seed drawn from `generator` (None: torch's global one)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def noise_seed(seed: int) -> int:
    """The noise seed of a sequence sampled with `seed` (an integer in [-2**63, 2**64)): for seeds in [0, 2**32),
    the one `torch.Generator().manual_seed(seed)` gives it, so that a seeded request samples what `generate` does
    with that generator; any other seed as its 64 bits, as torch's CPU generator does not take them (it keeps a
    seed's low 32: seeds 2**32 apart sampled alike). Not one-to-one: the 2**32 large seeds that equal what a small
    seed draws sample as that one does (a random large seed: one chance in 2**32)."""
    if 0 <= seed < 2**32:
        return _drawn_seed(torch.Generator().manual_seed(seed))
    return seed % 2**64


def list_of(values: object, valid: Callable[[object], bool]) -> bool:
    """Whether `values` is a list or tuple whose items all pass `valid`; not a lone item (a callable), a string,
    nor an iterator, which checking it would use up."""
    return isinstance(values, Sequence) and not isinstance(values, (str, bytes)) and all(map(valid, values))


def type_names(value: object) -> str:
    """A refused value in an error message: its type, and its items' types where it is a list."""
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {sorted({type(item).__name__ for item in value})}"
    return type(value).__name__


def check_decoding_options(model: PreTrainedModel, options: DecodingOptions) -> None:
    """Raise ValueError (TypeError for an object of the wrong kind), naming the option and what is allowed, for
    decoding options `decoding_rule` cannot follow; no side effects (nothing is drawn from the generator)."""
    check_generation_config(options.generation_config)  # first: a request's do_sample unset is read from it
    if not isinstance(options.do_sample, bool):
        raise ValueError(f"do_sample must be a bool, got {options.do_sample!r}")
    for name, valid, allowed in (("temperature", lambda v: v >= 0, "a number >= 0 (0 means greedy)"),
                                 ("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
                                 ("repetition_penalty", lambda v: v > 0, "a number > 0")):
        if getattr(options, name) is not None:  # None: the generation config's
            checked_number(name, getattr(options, name), valid, allowed)
    top_k = options.top_k
    if top_k is not None:
        checked_int("top_k", top_k, 0, allowed="an integer >= 0 (0 disables it)")
    if options.generator is not None and not isinstance(options.generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(options.generator).__name__}")
    if options.logits_processor is not None and not list_of(options.logits_processor, callable):
        raise TypeError("logits_processor must be a list of transformers LogitsProcessor (a LogitsProcessorList "
                        f"too), got {type_names(options.logits_processor)}")
    if options.prefix_allowed_tokens_fn is not None and not callable(options.prefix_allowed_tokens_fn):
        raise ValueError("prefix_allowed_tokens_fn must be a callable (batch_id, input_ids) -> allowed token ids, "
                         f"got {type(options.prefix_allowed_tokens_fn).__name__}")
    config = options.config(model)
    if config.encoder_repetition_penalty is not None:
        checked_number("encoder_repetition_penalty", config.encoder_repetition_penalty, lambda v: v > 0, "a number > 0")
    found = unsupported_option(lambda name: getattr(config, name, None))
    if found is not None:
        name, value = found
        if options.generation_config is None:
            raise ValueError(f"the model's generation config sets {name}={value!r}, which lookahead does not "
                             f"decode with; set model.generation_config.{name} = {UNSUPPORTED_CONFIG[name]!r} to "
                             "decode without it")
        raise unsupported_search(name, value, " (generation config)")


def check_generation_config(given: object) -> None:
    if given is not None and not isinstance(given, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig or None, got {type(given).__name__}")


def with_model_defaults(model: PreTrainedModel, given: GenerationConfig) -> GenerationConfig:
    """A copy of `given` with its unset fields from the model's generation config, as `model.generate` completes
    a config it is passed (its stop tokens, its sampling options). A config this made is complete: it comes back as
    it is, so that a field a call then set to None (`generate(top_k=None)`: as in `model.generate`, none) stays None
    where `generate` hands its config on to the engine."""
    if _COMPLETED.get(id(given)) is given:
        return given
    config = copy.deepcopy(given)
    config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    _COMPLETED[id(config)] = config
    return config


_COMPLETED: weakref.WeakValueDictionary[int, GenerationConfig] = weakref.WeakValueDictionary()


Listed = TypeVar("Listed")


def merged_by_type(built: Sequence[Listed], given: Sequence[Listed]) -> list[Listed]:
    """`generate`'s merge of the processors (or stopping criteria) it builds with the caller's: a caller's one of
    the very type of a built one takes its place, the caller's others follow."""
    merged = [next((g for g in given if type(g) is type(b)), b) for b in built]
    return merged + [g for g in given if not any(g is m for m in merged)]


def _config_processors(config: GenerationConfig, repetition_penalty: float, prompt: torch.Tensor,
                       max_new_tokens: int, eos: list[int], device: torch.device, padding: int = 0,
                       prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None
                       ) -> LogitsProcessorList:
    """The processors `generate` applies for the model's generation config, before the user's (transformers
    5's `_get_logits_processor`, for a decoder-only model fed input ids, which are also its "encoder" ids; the
    length options counted as `generate` counts them: min_new_tokens overrides min_length, max_length is the
    prompt plus max_new_tokens; the repetition penalty skips the `padding`, as `generate` has it skip a row's by
    its attention mask)."""
    processors = LogitsProcessorList()
    prompt_length = prompt.numel()
    encoder_penalty = config.encoder_repetition_penalty not in (None, 1.0)
    # Sizes and lengths of 0 or less leave their processors out, as in generate.
    encoder_ngrams = config.encoder_no_repeat_ngram_size is not None and config.encoder_no_repeat_ngram_size > 0
    # The prompt as the "encoder" ids those two read, made only where one is set; generate ignores them for
    # negative ids.
    encoder_ids = (prompt.view(1, -1).to(device) if (encoder_penalty or encoder_ngrams) and not bool((prompt < 0).any())
                   else None)
    if config.sequence_bias is not None:
        processors.append(SequenceBiasLogitsProcessor(config.sequence_bias))
    if encoder_ids is not None and encoder_penalty:
        processors.append(EncoderRepetitionPenaltyLogitsProcessor(float(config.encoder_repetition_penalty),
                                                                  encoder_ids))
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty, prompt_ignore_length=padding or None))
    if config.no_repeat_ngram_size is not None and config.no_repeat_ngram_size > 0:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if encoder_ids is not None and encoder_ngrams:
        processors.append(EncoderNoRepeatNGramLogitsProcessor(config.encoder_no_repeat_ngram_size, encoder_ids))
    if config.bad_words_ids is not None:
        processors.append(NoBadWordsLogitsProcessor(config.bad_words_ids, eos or None))
    min_length = prompt_length + config.min_new_tokens if config.min_new_tokens is not None else config.min_length
    if eos and min_length is not None and min_length > 0:
        processors.append(MinLengthLogitsProcessor(min_length, eos, device=device))
    if eos and config.min_new_tokens is not None and config.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos, device=device))
    if prefix_allowed_tokens_fn is not None:
        processors.append(PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn, 1))
    if config.forced_bos_token_id is not None:
        processors.append(ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        processors.append(ForcedEOSTokenLogitsProcessor(prompt_length + max_new_tokens, config.forced_eos_token_id,
                                                        device=device))
    if config.remove_invalid_values is True:
        processors.append(InfNanRemoveLogitsProcessor())
    if config.exponential_decay_length_penalty is not None:
        # eos as a long tensor: a list, empty, becomes a float tensor, which the processor refuses
        processors.append(ExponentialDecayLengthPenalty(config.exponential_decay_length_penalty,
                                                        torch.tensor(eos, dtype=torch.long), prompt_length))
    if config.suppress_tokens is not None:
        processors.append(SuppressTokensLogitsProcessor(config.suppress_tokens, device=device))
    if config.begin_suppress_tokens is not None:
        begin = prompt_length + (prompt_length == 1 and config.forced_bos_token_id is not None)
        processors.append(SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin, device=device))
    return processors


def _config_warpers(config: GenerationConfig, device: torch.device) -> list[LogitsProcessor]:
    """The sampling warpers the model's generation config sets beyond temperature, top-k and top-p, in
    `generate`'s order."""
    warpers: list[LogitsProcessor] = []
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(config.min_p))
    if config.typical_p is not None and config.typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(config.typical_p))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        warpers.append(EpsilonLogitsWarper(config.epsilon_cutoff))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        warpers.append(EtaLogitsWarper(config.eta_cutoff, device=device))
    return warpers


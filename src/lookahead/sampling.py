"""Decoding options: sampling and logits processors, resolved the way transformers' `generate` does."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .core.decoder import LogitsTransform
from .core.verify import ChooseRule, gumbel_noise, sample_choice

# What `generate` uses when neither the call nor the model's generation config sets a value.
GENERATE_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class DecodingRule:
    choose: ChooseRule | None  # None: argmax
    transform: LogitsTransform | None  # None: the raw logits


def decoding_rule(
    model: PreTrainedModel,
    do_sample: bool,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float | None,
    logits_processor: Sequence[LogitsProcessor] | None,
    generator: torch.Generator | None,
) -> DecodingRule:
    """Validate the options and build the processors in transformers' order: repetition penalty, the
    user's processors, then (sampling only) temperature, top-k, top-p. temperature=0 means greedy."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be a bool, got {do_sample!r}")
    _check_number("temperature", temperature, lambda v: v >= 0, "a number >= 0 (0 means greedy)")
    _check_number("top_p", top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")
    _check_number("repetition_penalty", repetition_penalty, lambda v: v > 0, "a number > 0")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if logits_processor is not None and not all(callable(p) for p in logits_processor):
        raise ValueError("logits_processor must be a list of transformers LogitsProcessor (callables)")

    def resolved(name: str, value):
        if value is not None:
            return value
        configured = getattr(model.generation_config, name, None)
        return GENERATE_DEFAULTS[name] if configured is None else configured

    temperature = resolved("temperature", temperature)
    sampling = do_sample and temperature != 0
    processors = LogitsProcessorList()
    penalty = resolved("repetition_penalty", repetition_penalty)
    if penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty))
    processors.extend(logits_processor or [])
    if sampling:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        k = resolved("top_k", top_k)
        if k:
            processors.append(TopKLogitsWarper(k))
        p = resolved("top_p", top_p)
        if p < 1.0:
            processors.append(TopPLogitsWarper(p))
    choose = None
    if sampling:
        # One draw from the generator (or torch's global one) seeds the sequence; every position then has
        # its own noise, so the tokens drawn do not depend on the guesses, the batch or the step sizes.
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))

        def choose(scores: torch.Tensor, candidates: list[tuple[int, int]], position: int):
            return sample_choice(scores, candidates, gumbel_noise(seed, position, scores.numel(), scores.device))
    return DecodingRule(choose, processors or None)


def _check_number(name: str, value: object, valid, allowed: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not valid(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

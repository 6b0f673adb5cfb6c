"""`generate`: lookahead decoding of one sequence with a Hugging Face causal LM."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, PreTrainedModel

from .config import AUTO_CONFIG, LookaheadConfig
from .core.decoder import LookaheadDecoder
from .core.drafts import Proposer
from .core.suffix import Corpus
from .costs import cost_curve
from .hf import HFModelRunner, context_length, vocabulary_size
from .sampling import decoding_rule


@dataclass
class GenerationStats:
    steps: int = 0  # forward passes after the prompt's prefill
    new_tokens: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0  # inside the model's forward (prefill included); the rest is our overhead
    tokens_fed: int = 0  # tokens fed to the model over all steps (the per-step FLOPs budget)
    accepted_per_step: list[int] = field(default_factory=list, repr=False)
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # accepted guess tokens per draft source
    window: int = 0  # columns of the lookahead window the step fed (the budget's choice under `budget`)
    # Where the time went: prefill; per step, plan (pool lookup, guess tree, layout), inputs (mask,
    # positions), forward (the model), verify (verification, window and pool update), commit (cache);
    # other: the rest (the loop itself, streamer).
    phase_seconds: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "tokens_per_step": self.tokens_per_step,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "forward_seconds": self.forward_seconds,
            "tokens_fed": self.tokens_fed,
            "accepted_by_source": dict(self.accepted_by_source),
            "window": self.window,
            "phase_seconds": dict(self.phase_seconds),
        }


@dataclass
class GenerateOutput:
    sequences: torch.LongTensor  # [1, prompt + new]
    stats: GenerationStats


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor | list[int],
    max_new_tokens: int = 128,
    config: LookaheadConfig | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    streamer=None,
    packed_linear: bool | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    logits_processor: Sequence[LogitsProcessor] | None = None,
    generator: torch.Generator | None = None,
    corpus: Corpus | None = None,
    proposers: Sequence[Proposer] = (),
) -> GenerateOutput:
    """Decoding with lookahead. Greedy (the default) gives `model.generate(do_sample=False)`'s output token
    for token; sampling (`do_sample=True`) draws from the same distribution as `model.generate(do_sample=True)`
    with the same options (docs/sampling.md). Unset sampling options come from the model's generation
    config, as in `generate`; `temperature=0` means greedy; `generator` seeds the sampling.

    config: None means `AUTO_CONFIG`: the n-gram pool, the window and the suffix source, each step sized to
    the model's forward cost on this device (measured once, cached). corpus: text shared across calls; the
    suffix source drafts from it, and this call's prompt and output are added to it at the end.
    proposers: more draft sources (`lookahead.core.drafts.Proposer`), merged into the same tree.
    input_ids: [1, n] or [n] token ids (batch size 1). eos_token_id: one id or several; None takes the
    model's generation config. streamer: any transformers streamer; it gets the prompt, then every
    committed token. packed_linear: run the model's linear layers on oneDNN-prepacked weights (CPU
    float32/bfloat16 only; None: for the step sizes where that measured faster on this machine); see
    `hf.PackedLinears`.
    """
    if config is not None and not isinstance(config, LookaheadConfig):
        raise TypeError(f"config must be a LookaheadConfig or None, got {type(config).__name__}")
    runner = HFModelRunner(model, packed_linear=packed_linear)
    prompt = check_request(model, input_ids, max_new_tokens)
    config = AUTO_CONFIG if config is None else config
    if corpus is not None and not isinstance(corpus, Corpus):
        raise TypeError(f"corpus must be a lookahead Corpus or None, got {type(corpus).__name__}")
    rule = decoding_rule(model, do_sample, temperature, top_k, top_p, repetition_penalty, logits_processor, generator)
    stop_ids = _eos_ids(model, eos_token_id)

    # The cost curve sizes budgeted steps; measuring it (once per model shape and machine, before the clock
    # starts) also settles which linear path runs (hf.PackedLinears).
    cost = cost_curve(runner) if config.budget or runner.packing is None else None
    start = time.perf_counter()
    stats = GenerationStats()
    lap = _Laps(stats.phase_seconds)
    decoder = LookaheadDecoder(config, prompt.tolist(), choose=rule.choose, transform=rule.transform, corpus=corpus,
                               cost=cost, proposers=proposers)
    stats.window = decoder.window.width
    cache = runner.new_cache()
    if prompt.numel() > 1:
        runner.prefill(cache, prompt[:-1])
    lap("prefill")
    prefill_forward = runner.forward_seconds
    if streamer is not None:
        streamer.put(prompt.view(1, -1))
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        lap("other")
        plan = decoder.plan()
        lap("plan")
        past = cache.get_seq_length()
        logits = runner.logits(cache, plan.tokens, past + plan.layout.offsets, plan.layout.allowed, plan.layout.logit_rows)
        lap("inputs")
        stats.tokens_fed += plan.layout.size
        result = decoder.update(plan, logits)
        lap("verify")
        tokens = result.tokens[: max_new_tokens - len(generated)]
        finished = False
        for index, token in enumerate(tokens):
            if token in stop_ids:
                tokens, finished = tokens[: index + 1], True
                break
        generated.extend(tokens)
        stats.steps += 1
        stats.accepted_per_step.append(len(tokens))
        if streamer is not None:
            streamer.put(torch.tensor(tokens))
        if finished or len(generated) >= max_new_tokens:
            break
        runner.commit(cache, past, result.kept_rows)
        lap("commit")
    if streamer is not None:
        streamer.end()
    lap("other")
    stats.new_tokens = len(generated)
    stats.accepted_by_source = dict(decoder.accepted_by_source)
    if corpus is not None:
        corpus.add(prompt.tolist() + generated)
    stats.seconds = time.perf_counter() - start
    stats.forward_seconds = runner.forward_seconds
    stats.phase_seconds["forward"] = runner.forward_seconds - prefill_forward
    stats.phase_seconds["inputs"] -= stats.phase_seconds["forward"]  # the lap ran the forward too
    sequences = torch.cat([prompt, torch.tensor(generated, dtype=torch.long)]).view(1, -1)
    return GenerateOutput(sequences, stats)


def check_request(model: PreTrainedModel, input_ids: torch.Tensor | list[int], max_new_tokens: int) -> torch.Tensor:
    """The prompt as a 1-D long tensor, once every check that needs no forward pass has passed: the ids
    lie in the model's vocabulary and the prompt plus `max_new_tokens` fits the model's context.
    Raises ValueError naming the argument and what is allowed."""
    prompt = _prompt_tensor(input_ids)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    vocabulary = vocabulary_size(model)
    outside = prompt[(prompt < 0) | (prompt >= vocabulary)]
    if outside.numel():
        raise ValueError(
            f"input_ids holds token id {int(outside[0])}, outside the model's vocabulary [0, {vocabulary})"
        )
    context = context_length(model)
    if context is not None and prompt.numel() > context:
        raise ValueError(f"the prompt has {prompt.numel()} tokens, more than the model's context of {context} positions")
    if context is not None and prompt.numel() + max_new_tokens > context:
        raise ValueError(
            f"the prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt.numel() + max_new_tokens} exceeds the model's context of {context} positions; "
            f"max_new_tokens can be at most {context - prompt.numel()} for this prompt"
        )
    return prompt


def _prompt_tensor(input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.numel() == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"input_ids must have batch size 1 (shape [1, n]), got shape {list(ids.shape)}")
        ids = ids[0]
    elif ids.dim() != 1:
        raise ValueError(f"input_ids must have shape [1, n] or [n], got shape {list(ids.shape)}")
    return ids.to(torch.long).cpu()


class _Laps:
    """Adds the time since the previous lap to `totals[name]`."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - self.last
        self.last = now


def _eos_ids(model: PreTrainedModel, eos_token_id: int | Iterable[int] | None) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return set(torch.as_tensor(list(eos_token_id)).tolist())

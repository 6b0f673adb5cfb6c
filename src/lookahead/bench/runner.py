"""Side-by-side benchmark: every method on the same model, prompts and machine, in one process."""

from __future__ import annotations

import copy
import math
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..baseline import hf_generate
from ..config import PLAIN_CONFIG, LookaheadConfig
from ..machine import cpu_fields
from ..generation import generate
from ..prompts import encode_messages, encode_prompt, has_chat_template
from ..quant import rounding_dtype, weights_of
from ..workloads import Prompt

PLD_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


@dataclass(frozen=True)
class Method:
    name: str  # shown in the report: "greedy" (or "sample"), "pld", "plain", "lookahead-{config label}"
    kind: str  # "generate" (transformers), "pld" (transformers' prompt lookup), "plain" or "lookahead" (ours)
    config: LookaheadConfig | None = None  # "lookahead": its step's (None: the automatic config, as in generate)
    compile: bool | str = False  # ours, through `generate(compile=...)`


def standard_methods(
    configs: Iterable[LookaheadConfig], baselines: Iterable[str] = ("greedy", "pld", "plain"), sampling: bool = False,
    compile: bool | str = False,
) -> list[Method]:
    """`baselines` from "greedy" (transformers' generate; shown as "sample" when sampling), "pld", "plain".
    compile: each of our methods also runs compiled, as "<name>-compiled" ("<name>-cpp-wrapper" in that mode)."""
    kinds = {"greedy": "generate", "pld": "pld", "plain": "plain"}
    methods = [Method("sample" if sampling and b == "greedy" else b, kinds[b]) for b in baselines]
    methods += [Method(f"lookahead-{c.label}", "lookahead", c) for c in configs]
    if compile:
        suffix = COMPILED_SUFFIXES[compile == "cpp-wrapper"]
        methods += [Method(f"{m.name}{suffix}", m.kind, m.config, compile) for m in methods
                    if m.kind in ("plain", "lookahead")]
    names = [m.name for m in methods]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"each method once: {', '.join(repeated)} given twice")
    return methods


COMPILED_SUFFIXES = ("-compiled", "-cpp-wrapper")  # a compiled method's name: its eager name and one of these


@dataclass
class Run:
    prompt_id: str
    category: str
    turn: int
    method: str
    new_tokens: int
    steps: int
    seconds: float
    forward_seconds: float | None
    tokens_fed: int | None
    identical: bool | None  # same tokens as transformers' generate (None when it did not run, or sampling)
    first_difference: int | None  # first differing new-token position, if not identical
    # At a first difference: |logit(transformers' token) - logit(ours)| there, and the median top-1 minus
    # top-2 logit gap over transformers' output, both from one float32 forward of the same weights; and
    # the spacing of the model dtype's representable values at that logit (its rounding step).
    tie_gap: float | None = None
    median_gap: float | None = None
    dtype_spacing: float | None = None
    phase_seconds: dict[str, float] | None = None  # ours only: see `GenerationStats.phase_seconds`
    accepted_by_source: dict[str, int] | None = None  # ours only: accepted guess tokens per draft source
    window: int | None = None  # ours only: the window columns fed

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0


class _ForwardCounter:
    """Counts the model's forward passes (the steps of transformers' own `generate`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def run_method(
    model: PreTrainedModel, method: Method, input_ids: torch.Tensor, max_new_tokens: int, sampling: dict | None = None
) -> tuple[list[int], int, float, float | None, int | None, dict[str, float] | None, dict[str, int] | None, int | None]:
    """(new tokens, steps, seconds, forward seconds, tokens fed, phase seconds, accepted tokens by source,
    window columns) of one method on one prompt; the last four are None for transformers' methods.
    sampling: None for greedy, else do_sample options (temperature, top_k, top_p, seed)."""
    prompt_len = input_ids.shape[1]
    options = dict(sampling or {})
    seed = options.pop("seed", 0)
    if method.kind in ("plain", "lookahead"):
        config = PLAIN_CONFIG if method.kind == "plain" else method.config
        if sampling is not None:
            options.update(do_sample=True, generator=torch.Generator().manual_seed(seed))
        else:  # greedy, whatever the model's generation config asks for (as the greedy baselines are)
            options["do_sample"] = False
        start = time.perf_counter()  # the whole call, as `hf_generate` times transformers' (our set-up included)
        out = generate(model, input_ids, max_new_tokens=max_new_tokens, config=config, compile=method.compile, **options)
        seconds = time.perf_counter() - start
        s = out.stats
        return (out.sequences[0, prompt_len:].tolist(), s.steps, seconds, s.forward_seconds, s.tokens_fed,
                s.phase_seconds, s.accepted_by_source, s.window)
    if method.kind == "pld":
        options["prompt_lookup_num_tokens"] = PLD_TOKENS
    if sampling is not None:
        torch.manual_seed(seed)
        options["do_sample"] = True
    counter = _ForwardCounter(model)
    try:
        sequences, seconds = hf_generate(model, input_ids, max_new_tokens, **options)
    finally:
        counter.close()
    return sequences[0, prompt_len:].tolist(), counter.calls, seconds, None, None, None, None, None


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


class TieMeter:
    """Logit gaps at divergences, in float32 arithmetic over the model's own weights (a float32 copy of a
    lower-precision model, made at the first divergence): how close to a tie the two choices were."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._float32: PreTrainedModel | None = None

    @torch.inference_mode()
    def gaps(
        self, input_ids: torch.Tensor, reference: list[int], ours: list[int], index: int
    ) -> tuple[float, float, float]:
        """(|gap| at `index`, median top-2 gap over `reference`, the model dtype's spacing at that logit)."""
        if self._float32 is None:
            self._float32 = self._model if self._model.dtype == torch.float32 else copy.deepcopy(self._model).float()
        sequence = torch.cat([input_ids[0], torch.tensor(reference, dtype=torch.long)]).view(1, -1)
        # Row j predicts reference[j].
        logits = self._float32(sequence.to(self._float32.device)).logits[0, input_ids.shape[1] - 1 : -1].float()
        top2 = logits.topk(2, dim=-1).values
        row = logits[index]
        chosen = float(row[reference[index]])
        spacing = torch.finfo(rounding_dtype(self._model)).eps * 2.0 ** math.floor(math.log2(max(abs(chosen), 1e-30)))
        return abs(chosen - float(row[ours[index]])), float((top2[:, 0] - top2[:, 1]).median()), spacing


def run_benchmark(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    methods: list[Method],
    max_new_tokens: int,
    on_run: Callable[[Run], None] | None = None,
    sampling: dict | None = None,
) -> list[Run]:
    """Run every method on every prompt (and turn), back to back with the order rotated per prompt.
    The conversation of a second turn continues with transformers' answer (or the first method's)."""
    runs: list[Run] = []
    ties = TieMeter(model)
    if prompts:  # warm-up: one short run per method, untimed (long enough for a compiled one to compile)
        warm = encode_prompt(tokenizer, prompts[0].turns[0], raw=prompts[0].raw)
        for method in methods:
            run_method(model, method, warm, 32 if method.compile else 4, sampling)
    for index, prompt in enumerate(prompts):
        shift = index % len(methods)
        order = methods[shift:] + methods[:shift]
        history: list[dict[str, str]] = []
        for turn, text in enumerate(prompt.turns):
            use_chat = not prompt.raw and has_chat_template(tokenizer)
            if use_chat:
                history.append({"role": "user", "content": text})
                input_ids = encode_messages(tokenizer, history)
            else:
                input_ids = encode_prompt(tokenizer, text, raw=True)
            outputs = {method: run_method(model, method, input_ids, max_new_tokens, sampling) for method in order}
            baseline = next((m for m in methods if m.kind == "generate"), None)
            compare = baseline is not None and sampling is None
            reference = outputs[baseline or methods[0]][0]
            for method in methods:
                tokens, steps, seconds, forward_seconds, tokens_fed, phases, sources, window = outputs[method]
                difference = _first_difference(tokens, reference) if compare else None
                gaps = (None, None, None)
                if difference is not None and difference < min(len(tokens), len(reference)):
                    gaps = ties.gaps(input_ids, reference, tokens, difference)
                run = Run(
                    prompt.id, prompt.category, turn, method.name, len(tokens), steps, seconds, forward_seconds,
                    tokens_fed, difference is None if compare else None, difference, *gaps, phases, sources, window,
                )
                runs.append(run)
                if on_run is not None:
                    on_run(run)
            if use_chat:
                history.append({"role": "assistant", "content": tokenizer.decode(reference, skip_special_tokens=True)})
    return runs


@dataclass
class Summary:
    method: str
    category: str
    runs: int
    new_tokens: int
    steps: int
    seconds: float
    tokens_per_step: float
    tokens_per_second: float
    # The baseline's (transformers' generate) total time per new token / this method's: the ratio of total times
    # where both made the same tokens (greedy float32), and fair where lengths differ (samples end apart).
    speedup_total: float | None
    speedup_geomean: float | None  # geometric mean of per-run ratios (of times per new token)
    speedup_vs_plain: float | None  # against our own loop with lookahead off (compiled alike)
    identical_rate: float | None
    overhead_fraction: float | None  # share of the time outside the model's forward

    def as_dict(self) -> dict:
        return asdict(self)


def per_token_speedup(baseline_seconds: float, baseline_tokens: int, seconds: float, tokens: int) -> float:
    """The baseline's time per new token over ours: a method whose output ended sooner gains nothing by it."""
    return (baseline_seconds / max(baseline_tokens, 1)) / (seconds / max(tokens, 1))


def _ratio_stats(mine: list[Run], baseline: dict[tuple, Run]) -> tuple[float | None, float | None]:
    pairs = [(baseline[(r.prompt_id, r.turn)], r) for r in mine if (r.prompt_id, r.turn) in baseline]
    if not pairs:
        return None, None
    theirs, ours = [b for b, _ in pairs], [r for _, r in pairs]
    total = per_token_speedup(sum(b.seconds for b in theirs), sum(b.new_tokens for b in theirs),
                              sum(r.seconds for r in ours), sum(r.new_tokens for r in ours))
    geomean = math.exp(sum(math.log(per_token_speedup(b.seconds, b.new_tokens, r.seconds, r.new_tokens))
                           for b, r in pairs) / len(pairs))
    return total, geomean


def summarize(runs: list[Run], baseline: str = "greedy") -> list[Summary]:
    """Per method: one row per category and one overall ("all"). `baseline`: the method speedups are
    against ("greedy", or "sample" when sampling)."""
    methods = list(dict.fromkeys(r.method for r in runs))
    categories = list(dict.fromkeys(r.category for r in runs))
    by_key = lambda name: {(r.prompt_id, r.turn): r for r in runs if r.method == name}  # noqa: E731
    greedy = by_key(baseline)
    rows = []
    for method in methods:
        # Against our loop on the same forward (compiled methods against compiled plain): the algorithm's gain.
        plain = by_key(next((f"plain{s}" for s in COMPILED_SUFFIXES if method.endswith(s) and f"plain{s}" in methods),
                            "plain"))
        for category in categories + ["all"]:
            mine = [r for r in runs if r.method == method and category in ("all", r.category)]
            if not mine:
                continue
            new_tokens, steps, seconds = (sum(getattr(r, f) for r in mine) for f in ("new_tokens", "steps", "seconds"))
            total, geomean = _ratio_stats(mine, greedy)
            vs_plain, _ = _ratio_stats(mine, plain)
            identical = [r.identical for r in mine if r.identical is not None]
            forward = [r for r in mine if r.forward_seconds is not None]
            overhead = (
                1 - sum(r.forward_seconds for r in forward) / sum(r.seconds for r in forward) if forward else None
            )
            rows.append(
                Summary(
                    method, category, len(mine), new_tokens, steps, seconds,
                    new_tokens / steps if steps else 0.0, new_tokens / seconds if seconds else 0.0,
                    total, geomean, vs_plain, sum(identical) / len(identical) if identical else None, overhead,
                )
            )
    return rows


def environment(model: PreTrainedModel) -> dict[str, object]:
    return {
        "cpu": cpu_fields().get("model name") or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": weights_of(model) or str(model.dtype).removeprefix("torch."),  # int8 / int4: quantised weights
        "model": getattr(model.config, "_name_or_path", type(model).__name__),
        "device": str(model.device),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

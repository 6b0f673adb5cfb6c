"""The engine: continuous batching of lookahead requests over one model.

Requests join (`add_request`) and leave (finished, or `abort`) between steps. Each `step` runs at most
one forward of prompt chunks for joining requests, then one forward for every decoding request: their
step layouts padded to a common height, with a block mask, on a KV store that holds a slot per
request. Each request keeps its own stop rules, sampling options, lookahead state and statistics; the
rows of the step are shared across the batch by the forward cost curve (`core.drafter.node_counts`), as
corrected by the engine's own step times (`core.prices`), which also decide whether drafts pay at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed
from transformers import GenerationConfig, LogitsProcessor, PreTrainedModel

from .config import AUTO_CONFIG, WINDOW_ROWS_BELOW, LookaheadConfig
from .core.decoder import NO_PROPOSAL, LogitsTransform, LookaheadDecoder, Proposal, StepPlan
from .core.drafter import AcceptanceStats, node_counts
from .core.drafts import Proposer
from .core.prices import StepPrices
from .core.suffix import Corpus
from .costs import CostCurve, batch_cost_curve
from .hf import HFModelRunner, available_memory, check_model, context_length, is_sharded, vocabulary_size
from .arguments import checked_int
from .runtime.batch import StepInput, causal_step, pack_steps
from .sampling import DecodingOptions, check_decoding_options, decoding_rule, list_of, type_names, with_model_defaults

# Rows a step may feed per sequence beyond its committed tokens: the store keeps this much room past
# `max_length` so that every step, padding included, is written in place: the window's rows and as many drafts.
STEP_ROOM = 2 * WINDOW_ROWS_BELOW
TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)  # what token ids may come in
_ACCEPTANCE: weakref.WeakKeyDictionary[PreTrainedModel, dict[bool, AcceptanceStats]] = weakref.WeakKeyDictionary()


def acceptance_stats(model: PreTrainedModel, sampling: bool = False) -> AcceptanceStats:
    """How often each kind of draft is accepted by `model`, learnt from every request of every engine over it
    (so every `generate` call) in this process: a call's first steps are sized by what the model accepted
    before rather than by a prior, and deep drafts get fed from the start (1.21x the speed of statistics learnt
    afresh per call on code edits and on MT-bench, docs/benchmarks.md). Sampled requests learn apart from
    greedy ones (`sampling`): a draft is accepted less often where the token is drawn. Greedy outputs and
    seeded samples do not depend on it; tokens/step and speed do, so a benchmark's first prompt is decoded
    colder than the rest."""
    by_rule = _ACCEPTANCE.get(model)
    if by_rule is None:
        by_rule = _ACCEPTANCE[model] = {}
    return by_rule.setdefault(sampling, AcceptanceStats())


# A transformers StoppingCriteria: (input_ids [B, n], scores) -> a bool per row.
StoppingCriterion = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
STEP_HISTORY = 1 << 16  # steps whose accepted tokens an engine's own stats keep (`Engine.stats`)


@dataclass
class GenerationStats:
    steps: int = 0  # forward passes after the prompt's prefill
    new_tokens: int = 0
    seconds: float = 0.0
    # Inside the model's forward (prefill included); the rest is our overhead. A request's own (a batch's
    # `per_sequence`, `StepOutput.stats`): the forwards it was in, each shared with the others in it.
    forward_seconds: float = 0.0
    tokens_fed: int = 0  # tokens fed to the model over all steps (over `steps`: the rows a step cost)
    accepted_per_step: list[int] | deque[int] = field(default_factory=list, repr=False)
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # accepted guess tokens per draft source
    window: int = 0  # columns of the lookahead window (a step under `budget` feeds it only where it pays)
    undrafted_steps: int = 0  # steps the automatic budget ran without drafts, where they did not pay
    compile_seconds: float = 0.0  # compile=True: the first call of each step shape, which compiled it
    # Where the time went: prefill; per step, plan (drafts, budget, layout, packing), inputs (mask, moving
    # inputs), forward (the model), verify (verification, window and pool update), commit (KV store);
    # other: the rest (the loop itself, streamer).
    phase_seconds: dict[str, float] = field(default_factory=dict, repr=False)
    per_sequence: list[GenerationStats] = field(default_factory=list, repr=False)  # a batch's, in order

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
            "undrafted_steps": self.undrafted_steps,
            "compile_seconds": self.compile_seconds,
            "phase_seconds": dict(self.phase_seconds),
        }


@dataclass
class GenerateOutput:
    sequences: torch.LongTensor  # [B, n + T]
    stats: GenerationStats
    # output_scores / output_logits: T tensors [B, vocab], as transformers' `generate` returns them.
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class RequestParams:
    """How one request decodes. Sampling options as in `generate`: unset ones (`do_sample` too) come from the
    generation config (the request's, else the model's), so greedy unless one asks for sampling. seed: this
    request's own sampling seed, so that its output does not depend on what else is in the batch (or pass
    `generator`); in [0, 2**32), it samples what `generator=torch.Generator().manual_seed(seed)` does, and a seed of
    [-2**63, 2**64) outside that range is taken whole (`sampling.noise_seed`). config None: `AUTO_CONFIG`.
    corpus: text shared with other requests for the suffix and recycle sources; the request's prompt and
    output are added to it when it finishes. proposers: more draft sources, owned by this request.
    stopping_criteria: transformers `StoppingCriteria` (e.g. `StopStringCriteria`), each called as `generate`
    calls it, on the prompt and the new tokens so far ([1, n]; `scores` None), after every new token: the
    request ends at the first token for which one says True, that token kept. output_scores, output_logits: each
    step's output carries its tokens' scores (the logits as processed for picking them, as `generate`'s
    `output_scores`) or logits (float32, as its `output_logits`). generation_config: what the
    model's generation config would give (stop tokens, processors, unset sampling options), as `generate`'s;
    its lengths (max_new_tokens, max_length) are not read: the request's length is `max_new_tokens`.
    prefix_allowed_tokens_fn: transformers' constraint (batch_id, input_ids) -> the token ids allowed next,
    called with batch_id 0 and this request's ids. Processors and criteria see one request's row at a time."""

    max_new_tokens: int = 128
    config: LookaheadConfig | None = None
    eos_token_id: int | Iterable[int] | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    logits_processor: Sequence[LogitsProcessor] | None = None
    seed: int | None = None
    generator: torch.Generator | None = None
    corpus: Corpus | None = None
    proposers: Sequence[Proposer] = ()
    stopping_criteria: Sequence[StoppingCriterion] | None = ()
    output_scores: bool = False
    output_logits: bool = False
    generation_config: GenerationConfig | None = None  # None: the model's
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None

    def __post_init__(self) -> None:  # a generator of stop tokens is read once, here, not at each use
        object.__setattr__(self, "eos_token_id", stop_token_list(self.eos_token_id))

    def decoding(self) -> DecodingOptions:
        """This request's decoding options."""
        return DecodingOptions(self.do_sample, self.temperature, self.top_k, self.top_p, self.repetition_penalty,
                               self.logits_processor, self.generator, self.generation_config,
                               self.prefix_allowed_tokens_fn, self.seed)


@dataclass(frozen=True)
class StepOutput:
    request_id: int
    tokens: list[int]  # committed by this step (after a stop token: none)
    finished: bool
    stats: GenerationStats | None = None  # the request's, once finished
    error: Exception | None = None  # what ended it early: its decoding rule raised (e.g. a logits processor),
    # or an interrupted step (KeyboardInterrupt) lost the tokens it had committed
    scores: torch.Tensor | None = None  # RequestParams.output_scores: [len(tokens), vocab], a row per token
    logits: torch.Tensor | None = None  # RequestParams.output_logits: the same, of the raw logits


@dataclass
class _Request:
    id: int
    prompt: torch.Tensor
    params: RequestParams
    decoder: LookaheadDecoder
    stop_ids: set[int]
    stats: GenerationStats
    started: float = 0.0  # when it got a slot
    slot: int = -1
    prefilled: int = 0  # prompt tokens in the KV store; all but the last before decoding starts
    generated: list[int] = field(default_factory=list)
    padding: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # see add_request
    text: torch.Tensor | None = None  # [1, padding + prompt + max_new_tokens]: what the stopping criteria see
    corpus_epoch: int = 0  # its corpus's epoch when it began: cleared since, the corpus takes none of its text

    @property
    def decoding(self) -> bool:
        return self.prefilled == self.prompt.numel() - 1


class Engine:
    """Continuous batching. max_batch: requests decoded together (KV slots); more wait in a queue.
    max_length: the most positions (prompt + new tokens) of any request; None: the model's context,
    at most 4096. prefill_chunk: the most prompt tokens fed per step, so that a joining request delays
    the others by at most one such forward per step (where steps run ragged, the chunks ride in the
    decoding step's own forward). packed_linear, compile: as in `generate`."""

    def __init__(self, model: PreTrainedModel, max_batch: int = 8, max_length: int | None = None,
                 prefill_chunk: int = 512, packed_linear: bool | None = None, compile: bool | str = False) -> None:
        check_model(model)
        max_batch, prefill_chunk = checked_int("max_batch", max_batch, 1), checked_int("prefill_chunk", prefill_chunk, 1)
        context = context_length(model)
        if max_length is None:
            max_length = min(context or 4096, 4096)
        max_length = checked_int("max_length", max_length, 2)
        if context is not None and max_length > context:
            raise ValueError(f"max_length ({max_length}) exceeds the model's context of {context} positions")
        self.runner = HFModelRunner(model, packed_linear=packed_linear, compile=compile)
        self.model = model
        self.max_batch, self.max_length, self.prefill_chunk = max_batch, max_length, prefill_chunk
        _check_memory(self.runner, max_batch, max_length + STEP_ROOM)
        # The cost curves size budgeted steps, one per power-of-two batch size; measuring them (once per model
        # shape and machine) also settles which linear path runs (hf.PackedLinears). Batch 1's is T(k).
        self._costs = {1 << i: batch_cost_curve(self.runner, 1 << i) for i in range(max_batch.bit_length())}
        if is_sharded(model):  # tensor parallel: every process must plan the same steps, so all take rank 0's curves
            shared = [self._costs]
            torch.distributed.broadcast_object_list(shared, src=0)
            self._costs = shared[0]
        self.cost: CostCurve = self._costs[1]
        self.store = self.runner.new_store(max_batch, max_length + STEP_ROOM)
        # Of every step, all requests together; the tokens of the last STEP_HISTORY steps alone, so that a
        # server's engine, stepping for days, keeps a bounded list.
        self.stats = GenerationStats(accepted_per_step=deque(maxlen=STEP_HISTORY))
        # The curves corrected by this engine's own step times, overheads included, and whether drafts pay at
        # all. Not under tensor parallelism: every process must plan the same steps, and each times its own.
        self.prices = None if is_sharded(model) else StepPrices(self._cost)
        self._laps = _Laps(self.stats.phase_seconds)
        self._waiting: deque[_Request] = deque()
        self._slots: list[_Request | None] = [None] * max_batch
        self._next_id = 0
        self._proposal_errors: dict[int, Exception] = {}  # this step's requests whose draft sources failed
        # Requests whose tokens an interrupted step committed but never reported: they end at the next step.
        self._interrupted: dict[int, BaseException] = {}
        self._unreported: list[StepOutput] = []  # their ends, freed by a step that then failed
        self._stepping = False
        # Held by a step, and by adding or ending a request: another thread's call waits for the step to end
        # (reentrant: this thread's, from a processor, a criterion or a draft source, is refused by name).
        self._lock = threading.RLock()

    def warm_up(self) -> None:
        """With compile=True, compile now the step shapes this engine will meet (`HFModelRunner.warm_up`: a
        few graphs, 10-70 s each on a 2-core CPU) rather than in the middle of a run; nothing otherwise."""
        self.runner.warm_up(self.max_batch)

    def add_request(self, prompt_ids: torch.Tensor | list[int], params: RequestParams | None = None,
                    padding: torch.Tensor | Sequence[int] = ()) -> int:
        """Queue a request; its id. Raises ValueError, before any work, for a request that cannot run.
        padding: the pad tokens in front of the prompt in the caller's batch row, which the request's logits
        processors and stopping criteria see in front of it, as `generate` hands them its left-padded rows (a
        no-repeat n-gram counts them, `min_length` and the processors' prompt length include them, the repetition
        penalty skips them as `generate`'s does); the model never sees them."""
        params = _with_config_defaults(self.model, RequestParams() if params is None else params)
        config = check_params(self.model, params)
        params = dataclasses.replace(params, max_new_tokens=checked_int("max_new_tokens", params.max_new_tokens, 1))
        prompt = check_request(self.model, prompt_ids, params.max_new_tokens)
        if prompt.numel() + params.max_new_tokens > self.max_length:
            raise ValueError(
                f"the prompt ({prompt.numel()} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"engine's max_length of {self.max_length} positions")
        stops = eos_ids(self.model, params.eos_token_id, params.generation_config)
        padding = check_padding(self.model, padding)
        rule = decoding_rule(self.model, params.decoding(), torch.cat([padding, prompt]),
                             params.max_new_tokens, stops, padding.numel())
        transform = rule.transform
        if transform is not None and padding.numel():
            transform = _behind_padding(padding, transform)
        # One epoch for the request, its suffix source and its serve(): a clear() by another thread lands before
        # or after all three, never between (serve() after it had bound the fresh corpus to this model's vocabulary).
        corpus = params.corpus
        with corpus.lock if corpus is not None else contextlib.nullcontext():
            epoch = corpus.epoch if corpus is not None else 0
            decoder = LookaheadDecoder(config, prompt.tolist(), choose=rule.choose, transform=transform,
                                       corpus=corpus, cost=self.cost, proposers=params.proposers,
                                       stats=acceptance_stats(self.model, rule.choose is not None),
                                       context=context_length(self.model), vocabulary=vocabulary_size(self.model),
                                       keep_scores=params.output_scores or params.output_logits)
            if corpus is not None:
                corpus.serve(vocabulary_size(self.model))
        with self._lock:
            request = _Request(self._next_id, prompt, params, decoder, set(stops),
                               GenerationStats(window=decoder.window.width), padding=padding,
                               corpus_epoch=epoch)
            self._next_id += 1
            self._waiting.append(request)
        return request.id

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(self._slots) or bool(self._unreported)

    def running(self) -> int:
        """Requests holding a slot."""
        return sum(request is not None for request in self._slots)

    def running_ids(self) -> list[int]:
        """The ids of the requests holding a slot (those the next step decodes or feeds a prompt chunk of)."""
        return [request.id for request in self._slots if request is not None]

    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    def finish(self, request_id: int, tokens: int | None = None) -> bool:
        """End a running request now, as if it had stopped after its first `tokens` new tokens (None: all it
        has): a rule of the caller's own met (a stop string). Its text goes into its corpus, as a finished
        request's does; a request still waiting is dropped. False if unknown."""
        with self._lock:
            self._refuse_during_step("finish")
            request = self._holding(request_id)
            if request is None:
                return self.abort(request_id)
            if tokens is not None:
                has = len(request.generated)
                kept = checked_int("tokens", tokens, 0, has, allowed=f"an integer in [0, {has}] (the new tokens "
                                   f"request {request_id} has) or None")
                del request.generated[kept:]
            self._finish(request)
            return True

    def abort(self, request_id: int) -> bool:
        """Drop a request, waiting or running; its slot is free for the next step. False if unknown."""
        with self._lock:
            self._refuse_during_step("abort")
            for request in self._waiting:
                if request.id == request_id:
                    self._waiting.remove(request)
                    return True
            request = self._holding(request_id)
            if request is not None:
                self._free(request)
            return request is not None

    def _refuse_during_step(self, method: str) -> None:
        """Slots move when a request leaves; in the middle of a step, the step's own bookkeeping would then
        write other requests' caches."""
        if self._stepping:
            raise RuntimeError(f"Engine.{method}() was called while Engine.step() runs (from a logits processor, a "
                               "stopping criterion or a draft source): call it between steps")

    def _holding(self, request_id: int) -> _Request | None:
        """The request of this id if it holds a slot."""
        return next((r for r in self._slots if r is not None and r.id == request_id), None)

    def step(self) -> list[StepOutput]:
        """Admit waiting requests to free slots, feed a chunk of the joining prompts, and decode one step
        of every request whose prompt is in; what each request committed. Not re-entrant; other threads'
        calls (add_request, abort, finish, step) wait for it to end."""
        with self._lock:
            self._refuse_during_step("step")
            self._stepping = True
            try:
                interrupted = [r for r in self._slots if r is not None and r.id in self._interrupted]
                reports = self._unreported + [StepOutput(r.id, [], True, error=self._interrupted.pop(r.id))
                                              for r in interrupted]
                self._unreported = []
                for request in interrupted:
                    self._free(request)
                try:
                    return reports + self._step()
                except BaseException:  # a failed forward, say: the ends of the interrupted ones come with the next step
                    self._unreported = reports + self._unreported  # (and the reports of a step interrupted once done)
                    raise
            finally:
                self._stepping = False

    def _step(self) -> list[StepOutput]:
        self._laps("other")
        self._admit()
        decoding = self._decoding()
        chunks = self._prompt_chunks()
        if chunks and not (decoding and self.runner.ragged):
            # Nothing to ride along with, or padded steps (each sequence padded to a prompt chunk's height):
            # a forward of their own, and prompts it completes decode in this step.
            self._feed_prompts(chunks)
            chunks = []
            decoding = self._decoding()
        self._laps("prefill")
        if not decoding:
            return []
        started, compiled = time.perf_counter(), len(self.runner.compile_seconds)
        plans, drafted, offered, priced = self._plans(decoding)
        steps = [StepInput(p.tokens, p.layout.offsets, p.layout.allowed, p.layout.logit_rows) for p in plans]
        # Prompt chunks ride in the decoding step's forward, after the decoding sequences' rows (no logits read):
        # a ragged step computes only their own rows, and the weights are read once for both. 15 sequences of
        # 1-3 rows over 300 cached positions beside a joining chunk (float32, 2 cores): a chunk of 16-64 rows
        # 15-23% cheaper riding than in a forward of its own, 256 rows 3-5%, 512 rows even.
        prompt_steps = [causal_step(r.prompt[r.prefilled : r.prefilled + c], logits=0) for r, c in chunks]
        members = decoding + [r for r, _ in chunks]
        lengths = [self.store.lengths[r.slot] for r in members]
        if chunks and max(lengths) + max(s.tokens.numel() for s in steps + prompt_steps) > self.store.capacity:
            self._feed_prompts(chunks)  # riding along, a chunk's height would overrun some slot's store
            chunks, prompt_steps, members, lengths = [], [], decoding, lengths[: len(decoding)]
        batch = pack_steps([r.slot for r in members], lengths, steps + prompt_steps)
        self._laps("plan")
        before = self.runner.forward_seconds
        logits = self.runner.step_logits(self.store, batch, argmax_only=all(r.decoder.argmax_only for r in decoding))
        self._laps("inputs")
        forward = self.runner.forward_seconds - before
        self.stats.phase_seconds["forward"] = self.stats.phase_seconds.get("forward", 0.0) + forward
        self.stats.phase_seconds["inputs"] -= forward  # the lap ran the forward
        self.stats.steps += 1
        for request in members:
            request.stats.forward_seconds += forward
        self._prompts_fed(chunks)
        decoded = batch.sizes[: len(decoding)]
        # Rows the forward computed for decoding (ragged: each sequence's own; padded: every row).
        self.stats.tokens_fed += sum(decoded) if self.runner.ragged else len(decoded) * batch.height
        outputs, kept, failed, committed = [], [], {}, 0
        try:
            for row, (request, plan) in enumerate(zip(decoding, plans)):
                pick = batch.picks[row]
                if request.id in self._proposal_errors:
                    failed[request.id] = self._proposal_errors.pop(request.id)
                    outputs.append([request, [], True, None, None])
                    continue
                try:
                    result = request.decoder.update(plan, logits.of(row, pick))
                    tokens, finished = self._stop(request, result.tokens)
                except Exception as error:  # noqa: BLE001 - its own rules (a user's processor or criterion) failed: it alone ends
                    failed[request.id] = error
                    outputs.append([request, [], True, None, None])
                    continue
                committed += len(result.tokens)
                request.stats.steps += 1
                request.stats.tokens_fed += plan.layout.size
                request.stats.accepted_per_step.append(len(tokens))
                kept_scores = (result.scores[: len(tokens)] if request.params.output_scores else None,
                               result.logits[: len(tokens)] if request.params.output_logits else None)
                outputs.append([request, tokens, finished, *kept_scores])
                if not finished:
                    kept.append((request.slot, result.kept_rows))
            self._laps("verify")
            # A compiling step says nothing of a step's price, nor does one that also fed prompt chunks.
            if priced and len(self.runner.compile_seconds) == compiled and not chunks:
                self.prices.record(len(decoding), batch.height, forward, time.perf_counter() - started - forward,
                                   drafted, committed, offered)
            for slot, rows in kept:
                self.store.keep(slot, rows)
        except BaseException as interruption:  # KeyboardInterrupt in a user's criterion, say (an Exception ends its
            # request alone, above): the requests this step had reached committed tokens that go unreported, and
            # their caches may not match; they end at the next step, the others decode on untouched.
            lost = RuntimeError(f"{type(interruption).__name__} interrupted the step committing this request's "
                                "tokens; they were lost with it")
            # Those it finished, and the one it was in.
            reached = [output[0] for output in outputs] + decoding[len(outputs) : len(outputs) + 1]
            for request in reached:
                self._interrupted[request.id] = failed.get(request.id, lost)
            raise
        self._laps("commit")
        self.stats.accepted_per_step.append(sum(len(output[1]) for output in outputs))
        self.stats.new_tokens += self.stats.accepted_per_step[-1]
        reports, interruption = [], None
        for request, tokens, finished, scores, logits in outputs:
            if request.id in failed:
                self._free(request)
                reports.append(StepOutput(request.id, [], True, error=failed[request.id]))
                continue
            stats, error = None, None
            if finished:
                try:
                    stats = self._finish(request)
                except Exception as failure:  # noqa: BLE001 - its corpus refused its text (a MemoryError, say): it
                    stats, error = request.stats, failure  # ends with its tokens and that error
                except BaseException as failure:  # an interrupt: every report of the step comes with the next one
                    stats, interruption = request.stats, interruption or failure
            reports.append(StepOutput(request.id, tokens, finished, stats, error, scores, logits))
        self.stats.forward_seconds = self.runner.forward_seconds
        self.stats.compile_seconds = sum(self.runner.compile_seconds.values())
        if interruption is not None:
            self._unreported = reports
            raise interruption
        return reports

    def _plans(self, decoding: list[_Request]) -> tuple[list[StepPlan], bool, bool, bool]:
        """Each request's step, sized together: the rows go where they pay for the batch as a whole. Also
        whether the step carries drafts, whether any were on offer, and whether it is priced (every request
        has the budget). Where drafts do not pay at this batch size (`StepPrices.drafts`), budgeted requests feed
        their last token alone, without proposing anything."""
        budgeted = [r.decoder.cost is not None for r in decoding]
        # Priced only where every request has the budget: beside a request of a fixed config, every step is
        # drafted and taller than one row, so the prices would never see the plain steps they are judged by.
        prices = self.prices if self.prices is not None and all(budgeted) else None
        cost = prices.cost(len(decoding)) if prices is not None else self._cost(len(decoding))
        drafts = prices is None or prices.drafts(len(decoding))
        drafting = [drafts or not b for b in budgeted]
        proposals = [self._proposal(r) if d else NO_PROPOSAL for r, d in zip(decoding, drafting)]
        lefts = [r.params.max_new_tokens - len(r.generated) for r in decoding]
        # The window's rows feed later steps: not the last one a request may take.
        windows = [d and left > 1 and r.decoder.window_pays(cost) and r.decoder.window_fits()
                   for r, d, left in zip(decoding, drafting, lefts)]
        demands = []
        for request, proposal, window, left in zip(decoding, proposals, windows, lefts):
            # Nodes past the last token this request may still commit cannot pay.
            most = min(request.decoder.base_rows(window) + left - 1, STEP_ROOM)
            demands.append(request.decoder.demand(proposal, window, most))
        counts = node_counts(demands, cost)
        if not drafts:
            self.stats.undrafted_steps += 1
            for request, d in zip(decoding, drafting):
                request.stats.undrafted_steps += not d
        return ([r.decoder.plan(p, n, w) for r, p, n, w in zip(decoding, proposals, counts, windows)],
                any(drafting), any(d.gains for d in demands), prices is not None)

    def _proposal(self, request: _Request) -> Proposal:
        """The request's drafts for this step; where one of its own draft sources fails, none, and the request
        ends with that error after the step (`_proposal_errors`), the others unharmed."""
        try:
            return request.decoder.propose()
        except Exception as error:  # noqa: BLE001 - a user's draft source (RequestParams.proposers) raised
            self._proposal_errors[request.id] = error
            return NO_PROPOSAL

    def _cost(self, batch: int) -> CostCurve:
        """The relative cost of a step of `batch` sequences by its height: the measured curve of the largest
        power of two not above `batch` (all of them up to max_batch are measured when the engine starts)."""
        return self._costs[1 << (batch.bit_length() - 1)]

    def _stop(self, request: _Request, tokens: list[int]) -> tuple[list[int], bool]:
        """The tokens the request keeps (up to its stop token, its length or the first token a stopping
        criterion stops at) and whether it is done."""
        tokens, finished = kept_tokens(tokens, request.params.max_new_tokens - len(request.generated),
                                       request.stop_ids)
        if request.params.stopping_criteria:
            before = request.padding.numel() + request.prompt.numel()
            if request.text is None:
                request.text = torch.empty(1, before + request.params.max_new_tokens, dtype=torch.long)
                request.text[0, :before] = torch.cat([request.padding, request.prompt])
            end = before + len(request.generated)
            request.text[0, end : end + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            for count in range(1, len(tokens) + 1):  # as generate checks them: after each token
                if any(bool(torch.as_tensor(criterion(request.text[:, : end + count], None)).any())
                       for criterion in request.params.stopping_criteria):
                    tokens, finished = tokens[:count], True
                    break
        request.generated.extend(tokens)
        return tokens, finished

    def _admit(self) -> None:
        while self._waiting and None in self._slots:
            request = self._waiting[0]
            request.started = time.perf_counter()
            request.slot = self._slots.index(None)
            # In its slot before it leaves the queue: another thread's `has_unfinished` (read without the lock, as a
            # server's event loop reads `running` and `waiting`) never finds it in neither.
            self._slots[request.slot] = request
            self._waiting.popleft()

    def _decoding(self) -> list[_Request]:
        """The requests in slots whose prompts are all in, in slot order."""
        return [r for r in self._slots if r is not None and r.decoding]

    def _prompt_chunks(self) -> list[tuple[_Request, int]]:
        """The prompt chunks of the next forward: joining requests in order, while the rows the forward
        computes for them (each chunk's own in a ragged step, else every chunk padded to the tallest) fit
        the prefill budget."""
        joining = [r for r in self._slots if r is not None and not r.decoding]
        joining.sort(key=lambda r: r.id)
        chosen: list[tuple[_Request, int]] = []
        for request in joining:
            chunk = min(self.prefill_chunk, request.prompt.numel() - 1 - request.prefilled)
            height = max([chunk] + [c for _, c in chosen])
            # Every chunk is padded to the tallest: the padding must still fit each slot's store.
            fits = all(r.prefilled + height <= self.store.capacity for r, _ in [*chosen, (request, chunk)])
            rows = chunk + sum(c for _, c in chosen) if self.runner.ragged else height * (len(chosen) + 1)
            if chosen and (rows > self.prefill_chunk or not fits):
                break
            chosen.append((request, chunk))
        return chosen

    def _feed_prompts(self, chunks: list[tuple[_Request, int]]) -> None:
        """One forward of prompt chunks alone (padding rows of a shorter chunk are written past its end and
        never kept)."""
        batch = pack_steps([r.slot for r, _ in chunks], [r.prefilled for r, _ in chunks],
                           [causal_step(r.prompt[r.prefilled : r.prefilled + c]) for r, c in chunks])
        before = self.runner.forward_seconds
        self.runner.step_logits(self.store, batch)
        for request, _ in chunks:
            request.stats.forward_seconds += self.runner.forward_seconds - before
        self._prompts_fed(chunks)

    def _prompts_fed(self, chunks: list[tuple[_Request, int]]) -> None:
        """Commit the keys and values of prompt chunks a forward wrote."""
        for request, chunk in chunks:
            self.store.extend(request.slot, chunk)
            request.prefilled += chunk

    def _finish(self, request: _Request) -> GenerationStats:
        """Free a request that ended, its text added to its corpus (the slot is freed whatever the corpus raises)."""
        stats = request.stats
        stats.new_tokens = len(request.generated)
        stats.accepted_by_source = dict(request.decoder.accepted_by_source)
        stats.seconds = time.perf_counter() - request.started
        corpus = request.params.corpus
        try:
            if corpus is not None:
                with corpus.lock:  # a corpus cleared since the request began holds others' text now
                    if corpus.epoch == request.corpus_epoch:
                        corpus.add(request.prompt.tolist() + request.generated)
        finally:
            self._free(request)
        return stats

    def _free(self, request: _Request) -> None:
        """Release the request's slot; the highest occupied slot moves down into it, so that the decoding
        requests keep to the first slots and a step reads the store without gathering."""
        slot = request.slot
        self._interrupted.pop(request.id, None)
        self._proposal_errors.pop(request.id, None)
        self._slots[slot] = None
        self.store.release(slot)
        last = max((i for i, r in enumerate(self._slots) if r is not None), default=-1)
        if last > slot:
            moved = self._slots[last]
            self.store.move(last, slot)
            self._slots[slot], self._slots[last] = moved, None
            moved.slot = slot


def _check_memory(runner: HFModelRunner, slots: int, capacity: int) -> None:
    """A clear error, before anything is allocated, when the KV store cannot fit the device's free memory."""
    needed = slots * capacity * runner.kv_bytes_per_position()
    if runner.device.type == "cuda":
        free = torch.cuda.mem_get_info(runner.device)[0]
    else:
        free = available_memory()
    if needed > free:
        raise MemoryError(
            f"the KV store for max_batch={slots} sequences of up to {capacity} positions (max_length and "
            f"{STEP_ROOM} for a step's rows) needs "
            f"{needed / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free on {runner.device}; "
            "lower max_batch or max_length")


def _with_config_defaults(model: PreTrainedModel, params: RequestParams) -> RequestParams:
    """As `generate` completes its options: a generation config given takes its unset fields from the model's,
    and do_sample None is the generation config's. Anything but a RequestParams with a GenerationConfig or
    None, as it is, for `check_params` to refuse by name."""
    if not isinstance(params, RequestParams) or not isinstance(params.generation_config, (GenerationConfig, type(None))):
        return params
    if params.generation_config is not None and params.generation_config is not model.generation_config:
        params = dataclasses.replace(params, generation_config=with_model_defaults(model, params.generation_config))
    if params.do_sample is None:
        settings = params.generation_config or model.generation_config
        params = dataclasses.replace(params, do_sample=bool(getattr(settings, "do_sample", False)))
    return params


def check_padding(model: PreTrainedModel, padding: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """`add_request`'s padding as a 1-D long tensor; ValueError for anything but token ids of the model's
    vocabulary in a row (the processors and stopping criteria read them)."""
    tensor = as_token_tensor(padding, "padding")
    if tensor.numel() and tensor.dtype not in TOKEN_DTYPES:  # (none given: torch's default dtype)
        raise ValueError(f"padding must hold integer token ids, got dtype {tensor.dtype}")
    if tensor.dim() > 1 and not (tensor.dim() == 2 and tensor.shape[0] == 1):
        raise ValueError(f"padding must be one row ([n] or [1, n]), got shape {list(tensor.shape)}")
    tensor = tensor.to(torch.long).view(-1).cpu()
    vocabulary = vocabulary_size(model)
    outside = tensor[(tensor < 0) | (tensor >= vocabulary)]
    if outside.numel():
        raise ValueError(f"padding holds token id {int(outside[0])}, outside the model's vocabulary [0, {vocabulary})")
    return tensor


def _behind_padding(padding: torch.Tensor, transform: LogitsTransform) -> LogitsTransform:
    """`transform` handed a batch row's left padding in front of the row's tokens."""
    def padded(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return transform(torch.cat([padding.to(ids.device).view(1, -1), ids], dim=1), scores)

    return padded


def kept_tokens(tokens: list[int], left: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """Of a step's committed tokens, those a sequence keeps with `left` tokens still to go: up to its
    length and through its first stop token; and whether the sequence is done."""
    tokens = tokens[:left]
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1], True
    return tokens, len(tokens) >= left


def check_request(model: PreTrainedModel, input_ids: torch.Tensor | list[int], max_new_tokens: int) -> torch.Tensor:
    """The prompt as a 1-D long tensor, once every check that needs no forward pass has passed: the ids
    lie in the model's vocabulary and the prompt plus `max_new_tokens` fits the model's context.
    Raises ValueError naming the argument and what is allowed."""
    check_model(model)
    prompt = _prompt_tensor(input_ids)
    checked_int("max_new_tokens", max_new_tokens, 1)
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


def as_token_tensor(input_ids: object, name: str = "input_ids") -> torch.Tensor:
    """`input_ids` as a tensor; ValueError, naming the argument `name`, for what cannot be token ids (text, None,
    ragged lists)."""
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as error:
        text = isinstance(input_ids, str) or (isinstance(input_ids, (list, tuple)) and input_ids
                                              and all(isinstance(item, str) for item in input_ids))
        got = f"{type(input_ids).__name__} of str" if text and not isinstance(input_ids, str) else type(input_ids).__name__
        hint = " (text: encode it with the tokenizer first, e.g. lookahead.prompts.encode_prompt)" if text else ""
        raise ValueError(f"{name} must be token ids (a list of ints or an integer tensor), got {got}{hint}") from error
    signed = _signed(ids)
    if ids.dtype == torch.uint64 and bool((signed < 0).any()):
        raise ValueError(f"{name} holds a token id of 2**63 or more, outside every vocabulary")
    return signed


def _signed(ids: torch.Tensor) -> torch.Tensor:
    """Token ids stored unsigned (numpy's uint16 or uint32 arrays of a tokenised dataset) as int64, which holds every
    token id: torch compares none of these dtypes (uint8 aside). A uint64 id of 2**63 or more turns negative."""
    return ids.to(torch.int64) if ids.dtype in (torch.uint16, torch.uint32, torch.uint64) else ids


def _ids_or_none(value: object) -> torch.Tensor | None:
    """`value` as a tensor (unsigned ids as int64: `_signed`), or None where torch cannot make one of it; the
    caller checks what it holds."""
    try:
        return _signed(torch.as_tensor(value))
    except (TypeError, ValueError, RuntimeError):
        return None


def _prompt_tensor(input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    ids = as_token_tensor(input_ids)
    if ids.numel() == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if ids.dtype not in TOKEN_DTYPES:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"input_ids must have batch size 1 (shape [1, n]), got shape {list(ids.shape)}")
        ids = ids[0]
    elif ids.dim() != 1:
        raise ValueError(f"input_ids must have shape [n] or [B, n], or be a list of 1-D prompts; got shape {list(ids.shape)}")
    return ids.to(torch.long).cpu()


def check_params(model: PreTrainedModel, params: RequestParams) -> LookaheadConfig:
    """The request's lookahead config, once every option of `params` has passed its checks; nothing is
    measured, allocated or drawn from a generator. Raises TypeError/ValueError naming the option."""
    check_model(model)
    if not isinstance(params, RequestParams):
        raise TypeError(f"params must be a RequestParams or None, got {type(params).__name__}")
    config = AUTO_CONFIG if params.config is None else params.config
    if not isinstance(config, LookaheadConfig):
        raise TypeError(f"config must be a LookaheadConfig or None, got {type(config).__name__}")
    if params.corpus is not None:
        if not isinstance(params.corpus, Corpus):
            raise TypeError(f"corpus must be a lookahead Corpus or None, got {type(params.corpus).__name__}")
        params.corpus.check(vocabulary_size(model))  # bound to it only once the request is taken (`add_request`)
    if params.seed is not None:
        checked_int("seed", params.seed, -2**63, 2**64 - 1, allowed="an integer in [-2**63, 2**64)")
        if params.generator is not None:
            raise ValueError("give a request seed or a generator, not both")
    if not list_of(params.stopping_criteria or (), callable):
        raise TypeError("stopping_criteria must be a list of transformers StoppingCriteria (callables of "
                        f"(input_ids, scores) returning a bool or a bool tensor), got {params.stopping_criteria!r}")
    if not list_of(params.proposers, lambda p: callable(getattr(p, "propose", None))
                   and callable(getattr(p, "observe", None))):
        raise TypeError("proposers must be a list of draft sources with propose(text, limit) and observe(text, new) "
                        f"(lookahead.core.drafts.Proposer), got {type_names(params.proposers)}")
    for name in ("output_scores", "output_logits"):
        if not isinstance(getattr(params, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(params, name)!r}")
    options = params.decoding()
    check_decoding_options(model, options)
    _check_config_processors(model, options, eos_ids(model, params.eos_token_id, params.generation_config))
    return config


def _check_config_processors(model: PreTrainedModel, options: DecodingOptions, stops: list[int]) -> None:
    """Refuse, before any work, generation config values the processors would fail on only once built or run: a
    forced end token outside the vocabulary (indexed at the last position), a decay penalty that is no pair, and
    what the processors' constructors refuse, built here once as `generate` builds them (on a one-token prompt,
    with a generator of their own: the caller's is not drawn from)."""
    config = options.config(model)
    vocabulary = vocabulary_size(model)
    forced = getattr(config, "forced_eos_token_id", None)
    if forced is not None:
        ids = _ids_or_none(forced)
        if ids is None or ids.dtype not in TOKEN_DTYPES or bool(((ids < 0) | (ids >= vocabulary)).any()):
            raise ValueError(f"forced_eos_token_id (generation config) must be a token id in [0, {vocabulary}) or a "
                             f"list of them, got {forced!r}")
    decay = getattr(config, "exponential_decay_length_penalty", None)
    if decay is not None and not (isinstance(decay, (list, tuple)) and len(decay) >= 2):
        raise ValueError(f"exponential_decay_length_penalty (generation config) must be a pair (start index, decay "
                         f"factor), got {decay!r}")
    try:
        decoding_rule(model, dataclasses.replace(options, generator=torch.Generator()),
                      torch.zeros(1, dtype=torch.long), 1, stops)
    except (TypeError, ValueError, IndexError) as error:
        raise ValueError(f"the generation config's options cannot be applied: {error}") from error


def eos_ids(model: PreTrainedModel, eos_token_id: int | Iterable[int] | None,
            config: GenerationConfig | None = None) -> list[int]:
    """The stop tokens in order: the ones given, else the generation config's (`config`, else the model's; none
    if it has none). Raises ValueError for anything but a token id or a sequence of token ids."""
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config if config is None else config, "eos_token_id", None)
    eos_token_id = stop_token_list(eos_token_id)
    if eos_token_id is None:
        return []
    ids = _ids_or_none(eos_token_id)
    if ids is not None and ids.dim() == 1 and ids.numel() == 0:  # no stop token (an empty list is float)
        return []
    if ids is None or ids.dtype not in TOKEN_DTYPES or ids.dim() > 1 or bool((ids < 0).any()):
        raise ValueError(f"eos_token_id must be a token id or a list of token ids (integers >= 0), got {eos_token_id!r}")
    return ids.view(-1).tolist()


def stop_token_list(eos_token_id: object) -> object:
    """Stop tokens given as a set (no order of its own: the smallest first, which padding takes), a generator or
    dict keys, as a list; anything else as it is (`eos_ids` checks it)."""
    if isinstance(eos_token_id, (set, frozenset)):
        try:
            return sorted(eos_token_id)
        except TypeError:  # not all numbers: eos_ids says what is allowed
            return list(eos_token_id)
    if isinstance(eos_token_id, Iterable) and not isinstance(eos_token_id, (str, bytes, list, tuple)) and not hasattr(
            eos_token_id, "ndim"):  # arrays and tensors as they are
        return list(eos_token_id)
    return eos_token_id


def pad_id(model: PreTrainedModel, eos_token_id: int | Iterable[int] | None = None,
           config: GenerationConfig | None = None) -> int:
    """The id that fills a sequence after it stops, as `generate` picks it: the generation config's pad token
    (`config`, else the model's), else the first stop token (`eos_token_id`, else the config's), else 0."""
    pad = getattr(model.generation_config if config is None else config, "pad_token_id", None)
    if pad is None:
        stops = eos_ids(model, eos_token_id, config)
        pad = stops[0] if stops else 0
    return checked_int("the model's pad token (generation config)", pad, 0, allowed="a token id (an integer >= 0) or None")


class _Laps:
    """Adds the time since the previous lap to `totals[name]`."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - self.last
        self.last = now

"""The forward cost curve T(k): seconds for one step of k new tokens over a cached context, on this model,
device, dtype and thread count, and T(B, h) for B sequences of h rows each. Measured on first use (about
20 s for the default model on 2 CPU cores in float32: the plain linear path and two packers, timed in turn)
and cached under $LOOKAHEAD_CACHE/costs (measured again where a later process finds the machine much
faster than the stored times); the drafter sizes each step's token tree with it."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from bisect import bisect_left
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from transformers import PreTrainedModel

from . import kernels
from .attention import loaded_attention
from .hf import HFModelRunner, UnsupportedModelError, context_length, is_sharded
from .machine import cache_root, cpu_fields, notice
from .quant import weights_of
from .runtime.batch import causal_step, pack_steps

CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Cached tokens under the steps the curves time: short prompts and chats, where decoding spends its steps
# (fewer where the model's context is shorter).
MEASURED_CONTEXT = 128
COST_FORMAT_VERSION = 15


class CostCurve:
    """Relative forward cost T(k) / T(1) for k tokens in one step, from measured points: linear between
    them and beyond the last. `padded_to`: the heights steps are padded to (a compiled forward): k costs
    what the next of them costs."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float], padded_to: Sequence[int] = ()) -> None:
        if (len(sizes) < 2 or list(sizes) != sorted(set(sizes)) or sizes[0] != 1 or len(seconds) != len(sizes)
                or min(seconds) <= 0):
            raise ValueError("a cost curve needs increasing sizes starting at 1 and a positive time for each")
        self.sizes = list(sizes)
        # A step never costs more than a taller one (it could be padded to it): a time above a later one is
        # noise (another process on the cores while it was measured) and is lowered to it.
        monotone = [min(seconds[i:]) for i in range(len(seconds))]
        self.relative = [s / monotone[0] for s in monotone]
        self.padded_to = list(padded_to)
        self._known: dict[int, float] = {}  # tokens -> cost: the budget asks for the same few heights every step

    def __call__(self, tokens: int) -> float:
        if tokens not in self._known:
            self._known[tokens] = self._interpolate(tokens)
        return self._known[tokens]

    def _interpolate(self, tokens: int) -> float:
        tokens = next((height for height in self.padded_to if height >= tokens), tokens)
        index = min(max(bisect_left(self.sizes, tokens), 1), len(self.sizes) - 1)
        k0, k1 = self.sizes[index - 1], self.sizes[index]
        t0, t1 = self.relative[index - 1], self.relative[index]
        return t0 + (t1 - t0) * (tokens - k0) / (k1 - k0)


@dataclass(frozen=True)
class CostPoint:
    tokens: int
    seconds: float  # the fastest of the rounds
    relative: float  # seconds / seconds at k = 1


def forward_cost(
    runner: HFModelRunner, context: int = 256, sizes: tuple[int, ...] = CURVE_SIZES, repeats: int = 5, batch: int = 1
) -> list[CostPoint]:
    """Time of one forward of k tokens (causal among themselves, logits for all k) for each of `batch`
    sequences on top of a `context`-token cache each, through the same path lookahead steps take: the
    fastest time in `repeats` rounds, each timing every size in turn and the short steps (up to
    SHORT_STEP_ROWS rows in all) SHORT_STEP_SAMPLES times, after a warm-up pass. Another process on
    the cores only ever adds time, in bursts; the fastest round of each size is the least touched by them
    (under a bursty load measured here, medians were off by up to 3x at some sizes, the fastest rounds by
    under 20%)."""
    fastest = _fastest_rounds(_steps_over_context(runner, context, sizes, batch), repeats, runner.device,
                              lambda k: _samples_by_height(batch * k))
    return _points(sizes, fastest)


def eager_and_compiled_cost(runner: HFModelRunner, context: int = 256, sizes: tuple[int, ...] = CURVE_SIZES,
                            repeats: int = 5) -> dict[str, list[CostPoint]]:
    """`forward_cost` of a compiled runner's steps run eagerly and compiled (each height's graph compiled by the
    warm-up pass), timed in the same rounds: the two curves side by side, as the machine drifts."""
    steps = _steps_over_context(runner, context, sizes, 1)
    runs = {**{("eager", k): _eagerly(runner, run) for k, run in steps.items()},
            **{("compiled", k): steps[k] for k in sizes}}
    fastest = _fastest_rounds(runs, repeats, runner.device, lambda key: _samples_by_height(key[1]))
    return {path: _points(sizes, {k: fastest[path, k] for k in sizes}) for path in ("eager", "compiled")}


def _eagerly(runner: HFModelRunner, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`run` with the runner's steps run eagerly, compiled runner or not."""
    def eager_run() -> torch.Tensor:
        with runner.eager():
            return run()
    return eager_run


def _points(sizes: Sequence[int], fastest: dict[int, float]) -> list[CostPoint]:
    return [CostPoint(k, fastest[k], fastest[k] / fastest[sizes[0]]) for k in sizes]


# Steps of up to this many rows (all sequences together) are timed SHORT_STEP_SAMPLES times a round, taller
# ones once: the budget's choices hinge on T(2)/T(1) and T(4)/T(1), and short steps are the cheapest to
# time. On our 2-core Xeon the fastest of 5 rounds put the default model's T(2)/T(1) anywhere from 0.93 to
# 1.24 (a CI run's budget priced a second row at 1.24x and fed no draft in 96 tokens); the fastest of 15
# samples, at 0.99 to 1.07.
SHORT_STEP_ROWS = 8
SHORT_STEP_SAMPLES = 3


def _fastest_rounds(runs: dict, repeats: int, device: torch.device, samples: Callable[[object], int] = lambda key: 1
                    ) -> dict:
    """Each run's fastest time in `repeats` rounds, after a warm-up pass over every run: in each round every
    run is timed in turn, then the runs with `samples(key)` > 1 again in turn, as many times."""
    for run in runs.values():
        timed_seconds(run, device)
    schedule = [key for sample in range(max(map(samples, runs), default=1)) for key in runs if samples(key) > sample]
    fastest: dict = {}
    for _ in range(repeats):
        for key in schedule:
            fastest[key] = min(timed_seconds(runs[key], device), fastest.get(key, math.inf))
    return fastest


def _samples_by_height(rows: int) -> int:
    """How many times a round times a step of `rows` rows (all its sequences together)."""
    return SHORT_STEP_SAMPLES if rows <= SHORT_STEP_ROWS else 1


def _steps_over_context(runner: HFModelRunner, context: int, sizes: Sequence[int],
                        batch: int) -> dict[int, Callable[[], torch.Tensor]]:
    """For each k in `sizes`, a call that runs one greedy forward (logits read for their argmax) of k tokens for
    each of `batch` sequences over a cache of `context` tokens each (filled once, here; the steps' own keys are
    never kept). The tokens repeat a random period of 32, the steps continuing it: a trained model predicts
    them with confidence, as it does most tokens of real text, which is what the greedy output layer's cost
    depends on (`hf.ArgmaxOutputLayer`; random tokens leave hundreds of tokens in doubt a row)."""
    vocab = runner.model.config.get_text_config(decoder=True).vocab_size
    limit = context_length(runner.model)
    if limit is not None:  # every position inside the model's context (learned positions stop there)
        if limit <= max(sizes):
            raise UnsupportedModelError(f"the model's context of {limit} positions is too short: lookahead sizes its "
                                        f"steps by timing steps of up to {max(sizes)} tokens after a cached prefix")
        context = min(context, limit - max(sizes))
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(vocab, (32,), generator=generator).repeat(-(-(context + max(sizes)) // 32))
    slots = list(range(batch))
    # One position more than the tallest step reads: a compiled forward would specialise on the two being equal.
    store = runner.new_store(batch, context + max(sizes) + 1)
    runner.forward(store, pack_steps(slots, [0] * batch, [causal_step(text[:context])] * batch))
    for slot in slots:
        store.extend(slot, context)
    runs = {}
    for k in sizes:
        steps = [causal_step(text[context: context + k], logits=k)] * batch
        runs[k] = functools.partial(runner.forward, store, pack_steps(slots, [context] * batch, steps),
                                    argmax_only=True)
    return runs


def timed_seconds(run: Callable[[], object], device: torch.device) -> float:
    """Wall time of one `run()`, waiting for a GPU to finish."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def median_seconds(run: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of `run()` over `repeats` calls after one warm-up, waiting for a GPU to finish."""
    return statistics.median([timed_seconds(run, device) for _ in range(repeats + 1)][1:])


def _curve_key(runner: HFModelRunner) -> str:
    """What the cost depends on: the model's shape (not its weights), quantisation, attention implementation, dtype,
    device (on a CPU its model and flags: a cache folder that several machines share, or that an image brought from
    another, must not price this one's steps), threads, linear paths, and on a CPU the build of our kernels
    (named by their sources: a changed kernel is timed afresh)."""
    model: PreTrainedModel = runner.model
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    if runner.device.type == "cuda":
        device = torch.cuda.get_device_name(runner.device)
    elif runner.device.type == "cpu":
        device = ["cpu", cpu_fields().get("model name"), cpu_fields().get("flags"), os.cpu_count()]
    else:
        device = runner.device.type
    built = kernels.library() if runner.device.type == "cpu" else None
    described = json.dumps([COST_FORMAT_VERSION, type(model).__name__, config, weights_of(model),
                            loaded_attention(model.config), str(runner.dtype), device, torch.get_num_threads(),
                            runner.packing, runner.packers, torch.__version__, built.name if built else None],
                           sort_keys=True, default=str)
    return hashlib.blake2b(described.encode(), digest_size=16).hexdigest()


def _path_key(runner: HFModelRunner) -> str:
    """The curve key and the linear path `cost_curve` set on the runner: what names the curves measured on
    that path (batch curves, compiled curves) and the probe taken on it."""
    return f"{_curve_key(runner)}-{runner.packer and f'{runner.packer}{runner.packed_from}'}"


def _seconds(runner: HFModelRunner, packers: Sequence[str | None], sizes: Sequence[int] = CURVE_SIZES
             ) -> dict[str | None, list[float]]:
    """Each linear path's step times (None: the plain one; a packer from one row), the paths timed in turn in
    each round as the sizes are: measured one after the other, two paths differed by the machine's drift (a
    one-row step 6% faster packed, then 19% slower when timed in turn)."""

    def through(packer: str | None, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: (runner.use_packed(packer, 1), run())[1]

    with runner.eager(), runner.untimed():  # compiling every size up front would take minutes on a CPU
        steps = _steps_over_context(runner, MEASURED_CONTEXT, sizes, 1)
        fastest = _fastest_rounds({(packer, k): through(packer, run) for packer in packers for k, run in steps.items()},
                                  5, runner.device, lambda key: _samples_by_height(key[1]))
    return {packer: [fastest[packer, k] for k in sizes] for packer in packers}


def _stored(path: Path, measure: Callable[[], dict], runner: HFModelRunner, valid: Callable[[dict], bool],
            stale: Callable[[dict], bool] = lambda measured: False, what: str = "steps") -> dict:
    """What `measure()` returns, measured once: kept in memory and on disk (written atomically), and measured
    again where what a process reads from disk is not `valid` (a file cut short, edited, of another layout)
    or is `stale`. One process measures a file at a time (a lock per file), the others then read it: two
    measuring at once would do the work twice, each timing its steps under the other's load. Not the ranks
    of a sharded model: each of its forwards is collective, so they measure together (and rank 0's curves
    are used). A cache folder that cannot be written costs a warning: the times are kept in memory alone. `what`:
    what is timed, for the line said before it is."""
    key = path.stem
    if key in _MEASURED:
        return _MEASURED[key]
    sharded = is_sharded(runner.model)
    measured = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with nullcontext() if sharded else FileLock(path.with_name(f".{path.name}.lock")):
            measured = _read_json(path)
            if measured is not None and not valid(measured):
                measured = None
            if measured is None or (not sharded and stale(measured)):
                notice(f"timing this model's {what} on {runner.device}, once; kept in {path.parent}")
                measured = measure()
                partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
                partial.write_text(json.dumps(measured))
                os.replace(partial, path)
    except OSError as error:
        warnings.warn(f"lookahead's cost curves not kept, {path.parent} is not writable ({error}); they are measured "
                      "in each process (set LOOKAHEAD_CACHE to a writable folder)", RuntimeWarning, stacklevel=3)
        if measured is None:
            measured = measure()
    _MEASURED[key] = measured
    return measured


def _read_json(path: Path) -> dict | None:
    """The object stored at `path`; None where there is none or it is not JSON of an object."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None


def _step_times(values: object, count: int) -> bool:
    """Whether `values` is a list of `count` step times: finite numbers above 0."""
    return (isinstance(values, list) and len(values) == count
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in values))


_MEASURED: dict[str, dict] = {}  # file stem -> measured seconds, read from disk once per process

# A stored curve is measured again where a one-row step now takes under this share of its stored time: it
# was measured while something else loaded the machine (a first run beside a compile job, say), and its
# ratios with it (a CI run under load stored T(1) = 134 ms where a quiet one takes 33 ms, and its budget fed
# 8 rows a step at 0.83x greedy's speed; a curve stored beside our test suite, T(1) = 40 ms, ran MKL's
# packer from 64 rows where a quiet measurement runs it from 4). Each measurement stored is faster than the
# last, so a machine drifting by 10-20% re-measures only a few times; one only ever slower keeps it.
REMEASURE_BELOW = 0.85


def _one_row_now(runner: HFModelRunner) -> float:
    """Seconds of a one-row step of one sequence on the path the runner takes now, as this process finds the
    machine: the fastest of 3 after a warm-up, timed once per process and path (every stored curve of the
    model is checked against it: one probe, not one per batch size, each of which had to fill B sequences'
    caches first, 2 s at B = 8)."""
    key = _path_key(runner)
    if key not in _ONE_ROW_NOW:
        with runner.eager(), runner.untimed():
            step = _steps_over_context(runner, MEASURED_CONTEXT, (1,), 1)[1]
            _ONE_ROW_NOW[key] = _fastest_rounds({1: step}, 3, runner.device)[1]
    return _ONE_ROW_NOW[key]


_ONE_ROW_NOW: dict[str, float] = {}  # curve key and linear path -> `_one_row_now`


def _chosen_path(runner: HFModelRunner, measured: dict) -> list[float]:
    """Sets the linear path `cost_curve` describes (see there) on the runner; returns its step times."""
    # (A runner told to pack never runs the plain path; `valid` checks no plain times for it.)
    sizes, plain = measured["sizes"], measured.get("plain") if runner.packing is not True else None
    options = [(None, None, plain)] if plain is not None else []
    for packer in runner.packers:
        packed = measured[packer]
        if plain is None:
            options.append((packer, 1, packed))
            continue
        faster = [p < q for p, q in zip(packed, plain)]
        packed_from = next((k for i, k in enumerate(sizes) if all(faster[i:])), None)
        on = [packed_from is not None and k >= packed_from for k in sizes]
        options.append((packer, packed_from, [p if use else q for p, q, use in zip(packed, plain, on)]))
    packer, packed_from, seconds = min(options, key=lambda option: sum(math.log(t) for t in option[2]))
    runner.use_packed(packer if packed_from is not None else None, packed_from)
    return seconds


def _fitting_sizes(runner: HFModelRunner) -> list[int]:
    """The CURVE_SIZES a model's context has room to time after a cached prefix at least as long: all of them but
    on a context of under 128 positions, where the curve is linear beyond its last height."""
    limit = context_length(runner.model)
    sizes = [k for k in CURVE_SIZES if limit is None or 2 * k <= limit]
    if len(sizes) < 2:
        raise UnsupportedModelError(f"the model's context of {limit} positions is too short: lookahead sizes its "
                                    "steps by timing steps of 1 and 2 tokens, each after a cached prefix as long (4 "
                                    "positions)")
    return sizes


def cost_curve(runner: HFModelRunner) -> CostCurve:
    """T(k) for k in CURVE_SIZES (those the model's context fits: `_fitting_sizes`) on the path the runner takes,
    measured once per model shape and machine setting, then read from disk (and measured again where a one-row
    step now runs much faster than it says: `REMEASURE_BELOW`). Where the runner may use prepacked linears (`packing` None), the plain path
    and each packer's are measured; a packer takes over from the step size on which it is faster than the
    plain path at every larger size (never, or always, where one path wins throughout), and of the packers
    the one whose resulting curve is lowest (geometric mean over the sizes) is set on the runner. The curve
    is then the path's that runs at each size."""

    fitting = _fitting_sizes(runner)

    def measure() -> dict:
        paths = ([None] if runner.packing is not True else []) + list(runner.packers)  # () where packing is off
        measured = _seconds(runner, paths, fitting)
        return {"sizes": fitting, "plain": measured.pop(None, None), **measured}

    def valid(measured: dict) -> bool:
        sizes = measured.get("sizes")
        paths = [measured.get(packer) for packer in runner.packers]
        if runner.packing is not True:
            paths.append(measured.get("plain"))
        return sizes == fitting and bool(paths) and all(_step_times(times, len(sizes)) for times in paths)

    def stale(measured: dict) -> bool:
        seconds = _chosen_path(runner, measured)  # the path first: the probe times the path the runner takes
        return _one_row_now(runner) < REMEASURE_BELOW * seconds[0]

    measured = _stored(cache_root() / "costs" / f"{_curve_key(runner)}.json", measure, runner, valid, stale)
    seconds = _chosen_path(runner, measured)
    _ONE_ROW_NOW.setdefault(_path_key(runner), seconds[0])  # where measured just now
    runner.drop_other_packs()
    return _path_curve(runner, measured["sizes"], 1) if runner.compile else CostCurve(measured["sizes"], seconds)


def batch_cost_curve(runner: HFModelRunner, batch: int) -> CostCurve:
    """T(B, h) / T(B, 1): the relative cost of a step of `batch` sequences of h rows each, on the linear path
    `cost_curve` chose. It is not T(B * h): each sequence attends to its own cache, and a one-row step
    takes the attention kernels' decoding path (on a 2-core Xeon, 8 sequences of 2 rows cost 1.34x 8 of
    one, where 16 rows of one sequence cost 1.07x 8 rows of it)."""
    curve = cost_curve(runner)
    if batch == 1:
        return curve
    sizes = [h for h in _fitting_sizes(runner) if batch * h <= max(128, 2 * batch)]
    return _path_curve(runner, sizes, batch)


def _path_curve(runner: HFModelRunner, sizes: Sequence[int], batch: int) -> CostCurve:
    """T(batch, h) for h in `sizes` through the steps decoding runs (`_step_seconds`): eager, or a compiled
    runner's compiled steps, priced at the heights they are padded to. Measured once, stored, and measured
    again where a process finds the one-row step much faster than it was. Compiled steps are not the eager
    ones less a fixed saving (the model this replaced): on a 2-core Xeon with AMX, in bfloat16, compiling
    saved 14 ms of a one-row step (45.4 -> 31.6 ms) and little of taller ones, so a step of 16 rows cost
    1.12x a one-row step compiled where the eager curve less the saving said 1.29x."""
    # Named by how compiled steps run their linears too: our kernels from the graph, or frozen for inductor's packs.
    compiled = "" if not runner.compile else "-compiled" + (
        "" if runner.compile_mode == "default" else f"-{runner.compile_mode}") + (
        "-kernels" if runner.compiled_kernel else "")
    measured = _stored(cache_root() / "costs" / f"{_path_key(runner)}-b{batch}{compiled}.json",
                       lambda: _step_seconds(runner, sizes, batch), runner,
                       lambda measured: (measured.get("sizes") == list(sizes)
                                         and _step_times(measured.get("seconds"), len(measured["sizes"]))
                                         and _step_times([measured.get("one_row")], 1)),
                       lambda measured: _one_row_now(runner) < REMEASURE_BELOW * measured["one_row"],
                       f"{'compiled ' if runner.compile else ''}steps of {batch} sequence{'s' * (batch > 1)}")
    return CostCurve(measured["sizes"], measured["seconds"], runner.compiled_heights if runner.compile else ())


def _step_seconds(runner: HFModelRunner, sizes: Sequence[int], batch: int) -> dict:
    """T(batch, h) for h in `sizes` through the steps the runner runs now (compiled ones where it compiles; a
    height that fails to compile runs, and is timed, eagerly, as decoding would run it), and ("one_row") an
    eager one-row step of one sequence timed in the same rounds: what a later process compares its
    `_one_row_now` with. The graphs a compiled runner compiles here are those an engine compiles anyway
    (dynamo marks the sizes dynamic: one graph for one row, one for more, per number of sequences above one)."""
    with runner.untimed():
        one_row = _steps_over_context(runner, MEASURED_CONTEXT, (1,), 1)[1]
        runs: dict = dict(_steps_over_context(runner, MEASURED_CONTEXT, sizes, batch))
        runs["one_row"] = _eagerly(runner, one_row)
        fastest = _fastest_rounds(runs, 5, runner.device,
                                  lambda key: _samples_by_height(1 if key == "one_row" else batch * key))
    return {"sizes": list(sizes), "seconds": [fastest[h] for h in sizes], "one_row": fastest["one_row"]}

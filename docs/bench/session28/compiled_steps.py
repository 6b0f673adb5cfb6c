"""Eager and compiled steps of the default model over 256 cached tokens, interleaved (session 28):

    python compiled_steps.py float32 1,4 --skip-guards   # also compiled under set_stance(skip_guard_eval_unsafe)
    python compiled_steps.py int4 1,2                    # one- and two-row steps

The stance was measured, not adopted: it skips dynamo's guards, which is unsafe for us."""
import statistics
import sys
import timeit

import torch

from lookahead.costs import _steps_over_context, cost_curve
from lookahead.hf import HFModelRunner
from lookahead.models import load_model

torch.set_num_threads(2)
model, _ = load_model(dtype=sys.argv[1])
sizes = tuple(int(k) for k in sys.argv[2].split(","))
runner = HFModelRunner(model, compile=True)
cost_curve(runner)
steps = _steps_over_context(runner, 256, sizes, 1)


def within(context, run):
    def wrapped():
        with context():
            return run()
    return wrapped


runs = {}
for k, run in steps.items():
    runs[f"eager k={k}"] = within(runner.eager, run)
    runs[f"compiled k={k}"] = run
    if "--skip-guards" in sys.argv:
        runs[f"skip k={k}"] = within(lambda: torch.compiler.set_stance("default", skip_guard_eval_unsafe=True), run)
for run in list(steps.values()) * 2 + list(runs.values()):  # compile, then warm up every path
    run()
times = {name: [] for name in runs}
for _ in range(15 if "--skip-guards" in sys.argv else 10):
    for name, run in runs.items():
        times[name].append(min(timeit.repeat(run, number=1, repeat=3)))
for name, t in times.items():
    print(name, f"min {min(t) * 1e3:.2f} median {statistics.median(t) * 1e3:.2f} ms")

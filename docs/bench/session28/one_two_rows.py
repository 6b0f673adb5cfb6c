# One- and two-row steps, eager and compiled, interleaved: python one_two_rows.py float32|int4 (session 28).
import torch, timeit, statistics
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, cost_curve
torch.set_num_threads(2)
import sys
model, tok = load_model(dtype=sys.argv[1])
runner = HFModelRunner(model, compile=True)
cost_curve(runner)
steps = _steps_over_context(runner, 256, (1, 2), 1)
for k in steps: steps[k](); steps[k]()
def skip(run):
    def r():
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return run()
    return r
def eager(run):
    def r():
        with runner.eager():
            return run()
    return r
runs = {}
for k, run in steps.items():
    runs[f"eager k={k}"] = eager(run); runs[f"compiled k={k}"] = run; pass
for r in runs.values(): r()
res = {name: [] for name in runs}
for rnd in range(10):
    for name, r in runs.items():
        res[name].append(min(timeit.repeat(r, number=1, repeat=3)))
for name, t in res.items():
    print(name, f"min {min(t)*1e3:.2f} median {statistics.median(t)*1e3:.2f} ms")

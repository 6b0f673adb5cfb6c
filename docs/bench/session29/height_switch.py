"""Session 29: the first compiled one-row step after a step of another height (dynamo tries the last graph's guards
first): python height_switch.py int4"""
import sys, statistics, timeit, torch
import lookahead.hf as hf
from lookahead.costs import _steps_over_context, cost_curve, _eagerly
from lookahead.models import load_model
torch.set_num_threads(2)
model, _ = load_model(dtype=sys.argv[1])
runner = hf.HFModelRunner(model, compile=True)
cost_curve(runner)
steps = _steps_over_context(runner, 256, (1, 2, 16), 1)
c1, c2, e1, e16 = steps[1], steps[2], _eagerly(runner, steps[1]), _eagerly(runner, steps[16])
for r in (c1, c2, e1, e16):
    for _ in range(3): r()
def t(run): 
    import time; s = time.perf_counter(); run(); return time.perf_counter() - s
res = {"c1 after c1": [], "c1 after e1": [], "c1 after e16": [], "c1 after c2": []}
for _ in range(15):
    c1(); res["c1 after c1"].append(t(c1))
    e1(); res["c1 after e1"].append(t(c1))
    e16(); res["c1 after e16"].append(t(c1))
    c2(); res["c1 after c2"].append(t(c1))
print({k: (round(min(v)*1e3, 2), round(statistics.median(v)*1e3, 2)) for k, v in res.items()})
from torch.profiler import profile
for label, seq in (("same", [c1, c1]), ("switch", [c2, c1])):
    with profile() as p:
        for _ in range(10):
            for r in seq: r()
    ev = {e.key: e for e in p.key_averages()}
    print(label, {k: (round(ev[k].cpu_time_total / ev[k].count), ev[k].count) for k in ev if "Lookup" in k or "Region" in k or "Pregraph" in k})

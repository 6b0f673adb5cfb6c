"""One forward of 8 sequences over 300 cached positions, on the engine's default path: ragged heights timed
(fastest of 8, 3 rounds), then profiled by operator. python ragged_prof.py [profile]"""
import sys, torch
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import timed_seconds
from lookahead.runtime.batch import causal_step, pack_steps
lm, _ = load_model(None, dtype="float32")
r = HFModelRunner(lm)
print("packers", r.packers); r.use_packed(sys.argv[2] if len(sys.argv) > 2 else r.packers[-1], 1)
print("packer", r._packed.packer if r._packed else None, "ragged", r.ragged)
B, ctx = 8, 300
store = r.new_store(B, ctx + 80)
g = torch.Generator().manual_seed(0)
r.forward(store, pack_steps(range(B), [0]*B, [causal_step(torch.randint(40000, (ctx,), generator=g))]*B))
for s in range(B): store.extend(s, ctx)
cases = {"1x8": [1]*8, "2+1x7": [2]+[1]*7, "3+1x7": [3]+[1]*7, "2,2,2+1x5": [2,2,2]+[1]*5, "2x8": [2]*8, "mixed": [3,1,2,1,4,1,1,2]}
batches = {n: pack_steps(range(B), [ctx]*B, [causal_step(torch.randint(40000, (k,), generator=g), logits=k) for k in s]) for n, s in cases.items()}
res = {}
for rnd in range(3):
    for name, batch in batches.items():
        run = lambda: r.forward(store, batch)
        run(); run()
        res.setdefault(name, []).append(min(timed_seconds(run, torch.device("cpu")) for _ in range(8)) * 1000)
for k, v in res.items(): print(k, [round(x, 1) for x in v], "best", round(min(v), 1), flush=True)
if sys.argv[1:2] == ["profile"]:
    from torch.profiler import profile
    for name in ("1x8", "2,2,2+1x5"):
        with profile() as p:
            for _ in range(5): r.forward(store, batches[name])
        print(name)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))

import time, torch, functools
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.runtime.batch import causal_step, pack_steps
m, tok = load_model()
r = HFModelRunner(m)
from lookahead.engine import Engine
Engine(m, max_batch=8)  # curves, linear path set
r = Engine(m, max_batch=8).runner
B, ctx = 8, 256
text = torch.randint(1000, (32,), generator=torch.Generator().manual_seed(0)).repeat(20)
store = r.new_store(B, ctx + 80)
slots = list(range(B))
r.forward(store, pack_steps(slots, [0] * B, [causal_step(text[:ctx])] * B))
for s in slots: store.extend(s, ctx)
shapes = {"1x8": [1]*8, "2x8": [2]*8, "3x8": [3]*8, "4x8": [4]*8, "6x8": [6]*8,
          "9+1x7": [9]+[1]*7, "17+1x7": [17]+[1]*7, "33+1x7": [33]+[1]*7, "5,5,5,5+1x4": [5]*4+[1]*4, "3,3,3,3,1,1,1,1": [3]*4+[1]*4}
import sys
def mk(v):
    batch = pack_steps(slots, [ctx]*B, [causal_step(text[ctx:ctx+h], logits=h) for h in v])
    def f():
        if len(sys.argv) > 1:
            out = r.forward(store, batch, argmax_only=True)
            return [out[b] if p is None else out[b, p] for b, p in enumerate(batch.picks)]
        out = r.step_logits(store, batch, argmax_only=True)
        return [out.of(b, p) for b, p in enumerate(batch.picks)]
    return f
runs = {k: mk(v) for k, v in shapes.items()}
best = {k: 1e9 for k in runs}
for rep in range(30):
    for k, f in runs.items():
        t = time.perf_counter(); f(); best[k] = min(best[k], time.perf_counter() - t)
print("ragged", r.ragged)
for k, v in best.items(): print(f"{k:18s} rows {sum(shapes[k]):3d} {v*1e3:6.2f} ms  rel {v/best['1x8']:.2f}")

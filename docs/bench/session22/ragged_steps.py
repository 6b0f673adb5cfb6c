"""One forward of 8 sequences over 300 cached positions each, ragged against padded, by the rows each feeds:
the fastest of 6 calls each, the two alternating (float32, default linear path, 2 threads).

    python docs/bench/session22/ragged_steps.py
"""
import time, torch, sys
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.runtime.batch import causal_step, pack_steps
torch.set_num_threads(2)
model, _ = load_model()
runner = HFModelRunner(model, packed_linear=False)
B = 8
store = runner.new_store(B, 512)
runner.forward(store, pack_steps(range(B), [0]*B, [causal_step(torch.arange(3, 303))]*B))
for s in range(B): store.extend(s, 300)
def batch_of(sizes):
    return pack_steps(range(B), list(store.lengths), [causal_step(torch.arange(3, 3 + n), logits=n) for n in sizes])
cases = [[1]*8, [2]*8, [3]*8, [2]+[1]*7, [8]+[1]*7, [4,4]+[1]*6, [8,8]+[1]*6, [16]+[1]*7, [4,3,3,2,2,2,1,1]]
for sizes in cases:
    b = batch_of(sizes); best = {True: 1e9, False: 1e9}
    for rep in range(6):
        for ragged in (True, False):
            runner.ragged_steps = ragged
            a = time.perf_counter(); runner.forward(store, b); best[ragged] = min(best[ragged], time.perf_counter() - a)
    print(sizes, f"rows {sum(sizes)}: padded {best[False]*1e3:.1f} ms ragged {best[True]*1e3:.1f} ms", flush=True)

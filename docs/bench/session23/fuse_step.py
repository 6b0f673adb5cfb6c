"""One decoding step of 15 sequences (1 or 3 rows each, 300 cached) plus a joining prompt's chunk of c rows:
in one ragged forward (riding) against the step and the chunk in forwards of their own; fastest of 8, alternating."""
import sys, time, torch
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import cost_curve
from lookahead.runtime.batch import causal_step, pack_steps
torch.set_num_threads(2)
model, _ = load_model()
runner = HFModelRunner(model); cost_curve(runner)
B = 16
store = runner.new_store(B, 1024)
runner.forward(store, pack_steps(range(B - 1), [0]*(B - 1), [causal_step(torch.arange(3, 303))]*(B - 1)))
for s in range(B - 1): store.extend(s, 300)
for rows in (1, 3):
    for chunk in [int(c) for c in (sys.argv[1:] or ["16", "64", "256"])]:
        dec = [causal_step(torch.arange(3, 3 + rows), logits=rows)] * (B - 1)
        prompt = causal_step(torch.arange(5, 5 + chunk), logits=0)
        fused = pack_steps(range(B), [300] * (B - 1) + [0], dec + [prompt])
        alone = pack_steps(range(B - 1), [300] * (B - 1), dec)
        own = pack_steps([B - 1], [0], [causal_step(torch.arange(5, 5 + chunk))])
        best = {"riding": 1e9, "own": 1e9}
        for _ in range(8):
            a = time.perf_counter(); runner.forward(store, fused); best["riding"] = min(best["riding"], time.perf_counter() - a)
            a = time.perf_counter(); runner.forward(store, alone); runner.forward(store, own); best["own"] = min(best["own"], time.perf_counter() - a)
        print(f"15 x {rows} rows + chunk {chunk}: riding {best['riding']*1e3:.1f} ms, own forward {best['own']*1e3:.1f} ms, "
              f"saved {(1 - best['riding']/best['own'])*100:.0f}%", flush=True)

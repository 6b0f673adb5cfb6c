"""auto (h=0) against every step fed up to h rows (its likeliest nodes, drafts always proposed), or, for h=-1,
auto with the calibration by estimate bin of bincal.py; one engine per method, 256 tokens, rounds rotated.
Usage: PYTHONPATH=. python ab.py DATASET PROMPTS ROUNDS DTYPE H..."""
import time, sys, torch
torch.set_num_threads(2)
import lookahead.engine as E
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
from lookahead.core.prices import StepPrices
import bincal
ds, N, R, dt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
hs = [int(x) for x in sys.argv[5:]]
m, tok = load_model(dtype=dt)
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload(ds, 1, False, None, N)]
orig, od = E.node_counts, StepPrices.drafts
engines = {}
def run(h):
    bincal.enable(h == -1)
    if h > 0:
        E.node_counts = lambda demands, cost, w=None: [d.nodes_within(h) for d in demands]
        StepPrices.drafts = lambda self, b: True
    else:
        E.node_counts, StepPrices.drafts = orig, od
    e = engines.setdefault(h, Engine(m, max_batch=1, max_length=max(p.numel() for p in prompts) + 300))
    params = RequestParams(max_new_tokens=256, config=AUTO_CONFIG, eos_token_id=m.generation_config.eos_token_id)
    n = 0; s0 = e.stats.steps; f0 = e.stats.tokens_fed; t = time.perf_counter()
    for p in prompts:
        e.add_request(p, params)
        while e.has_unfinished():
            for o in e.step(): n += len(o.tokens)
    return n, time.perf_counter() - t, e.stats.steps - s0, e.stats.tokens_fed - f0
methods = [0] + hs
tot = {h: [0, 0.0, 0, 0] for h in methods}
for r in range(R):
    order = methods[r % len(methods):] + methods[:r % len(methods)]
    for h in order:
        res = run(h)
        for i in range(4): tot[h][i] += res[i]
        print(f"round {r} h={h}: {res[0]/res[1]:.1f} tok/s {res[0]/res[2]:.2f} tok/step fed {res[3]/res[2]:.1f}", flush=True)
for h in methods:
    n, t, s, f = tot[h]
    print(f"TOTAL h={h}: {n/t:.1f} tok/s ({n/t/(tot[0][0]/tot[0][1]):.3f}x auto) {n/s:.2f} tok/step fed {f/s:.1f}")

"""A/B: learnt pauses (current StepPrices) vs drafts always on vs plain, one engine each, same process."""
import sys, time, torch
from lookahead.bench.batch import _engine
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
from lookahead.core.prices import StepPrices
from lookahead.engine import Engine
from lookahead.models import load_model
from lookahead.prompts import encode_prompt
from lookahead.workloads import load_workload

count, tokens, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model, tok = load_model()
ps = load_workload("mt_bench")
ps = ps[::max(1, len(ps) // count)][:count]
inputs = [encode_prompt(tok, p.turns[0], raw=p.raw)[0] for p in ps]
Engine(model, max_batch=batch)
learnt = StepPrices.drafts
def run(mode):
    StepPrices.drafts = (lambda self, b: True) if mode == "always" else learnt
    return _engine(model, inputs, tokens, PLAIN_CONFIG if mode == "plain" else AUTO_CONFIG, batch)
res = {m: [0.0, 0, 0] for m in ("auto", "always", "plain")}
for r in range(2):
    order = list(res)[::-1] if r % 2 else list(res)
    outs = {}
    for m in order:
        o, s, _, steps = run(m)
        outs[m] = o
        n = sum(map(len, o))
        res[m][0] += s; res[m][1] += n; res[m][2] += steps
        print(r, m, f"{n/s:.1f} tok/s {n/steps:.2f} tok/step/seq", flush=True)
    assert outs["auto"] == outs["always"] == outs["plain"]
for m, (s, n, st) in res.items():
    print(m, f"{n/s:.1f} tok/s {n/st:.2f} tok/step/seq {(n/s)/(res['plain'][1]/res['plain'][0]):.3f}x plain")

"""A/B: per-sequence agreement factor on the budget's estimates, on vs off; each mode its own shared stats."""
import sys, time, torch
from lookahead import generate
from lookahead import engine as eng
from lookahead.core import decoder as dec
from lookahead.config import PLAIN_CONFIG
from lookahead.models import load_model
from lookahead.prompts import encode_prompt
from lookahead.workloads import load_workload

dataset, count, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tok = load_model()
ps = load_workload(dataset); ps = ps[:count]
generate(model, encode_prompt(tok, ps[0].turns[0], raw=ps[0].raw), max_new_tokens=8)
stats = {"on": eng.AcceptanceStats(), "off": eng.AcceptanceStats()}
res = {m: [0.0, 0, 0, 0] for m in ("on", "off", "plain")}
for i, p in enumerate(ps):
    ids = encode_prompt(tok, p.turns[0], raw=p.raw)
    order = ["on", "off", "plain"]; order = order[i % 3:] + order[:i % 3]
    outs = {}
    for m in order:
        dec.AGREEMENT = m == "on"
        if m != "plain": eng._ACCEPTANCE[model] = {False: stats[m]}
        t = time.perf_counter()
        out = generate(model, ids, max_new_tokens=tokens, config=PLAIN_CONFIG if m == "plain" else None)
        dt = time.perf_counter() - t
        outs[m] = out.sequences
        n = out.sequences.shape[-1] - ids.shape[-1]
        r = res[m]; r[0] += dt; r[1] += n; r[2] += out.stats.steps; r[3] += out.stats.tokens_fed
        print(p.id, m, f"{n/dt:.1f} tok/s {n/out.stats.steps:.2f} tok/step {out.stats.tokens_fed/out.stats.steps:.2f} fed/step", flush=True)
    assert torch.equal(outs["on"], outs["off"]) and torch.equal(outs["on"], outs["plain"]), p.id
for m, (s, n, st, fed) in res.items():
    print(m, f"{n/s:.1f} tok/s {n/st:.2f} tok/step {fed/st:.2f} fed/step {(n/s)/(res['plain'][1]/res['plain'][0]):.3f}x plain")
print("on/off", f"{(res['on'][1]/res['on'][0])/(res['off'][1]/res['off'][0]):.3f}")

"""A/B: acceptance stats shared across generate calls (the new default) vs learnt afresh per call.
Same process, alternating order per prompt; outputs must be identical."""
import sys, time, torch
from lookahead import generate
from lookahead import engine as eng
from lookahead.models import load_model
from lookahead.workloads import load_workload
from lookahead.prompts import encode_prompt

dataset, count, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model, tok = load_model()
prompts = load_workload(dataset)
step = max(1, len(prompts) // count)
prompts = prompts[::step][:count]
plain_cfg = None
res = {"shared": [0.0, 0, 0], "fresh": [0.0, 0, 0], "plain": [0.0, 0, 0]}
from lookahead.config import PLAIN_CONFIG
generate(model, encode_prompt(tok, prompts[0].turns[0]), max_new_tokens=8)  # cost curve, warm
eng._ACCEPTANCE.pop(model, None)
shared = eng.AcceptanceStats()
def run(mode, ids):
    if mode == "fresh":
        eng._ACCEPTANCE[model] = eng.AcceptanceStats()
    else:
        eng._ACCEPTANCE[model] = shared
    t = time.perf_counter()
    out = generate(model, ids, max_new_tokens=tokens, config=PLAIN_CONFIG if mode == "plain" else None)
    dt = time.perf_counter() - t
    return out, dt
for i, p in enumerate(prompts):
    ids = encode_prompt(tok, p.turns[0])
    order = ["shared", "fresh", "plain"]
    order = order[i % 3:] + order[:i % 3]
    outs = {}
    for mode in order:
        out, dt = run(mode, ids)
        outs[mode] = out.sequences
        n = out.sequences.shape[-1] - ids.shape[-1]
        res[mode][0] += dt; res[mode][1] += n; res[mode][2] += out.stats.steps
        print(p.id, mode, f"{n/dt:.1f} tok/s {n/out.stats.steps:.2f} tok/step", flush=True)
    assert torch.equal(outs["shared"], outs["fresh"]) and torch.equal(outs["shared"], outs["plain"]), p.id
for m, (s, n, st) in res.items():
    print(m, f"{n/s:.1f} tok/s {n/st:.2f} tok/step")
print("shared/fresh", f"{(res['shared'][1]/res['shared'][0])/(res['fresh'][1]/res['fresh'][0]):.3f}",
      "shared/plain", f"{(res['shared'][1]/res['shared'][0])/(res['plain'][1]/res['plain'][0]):.3f}",
      "fresh/plain", f"{(res['fresh'][1]/res['fresh'][0])/(res['plain'][1]/res['plain'][0]):.3f}")

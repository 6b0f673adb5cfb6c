"""A/B: prompt chunks riding in the decoding step's forward (new) vs a forward of their own (old), plain and auto."""
import sys, time, torch
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
from lookahead import engine as new_engine, engine_old as old_engine  # engine_old.py: `git show <rev>:src/lookahead/engine.py`
from lookahead.models import load_model
from lookahead.prompts import encode_prompt
from lookahead.workloads import load_workload
count, tokens, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model, tok = load_model()
ps = load_workload("mt_bench")
ps = ps[::max(1, len(ps) // count)][:count]
inputs = [encode_prompt(tok, p.turns[0], raw=p.raw)[0] for p in ps]
new_engine.Engine(model, max_batch=batch)
def run(module, config):
    start = time.perf_counter()
    engine = module.Engine(model, max_batch=batch, max_length=max(p.numel() for p in inputs) + tokens)
    ids = [engine.add_request(p, module.RequestParams(max_new_tokens=tokens, config=config)) for p in inputs]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.tokens
    return [out[i] for i in ids], time.perf_counter() - start, engine.stats
arms = [("old plain", old_engine, PLAIN_CONFIG), ("new plain", new_engine, PLAIN_CONFIG),
        ("old auto", old_engine, AUTO_CONFIG), ("new auto", new_engine, AUTO_CONFIG)]
tot, ref = {}, None
for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 2):
    for name, module, config in (arms[::-1] if r else arms):
        o, s, st = run(module, config)
        ref = ref or o
        assert o == ref, name
        n = sum(map(len, o))
        ph = {k: round(v, 2) for k, v in st.phase_seconds.items()}
        print(r, name, f"{n/s:.1f} tok/s steps {st.steps} total {s:.1f}s", ph, flush=True)
        t = tot.setdefault(name, [0, 0]); t[0] += n; t[1] += s
base = tot["old plain"][0] / tot["old plain"][1]
for k, (n, s) in tot.items():
    print(k, f"{n/s:.1f} tok/s {(n/s)/base:.3f}x old plain")

"""plain against auto on one engine of B slots: N prompts of a dataset, 128 tokens, rounds alternating. Usage: DATASET N ROUNDS [B]"""
import time, sys, torch
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
m, tok = load_model()
ds, N, rounds, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 8
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload(ds, 1, False, None, N)]
Engine(m, max_batch=B)
def run(config):
    e = Engine(m, max_batch=B, max_length=max(p.numel() for p in prompts) + 128)
    params = RequestParams(max_new_tokens=128, config=config)
    t = time.perf_counter()
    ids = [e.add_request(p, params) for p in prompts]
    out = {i: [] for i in ids}; per = []
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id] += o.tokens
            if o.finished: per.append(o.stats.new_tokens / max(o.stats.steps, 1))
    s = time.perf_counter() - t
    n = sum(map(len, out.values()))
    return n / s, e.stats.steps, e.stats.tokens_fed, sum(per) / len(per), e.stats.undrafted_steps, [out[i] for i in ids]
res = {}
for r in range(rounds):
    for name, cfg in ((("plain", PLAIN_CONFIG), ("auto", AUTO_CONFIG))[:: 1 if r % 2 == 0 else -1]):
        tps, steps, fed, per, und, outs = run(cfg)
        res.setdefault(name, []).append(tps); res.setdefault(name + "_out", outs)
        print(r, name, f"{tps:.1f} tok/s steps {steps} fed {fed} per-seq {per:.2f} undrafted {und}", flush=True)
assert res["plain_out"] == res["auto_out"]
print("RATIO", ds, N, B, round(sum(res["auto"]) / sum(res["plain"]), 3))

"""8 prompts on an engine of 8 slots (the batch benchmark's shape), 128 tokens: plain, auto, and every sequence fed
up to h rows (its likeliest nodes; drafts always proposed). Usage: python b8_heights.py DATASET PROMPTS ROUNDS"""
import time, sys, torch
import lookahead.engine as E
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
m, tok = load_model()
N = int(sys.argv[2]) if len(sys.argv) > 2 else 8
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload(sys.argv[1] if len(sys.argv) > 1 else "mt_bench", 1, False, None, N)]
Engine(m, max_batch=8)
orig = E.node_counts
from lookahead.core.prices import StepPrices
od = StepPrices.drafts
def run(config, power):
    if power > 0:
        E.node_counts = lambda demands, cost, w=None: [d.nodes_within(power) for d in demands]
        StepPrices.drafts = lambda self, b: True
    else:
        E.node_counts, StepPrices.drafts = orig, od
    e = Engine(m, max_batch=8, max_length=max(p.numel() for p in prompts) + 128)
    params = RequestParams(max_new_tokens=128, config=config)
    t = time.perf_counter()
    for p in prompts: e.add_request(p, params)
    n = 0; per = []
    while e.has_unfinished():
        for o in e.step():
            n += len(o.tokens)
            if o.finished: per.append(o.stats.new_tokens / max(o.stats.steps, 1))
    s = time.perf_counter() - t
    return n / s, e.stats.steps, e.stats.tokens_fed, round(e.stats.phase_seconds["forward"], 2), sum(per) / len(per), min(per), e.stats.undrafted_steps
res = {}
methods = [("plain", PLAIN_CONFIG, 0), ("auto", AUTO_CONFIG, 0), ("h2", AUTO_CONFIG, 2), ("h4", AUTO_CONFIG, 4), ("h8", AUTO_CONFIG, 8), ("h16", AUTO_CONFIG, 16)]
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    for name, cfg, pw in (methods if r % 2 == 0 else methods[::-1]):
        tps, steps, fed, fwd, per, mn, und = run(cfg, pw)
        res.setdefault(name, []).append(tps)
        print(r, name, f"{tps:.1f} tok/s steps {steps} fed {fed} forward {fwd} per-seq {per:.2f} min {mn:.2f} undrafted {und}", flush=True)
for k, v in res.items(): print(k, [round(x, 1) for x in v], round(sum(v) / sum(res["plain"]), 3))

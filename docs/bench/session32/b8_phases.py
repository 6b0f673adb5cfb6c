"""B=8: plain, auto, and auto with drafts never proposed (prices.drafts -> False): where does lookahead lose?"""
import time, torch
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
from lookahead.core.prices import StepPrices
m, tok = load_model()
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload("mt_bench", 1, False, None, 16)]
orig = StepPrices.drafts
def run(config, nodraft=False):
    StepPrices.drafts = (lambda self, b: False) if nodraft else orig
    e = Engine(m, max_batch=8, max_length=max(p.numel() for p in prompts) + 128)
    params = RequestParams(max_new_tokens=128, config=config)
    t = time.perf_counter()
    for p in prompts: e.add_request(p, params)
    n = steps = 0
    while e.has_unfinished():
        for o in e.step(): n += len(o.tokens)
    s = time.perf_counter() - t
    ph = {k: round(v, 2) for k, v in e.stats.phase_seconds.items()}
    return n / s, e.stats.steps, e.stats.tokens_fed, ph, e.stats.undrafted_steps
res = {}
for r in range(3):
    for name, cfg, nd in (("plain", PLAIN_CONFIG, False), ("auto", AUTO_CONFIG, False), ("auto-nodraft", AUTO_CONFIG, True)):
        tps, steps, fed, ph, und = run(cfg, nd)
        res.setdefault(name, []).append(tps)
        print(r, name, f"{tps:.1f} tok/s steps {steps} fed {fed} undrafted {und}", ph, flush=True)
for k, v in res.items(): print(k, [round(x, 1) for x in v])

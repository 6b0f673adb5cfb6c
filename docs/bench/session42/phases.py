"""Batch 8 on one engine: plain vs auto, per-step phase times (ms) and rows. Usage: phases.py DTYPE PROMPTS TOKENS"""
import sys, time, torch
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
m, tok = load_model(dtype=sys.argv[1])
N, T = int(sys.argv[2]), int(sys.argv[3])
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload("mt_bench", 1, False, None, N)]
Engine(m, max_batch=8)
def run(config):
    e = Engine(m, max_batch=8, max_length=max(p.numel() for p in prompts) + T)
    params = RequestParams(max_new_tokens=T, config=config)
    for p in prompts:
        e.add_request(p, params)
    t = time.perf_counter(); n = 0
    while e.has_unfinished():
        n += sum(len(o.tokens) for o in e.step())
    s = time.perf_counter() - t
    st = e.stats
    ph = {k: round(1000 * v / st.steps, 2) for k, v in st.phase_seconds.items()}
    return n / s, st.steps, st.tokens_fed / st.steps, n / st.steps, ph
for rnd in range(2):
    for name, c in ((("plain", PLAIN_CONFIG), ("auto", AUTO_CONFIG)) if rnd == 0 else (("auto", AUTO_CONFIG), ("plain", PLAIN_CONFIG))):
        tps, steps, fed, tpst, ph = run(c)
        print(f"{name}: {tps:.1f} tok/s steps {steps} rows/step {fed:.1f} tokens/step {tpst:.2f} ms/step {ph}", flush=True)

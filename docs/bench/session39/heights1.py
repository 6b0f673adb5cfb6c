"""1 sequence at a time on one engine, 256 tokens: plain, auto, and every step fed up to h rows (its likeliest nodes,
drafts always proposed). Usage: heights1.py DATASET PROMPTS [DTYPE]"""
import time, sys, torch
torch.set_num_threads(2)
import lookahead.engine as E
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
from lookahead.core.prices import StepPrices
m, tok = load_model(dtype=sys.argv[3] if len(sys.argv) > 3 else "float32")
print(next(m.parameters()).dtype)
N = int(sys.argv[2])
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload(sys.argv[1], 1, False, None, N)]
orig, od = E.node_counts, StepPrices.drafts
def run(config, power):
    if power > 0:
        E.node_counts = lambda demands, cost, w=None: [d.nodes_within(power) for d in demands]
        StepPrices.drafts = lambda self, b: True
    else:
        E.node_counts, StepPrices.drafts = orig, od
    e = Engine(m, max_batch=1, max_length=max(p.numel() for p in prompts) + 300)
    params = RequestParams(max_new_tokens=256, config=config, eos_token_id=m.generation_config.eos_token_id)
    n = steps = fed = 0; t = time.perf_counter()
    for p in prompts:
        e.add_request(p, params)
        while e.has_unfinished():
            for o in e.step(): n += len(o.tokens)
    return n / (time.perf_counter() - t), n / e.stats.steps, e.stats.tokens_fed / e.stats.steps
methods = [("plain", PLAIN_CONFIG, 0), ("auto", AUTO_CONFIG, 0)] + [(f"h{h}", AUTO_CONFIG, h) for h in (16, 32, 64)]
for name, cfg, pw in methods:
    tps, tpstep, fedps = run(cfg, pw)
    print(f"{name}: {tps:.1f} tok/s, {tpstep:.2f} tokens/step, fed {fedps:.1f}/step", flush=True)

import sys, time, torch
from lookahead.models import load_model
from lookahead.workloads import load_workload
from lookahead.prompts import encode_prompt
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
compile = sys.argv[1] == "1"
B = int(sys.argv[2])
model, tok = load_model()
prompts = [encode_prompt(tok, p.turns[0])[0] for p in load_workload("mt_bench")[:int(sys.argv[3])]]
for rnd in range(2):
  for name, cfg in (("plain", PLAIN_CONFIG), ("auto", AUTO_CONFIG)):
    e = Engine(model, max_batch=B, max_length=max(p.numel() for p in prompts)+128, compile=compile)
    e.warm_up()
    for p in prompts: e.add_request(p, RequestParams(max_new_tokens=128, config=cfg))
    t = time.perf_counter(); n = 0
    while e.has_unfinished():
        for o in e.step(): n += len(o.tokens)
    s = time.perf_counter() - t
    ph = {k: round(v*1000/e.stats.steps, 1) for k, v in e.stats.phase_seconds.items()}
    print(rnd, name, f"{n/s:.1f} tok/s steps={e.stats.steps} fed/step={e.stats.tokens_fed/e.stats.steps:.1f} ms/step={s*1000/e.stats.steps:.1f}", ph, "undrafted", e.stats.undrafted_steps, flush=True)

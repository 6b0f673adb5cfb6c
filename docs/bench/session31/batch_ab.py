"""One engine run of N MT-bench prompts (first turns, 128 new tokens) on B slots, plain then automatic config,
float32, eager: tokens/s, steps, rows fed a step, forward ms a step. The tree under test comes from PYTHONPATH
(`batch_ab.sh` alternates two trees' processes)."""
import sys, time, torch
from lookahead.models import load_model
from lookahead.workloads import load_workload
from lookahead.prompts import encode_prompt
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
B, N, tag = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model, tok = load_model()
prompts = [encode_prompt(tok, p.turns[0])[0] for p in load_workload("mt_bench")[:N]]
for name, cfg in (("plain", PLAIN_CONFIG), ("auto", AUTO_CONFIG)):
    e = Engine(model, max_batch=B, max_length=max(p.numel() for p in prompts) + 128)
    e.warm_up()
    for p in prompts: e.add_request(p, RequestParams(max_new_tokens=128, config=cfg))
    t = time.perf_counter(); n = 0
    while e.has_unfinished():
        for o in e.step(): n += len(o.tokens)
    s = time.perf_counter() - t
    st = e.stats
    print(f"{tag} {name} {n/s:.1f} tok/s steps={st.steps} fed/step={st.tokens_fed/st.steps:.1f} "
          f"forward ms/step={st.phase_seconds['forward']*1000/st.steps:.1f}", flush=True)

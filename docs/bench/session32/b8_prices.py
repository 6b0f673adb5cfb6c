import time, torch
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
m, tok = load_model()
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload("mt_bench", 1, False, None, 16)]
e = Engine(m, max_batch=8, max_length=max(p.numel() for p in prompts) + 128)
for p in prompts: e.add_request(p, RequestParams(max_new_tokens=128, config=AUTO_CONFIG))
i = 0
while e.has_unfinished():
    e.step(); i += 1
    b = e.prices._buckets.get(8)
    if b and i % 25 == 0:
        c = e.prices.cost(8)
        print(i, f"one_row {b.one_row*1000:.1f}ms extra_rows {b.extra_rows:.2f} fed {b.fed.committed/max(b.fed.spent,1e-9):.3f} ({b.fed.steps}) drafted {b.drafted.committed/max(b.drafted.spent,1e-9):.3f} overhead {b.overhead} plain_left {b.plain_left} cost(2) {c(2):.3f} curve(2) {e._cost(8)(2):.3f}", flush=True)

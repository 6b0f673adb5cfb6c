import sys, time, torch
from lookahead.models import load_model
from lookahead.workloads import load_workload
from lookahead.prompts import encode_prompt
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG
B = int(sys.argv[1])
model, tok = load_model()
prompts = [encode_prompt(tok, p.turns[0])[0] for p in load_workload("mt_bench")[:B]]
e = Engine(model, max_batch=B, max_length=max(p.numel() for p in prompts)+128)
for p in prompts: e.add_request(p, RequestParams(max_new_tokens=128, config=AUTO_CONFIG))
log = []
orig = e.prices.record
def rec(batch, height, fwd, over, drafted, tokens=None, offered=False):
    log.append((batch, height, round(fwd*1000, 1), round(over*1000, 1), drafted, tokens))
    return orig(batch, height, fwd, over, drafted, tokens, offered)
e.prices.record = rec
t = time.perf_counter(); n = 0
while e.has_unfinished():
    for o in e.step(): n += len(o.tokens)
print(f"{n/(time.perf_counter()-t):.1f} tok/s")
for b, bk in e.prices._buckets.items():
    print(b, "one_row", bk.one_row and round(bk.one_row*1000,1), "extra_rows", round(bk.extra_rows, 2), "overhead", {k: round(v*1000, 2) for k, v in bk.overhead.items()},
          "drafted", round(bk.drafted.committed,1), round(bk.drafted.spent,1), bk.drafted.steps, "fed", round(bk.fed.committed,1), round(bk.fed.spent,1), bk.fed.steps)
from collections import Counter
print(Counter((h, d) for b, h, f, o, d, t in log if b == B))
import statistics
for h in sorted(set(h for b, h, *_ in log if b == B)):
    fs = [f for b, hh, f, o, d, t in log if b == B and hh == h]
    ts = [t for b, hh, f, o, d, t in log if b == B and hh == h and t is not None]
    print("height", h, "n", len(fs), "fwd median", statistics.median(fs), "tokens/seq", round(statistics.mean(ts)/B, 3) if ts else None)

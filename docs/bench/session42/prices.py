"""Batch 8, auto: what StepPrices believes vs what steps cost. Usage: prices.py DTYPE PROMPTS TOKENS"""
import sys, time, torch
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
from lookahead.core.prices import StepPrices
m, tok = load_model(dtype=sys.argv[1])
N, T = int(sys.argv[2]), int(sys.argv[3])
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload("mt_bench", 1, False, None, N)]
log = []
orig = StepPrices.record
def record(self, batch, height, fwd, over, drafted, tokens=None, offered=False):
    log.append((batch, height, fwd, over, drafted, tokens))
    return orig(self, batch, height, fwd, over, drafted, tokens, offered)
StepPrices.record = record
e = Engine(m, max_batch=8, max_length=max(p.numel() for p in prompts) + T)
for p in prompts:
    e.add_request(p, RequestParams(max_new_tokens=T, config=AUTO_CONFIG))
t = time.perf_counter(); n = 0
while e.has_unfinished():
    n += sum(len(o.tokens) for o in e.step())
print(f"{n / (time.perf_counter() - t):.1f} tok/s")
for b, seen in e.prices._buckets.items():
    print("bucket", b, "one_row", seen.one_row, "extra_rows", round(seen.extra_rows, 3), "overhead", seen.overhead,
          "drafted gain", round(seen.drafted.committed / max(seen.drafted.spent, 1e-9), 3), seen.drafted.steps,
          "fed gain", round(seen.fed.committed / max(seen.fed.spent, 1e-9), 3), seen.fed.steps, "retry", seen.retry_after)
full = [r for r in log if r[0] == 8]
plain = [r for r in full if not r[4]]
dr = [r for r in full if r[4]]
import statistics as s
if plain:
    print("plain steps", len(plain), "fwd ms", round(1000 * s.mean(r[2] for r in plain), 1), "over ms", round(1000 * s.mean(r[3] for r in plain), 1))
if dr:
    print("drafted steps", len(dr), "fwd ms", round(1000 * s.mean(r[2] for r in dr), 1), "over ms", round(1000 * s.mean(r[3] for r in dr), 1),
          "tokens/seq", round(s.mean(r[5] / 8 for r in dr), 2), "height", round(s.mean(r[1] for r in dr), 1))
    pt = s.mean(r[2] + r[3] for r in plain) if plain else None
    dt = s.mean(r[2] + r[3] for r in dr)
    if pt: print("actual gain of drafted steps (tokens per time, plain = 1):", round(s.mean(r[5] / 8 for r in dr) / (dt / pt), 3))

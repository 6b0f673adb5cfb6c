"""A/B: ragged steps (each sequence's own rows, no padding) against padded steps against our plain engine:
one engine per method, one process, rounds in alternating order; outputs must be identical.

    python docs/bench/session22/ragged_ab.py PROMPTS TOKENS BATCH [DATASET] [CONFIG]

CONFIG: auto (the default) or W,N,G (a fixed step, which feeds every draft and the whole window).
"""
import sys

import torch

from lookahead import hf
from lookahead.bench.batch import _engine
from lookahead.config import AUTO_CONFIG, PLAIN_CONFIG, LookaheadConfig
from lookahead.engine import Engine
from lookahead.models import load_model
from lookahead.prompts import encode_prompt
from lookahead.workloads import load_workload

count, tokens, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dataset = sys.argv[4] if len(sys.argv) > 4 else "mt_bench"
spec = sys.argv[5] if len(sys.argv) > 5 else "auto"
config = AUTO_CONFIG if spec == "auto" else LookaheadConfig(*map(int, spec.split(",")))
torch.manual_seed(0)
model, tokenizer = load_model()
prompts = load_workload(dataset)
prompts = prompts[:: max(1, len(prompts) // count)][:count]
inputs = [encode_prompt(tokenizer, p.turns[0], raw=p.raw)[0] for p in prompts]
Engine(model, max_batch=batch)  # cost curves measured before any timing
original_init = hf.HFModelRunner.__init__
ragged = True


def init(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    self.ragged_steps = ragged


hf.HFModelRunner.__init__ = init
totals = {mode: [0.0, 0, 0] for mode in ("ragged", "padded", "plain")}
for round_ in range(2):
    outputs = {}
    for mode in (list(totals)[::-1] if round_ % 2 else list(totals)):
        ragged = mode != "padded"
        out, seconds, _, steps = _engine(model, inputs, tokens, PLAIN_CONFIG if mode == "plain" else config, batch)
        outputs[mode] = out
        new = sum(map(len, out))
        totals[mode][0] += seconds
        totals[mode][1] += new
        totals[mode][2] += steps
        print(round_, mode, f"{new / seconds:.1f} tok/s {new / steps:.2f} tok/step/seq", flush=True)
    assert outputs["ragged"] == outputs["padded"] == outputs["plain"]
plain_speed = totals["plain"][1] / totals["plain"][0]
for mode, (seconds, new, steps) in totals.items():
    print(mode, f"{new / seconds:.1f} tok/s {new / steps:.2f} tok/step/seq {new / seconds / plain_speed:.3f}x plain")

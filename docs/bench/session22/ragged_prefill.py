"""Prefill of prompts of different lengths joining together: ragged (each prompt's own rows) against padded
to the longest; one engine per run, rounds alternating, the time to every request's first token.

    python docs/bench/session22/ragged_prefill.py PROMPTS BATCH [DATASET]
"""
import sys
import time

import torch

from lookahead.config import PLAIN_CONFIG
from lookahead.engine import Engine, RequestParams
from lookahead.models import load_model
from lookahead.prompts import encode_prompt
from lookahead.workloads import load_workload

count, batch = int(sys.argv[1]), int(sys.argv[2])
dataset = sys.argv[3] if len(sys.argv) > 3 else "mt_bench"
model, tokenizer = load_model()
prompts = load_workload(dataset)
prompts = prompts[:: max(1, len(prompts) // count)][:count]
inputs = [encode_prompt(tokenizer, p.turns[0], raw=p.raw)[0] for p in prompts]
print("prompt lengths", [p.numel() for p in inputs])
Engine(model, max_batch=batch)
best = {True: [], False: []}
for round_ in range(10):
    for ragged in ((True, False) if round_ % 2 == 0 else (False, True)):
        engine = Engine(model, max_batch=batch, max_length=max(p.numel() for p in inputs) + 2)
        engine.runner.ragged_steps = ragged
        params = RequestParams(max_new_tokens=1, config=PLAIN_CONFIG)
        start = time.perf_counter()
        for prompt in inputs:
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        best[ragged].append(time.perf_counter() - start)
for ragged, times in best.items():
    print("ragged" if ragged else "padded", f"median {sorted(times)[len(times) // 2]:.2f} s, best {min(times):.2f} s")
print(f"padded / ragged (medians): {sorted(best[False])[5] / sorted(best[True])[5]:.2f}x")

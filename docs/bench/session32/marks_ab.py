"""Marks on drafts, A/B without timing noise: one engine per mode, its steps sized by the stored cost curve
alone (no prices learnt from step times), each mode with acceptance statistics of its own, prompts in turn.
Prints tokens/step. Usage: python marks_ab.py DATASET PROMPTS NEW_TOKENS"""

import sys

import torch

import lookahead.core.decoder as decoder_module
import lookahead.engine as engine_module
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
from lookahead.core.drafter import AcceptanceStats
from lookahead.engine import Engine, RequestParams
from lookahead.models import load_model

dataset, limit, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tokenizer = load_model()
prompts = [encode_prompt(tokenizer, p.turns[0], raw=p.raw)[0] for p in _workload(dataset, 1, False, None, limit)]
modes = {"marks": True, "no marks": False}
engines, stats = {}, {}
for mode in modes:
    engines[mode] = Engine(model, max_batch=1)
    engines[mode].prices = None
    stats[mode] = AcceptanceStats()
totals = {mode: [0, 0] for mode in modes}  # tokens, steps
outputs = {mode: [] for mode in modes}
for index, prompt in enumerate(prompts):
    for mode, on in modes.items():
        decoder_module._MARKS = on
        engine_module.acceptance_stats = lambda model, sampling=False, mode=mode: stats[mode]
        engine = engines[mode]
        engine.add_request(prompt, RequestParams(max_new_tokens=new_tokens))
        tokens, steps = [], 0
        while engine.has_unfinished():
            for output in engine.step():
                tokens += output.tokens
            steps += 1
        outputs[mode].append(tokens)
        totals[mode][0] += len(tokens)
        totals[mode][1] += steps
    print(index, {m: f"{t[0] / t[1]:.3f}" for m, t in totals.items()}, flush=True)
for mode, (tokens, steps) in totals.items():
    print(f"{mode}: {tokens} tokens, {steps} steps, {tokens / steps:.3f} tokens/step")
print("identical:", outputs["marks"] == outputs["no marks"])

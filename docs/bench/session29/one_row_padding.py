"""Session 29, measured and not kept: python one_row_padding.py int4. Compiled lookahead (auto config) with one-row steps compiled as such, or padded to two rows: same process, alternating."""
import sys, statistics, time, torch
torch.set_num_threads(2)
import lookahead.hf as hf
from lookahead import generate
from lookahead.models import load_model
from lookahead.workloads import load_workload
model, tok = load_model(dtype=sys.argv[1])
prompts = []
for item in load_workload("mt_bench")[:4]:
    ids = tok.apply_chat_template([{"role": "user", "content": item.turns[0]}], add_generation_prompt=True, return_tensors="pt")
    prompts.append(ids if isinstance(ids, torch.Tensor) else ids["input_ids"])
FULL = hf.COMPILED_HEIGHTS
variants = {"with1": FULL, "pad1": FULL[1:]}
res = {k: [] for k in variants}; outs = {}
for rnd in range(4):
    for name, heights in variants.items():
        hf.COMPILED_HEIGHTS = heights
        steps = seconds = 0
        for i, p in enumerate(prompts):
            out = generate(model, p, max_new_tokens=128, compile=True)
            steps += out.stats.steps; seconds += out.stats.seconds
            outs.setdefault(i, set()).add(tuple(out.sequences[0].tolist()))
        if rnd: res[name].append((seconds, steps))
        print(rnd, name, round(seconds, 2), steps, flush=True)
for k, v in res.items():
    print(k, "seconds", [round(s, 2) for s, _ in v], "steps", [n for _, n in v])
print("outputs identical across variants:", all(len(s) == 1 for s in outs.values()))

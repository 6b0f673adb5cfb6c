"""A/B: a corpus shared across the prompts of a workload (earlier requests' prompts and outputs) vs none.
One process, alternating per prompt, each prompt decoded in both arms; outputs must be identical."""
import sys, time, torch
from lookahead import generate
from lookahead.core.suffix import Corpus
from lookahead.models import load_model
from lookahead.prompts import encode_prompt
from lookahead.workloads import load_workload
dataset, count, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
model, tok = load_model()
ps = load_workload(dataset)
ps = ps[::max(1, len(ps) // count)][:count]
corpus = Corpus()
generate(model, encode_prompt(tok, ps[0].turns[0], raw=ps[0].raw)[0], max_new_tokens=8)
tot = {"none": [0, 0, 0.0], "shared": [0, 0, 0.0]}
for i, p in enumerate(ps):
    ids = encode_prompt(tok, p.turns[0], raw=p.raw)[0]
    outs = {}
    for arm in (["none", "shared"] if i % 2 else ["shared", "none"]):
        out = generate(model, ids, max_new_tokens=tokens, corpus=corpus if arm == "shared" else None)
        s = out.stats
        outs[arm] = out.sequences[0].tolist()
        t = tot[arm]; t[0] += s.new_tokens; t[1] += s.steps; t[2] += s.seconds
        print(i, getattr(p, "category", ""), arm, f"{s.new_tokens/s.steps:.2f} tok/step {s.new_tokens/s.seconds:.1f} tok/s", flush=True)
    assert outs["none"] == outs["shared"]
for arm, (n, st, sec) in tot.items():
    print(arm, f"{n/st:.3f} tok/step {n/sec:.2f} tok/s")
print("shared/none speed", (tot["shared"][0]/tot["shared"][2])/(tot["none"][0]/tot["none"][2]))

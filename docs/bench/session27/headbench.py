import sys, time, torch
from lookahead.models import load_model
from lookahead.workloads import load_workload
from lookahead.prompts import encode_prompt
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG
from lookahead import hf
model, tok = load_model()
wl = sys.argv[1] if len(sys.argv) > 1 else "mt_bench"
prompts = [encode_prompt(tok, p.turns[0])[0] for p in load_workload(wl)[:3]]
e = Engine(model, max_batch=1, max_length=max(p.numel() for p in prompts)+256)
packs = next(iter(hf._PACKED[model].values()))  # the packer the cost curve chose
layer = packs.argmax_output
xs = []
orig = hf.ArgmaxOutputLayer.__call__
def spy(self, x):
    xs.append(x.clone()); return orig(self, x)
hf.ArgmaxOutputLayer.__call__ = spy
for p in prompts:
    e.add_request(p, RequestParams(max_new_tokens=256, config=AUTO_CONFIG))
    while e.has_unfinished(): e.step()
hf.ArgmaxOutputLayer.__call__ = orig
print("captured", len(xs), "rows mean", sum(x.shape[-2] for x in xs)/len(xs))
full = layer._full
for x in xs[:50]:
    assert torch.equal(full(x).argmax(-1), layer(x).argmax(-1))
sel = xs[::4]
tf = ta = 0
for rep in range(3):
    t = time.perf_counter()
    for x in sel: full(x)
    tf += time.perf_counter() - t
    t = time.perf_counter()
    for x in sel: layer(x)
    ta += time.perf_counter() - t
print(f"per call: full {tf/3/len(sel)*1000:.3f} ms, argmax {ta/3/len(sel)*1000:.3f} ms")

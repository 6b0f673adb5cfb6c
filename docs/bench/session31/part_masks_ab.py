"""(Ran at commit 9dce76f, whose `attention._part_masks` it swaps; later the mask caches became one, `_masks`.)
A/B in one process, alternating forward by forward (medians of 120 each): ragged forwards of 8 sequences over 300 cached positions with each part's mask cut and
repeated once a forward (new) or once a layer (old: the cache emptied before every use)."""
import torch
torch.set_num_threads(2)
import lookahead.attention as att
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import timed_seconds
from lookahead.runtime.batch import causal_step, pack_steps
lm, _ = load_model(None, dtype="float32")
r = HFModelRunner(lm); r.use_packed("native", 1)
B, ctx = 8, 300
store = r.new_store(B, ctx + 80)
g = torch.Generator().manual_seed(0)
r.forward(store, pack_steps(range(B), [0]*B, [causal_step(torch.randint(40000, (ctx,), generator=g))]*B))
for s in range(B): store.extend(s, ctx)
cases = {"1x8": [1]*8, "2+1x7": [2]+[1]*7, "3+1x7": [3]+[1]*7, "2,2,2+1x5": [2,2,2]+[1]*5, "mixed": [3,1,2,1,4,1,1,2]}
batches = {n: pack_steps(range(B), [ctx]*B, [causal_step(torch.randint(40000, (k,), generator=g), logits=k) for k in s]) for n, s in cases.items()}
cached = att._part_masks
def per_layer(*args):
    att._THREAD.part_masks = None
    return cached(*args)
import statistics, time
res = {}
for name, batch in batches.items():
    for fn in (cached, per_layer):
        att._part_masks = fn; r.forward(store, batch)
    for i in range(120):  # the arms alternate forward by forward: the machine's drift hits both alike
        for arm, fn in (("new", cached), ("old", per_layer)) if i % 2 == 0 else (("old", per_layer), ("new", cached)):
            att._part_masks = fn
            t = time.perf_counter(); r.forward(store, batch)
            res.setdefault((name, arm), []).append((time.perf_counter() - t) * 1000)
for name in cases:
    new, old = statistics.median(res[(name, "new")]), statistics.median(res[(name, "old")])
    pairs = sorted(o - n for o, n in zip(res[(name, "old")], res[(name, "new")]))
    print(f"{name:10s} median new {new:.2f} old {old:.2f} ms, old/new {old/new:.3f}; paired old-new median {statistics.median(pairs):+.2f} ms")

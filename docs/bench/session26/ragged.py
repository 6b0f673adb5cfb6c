import sys, torch, time
torch.set_num_threads(2)
from lookahead.models import load_model
import lookahead.attention as att
from lookahead.hf import HFModelRunner
from lookahead.costs import timed_seconds
from lookahead.runtime.batch import causal_step, pack_steps
lm,_ = load_model(None, dtype="float32")
r = HFModelRunner(lm, packed_linear=True); r.use_packed("onednn", 1)
B, ctx = 8, 300
store = r.new_store(B, ctx + 80)
g = torch.Generator().manual_seed(0)
r.forward(store, pack_steps(range(B), [0]*B, [causal_step(torch.randint(40000, (ctx,), generator=g))]*B))
for s in range(B): store.extend(s, ctx)
cases = {"1x8": [1]*8, "2x8": [2]*8, "3+1x7": [3]+[1]*7, "5+1x7": [5]+[1]*7, "3,3+1x6": [3,3]+[1]*6, "4x8": [4]*8, "mixed": [3,1,2,1,4,1,1,2]}
orig = att.RaggedLayout.of
def padded_of(sizes, cached, device):  # one call, every sequence padded to the tallest
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    count, tallest = sum(sizes), max(sizes)
    rows = torch.tensor([[st + i if i < sz else count for i in range(tallest)] for st, sz in zip(starts, sizes)])
    real = (rows < count).view(-1)
    return att.RaggedLayout((att._Part(slice(0, len(sizes)), rows, slice(0, tallest), None if bool(real.all()) else real, max(c + s for c, s in zip(cached, sizes))),), count)
res = {}
for rnd in range(3):
    for mode in ("split",):
        att.RaggedLayout.of = staticmethod(orig if mode == "split" else padded_of)
        for name, sizes in cases.items():
            batch = pack_steps(range(B), [ctx]*B, [causal_step(torch.randint(40000, (k,), generator=g), logits=k) for k in sizes])
            run = lambda: r.forward(store, batch)
            run(); run()
            res.setdefault((mode, name), []).append(min(timed_seconds(run, torch.device("cpu")) for _ in range(8))*1000)
for k, v in res.items(): print(k, [round(x,1) for x in v], "best", round(min(v),1))

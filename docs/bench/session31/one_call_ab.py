"""A/B in one process, alternating forward by forward (medians of 100 each): ragged forwards of 8 sequences over
300 cached positions with attention laid out by `RaggedLayout.of` (split: the rows all sequences have in one
call, the rest per taller sequence or padded) against one call with every sequence padded to the tallest."""
import statistics, sys, time
import torch
torch.set_num_threads(2)
import lookahead.attention as att
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.runtime.batch import causal_step, pack_steps
lm, _ = load_model(None, dtype="float32")
r = HFModelRunner(lm); r.use_packed("native", 1)
B, ctx = int(sys.argv[1]) if sys.argv[1:] else 8, 300
store = r.new_store(B, ctx + 80)
g = torch.Generator().manual_seed(0)
r.forward(store, pack_steps(range(B), [0]*B, [causal_step(torch.randint(40000, (ctx,), generator=g))]*B))
for s in range(B): store.extend(s, ctx)
cases = {"2+1": [2]+[1]*(B-1), "2,2+1": [2,2]+[1]*(B-2), "3+1": [3]+[1]*(B-1), "5+1": [5]+[1]*(B-1), "2,2,2+1": [2,2,2]+[1]*(B-3),
         "4,3,2+1": [4,3,2]+[1]*(B-3), "8+1": [8]+[1]*(B-1), "16+1": [16]+[1]*(B-1)}
batches = {n: pack_steps(range(B), [ctx]*B, [causal_step(torch.randint(40000, (k,), generator=g), logits=k) for k in s]) for n, s in cases.items()}
split = att.RaggedLayout.of
def one_call(sizes, cached, device):
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    count, tallest = sum(sizes), max(sizes)
    rows = torch.tensor([[st + i if i < sz else count for i in range(tallest)] for st, sz in zip(starts, sizes)])
    real = (rows < count).view(-1)
    return att.RaggedLayout((att._Part(slice(0, len(sizes)), rows, slice(0, tallest), real,
                                       max(c + s for c, s in zip(cached, sizes))),), count)
if sys.argv[2:] == ["old"]:  # against the rule before session 31: the rest padded where that less than doubles it
    def one_call(sizes, cached, device):
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        ends = [length + size for length, size in zip(cached, sizes)]
        batch = max(ends)
        count, common, tallest = sum(sizes), min(sizes), max(sizes)
        rows = torch.tensor([[start + r for r in range(common)] for start in starts])
        parts = [att._Part(slice(0, len(sizes)), rows, slice(0, common), None, batch)]
        taller = [b for b, size in enumerate(sizes) if size > common]
        if 2 * (count - common * len(sizes)) > (tallest - common) * len(sizes):
            rest = torch.tensor([[start + r if r < size else count for r in range(common, tallest)]
                                 for start, size in zip(starts, sizes)])
            parts.append(att._Part(slice(0, len(sizes)), rest, slice(common, tallest), (rest < count).view(-1), batch))
        else:
            parts += [att._Part(slice(b, b + 1), torch.arange(starts[b] + common, starts[b] + sizes[b])[None],
                                slice(common, sizes[b]), None, ends[b]) for b in taller]
        return att.RaggedLayout(tuple(parts), count)
arms = {"split": split, "one": one_call}
res = {}
for name, batch in batches.items():
    for fn in arms.values():
        att.RaggedLayout.of = fn; r.forward(store, batch)
    for i in range(100):
        for arm in (("split", "one") if i % 2 == 0 else ("one", "split")):
            att.RaggedLayout.of = arms[arm]
            t = time.perf_counter(); r.forward(store, batch)
            res.setdefault((name, arm), []).append((time.perf_counter() - t) * 1000)
for name in cases:
    a, b = statistics.median(res[(name, "split")]), statistics.median(res[(name, "one")])
    pairs = [x - y for x, y in zip(res[(name, "split")], res[(name, "one")])]
    print(f"B={B} {name:8s} split {a:.2f} one call {b:.2f} ms, split/one {a/b:.3f}; paired split-one median {statistics.median(pairs):+.2f} ms", flush=True)

import torch, time, statistics, sys
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.runtime.batch import causal_step, pack_steps
lm,_ = load_model(None, dtype="float32")
r = HFModelRunner(lm, packed_linear=True)
print("packers", r.packers)
g = torch.Generator().manual_seed(0)
seq = torch.randint(49152, (32,), generator=g).repeat(20)
context = 256
store = r.new_store(1, context + 65)
r.forward(store, pack_steps([0], [0], [causal_step(seq[:context])]))
store.extend(0, context)
packers = sys.argv[1].split(",")
for k in [int(a) for a in sys.argv[2:]]:
    b = pack_steps([0], [context], [causal_step(seq[context:context + k], logits=k)])
    t = {p: [] for p in packers}
    for p in packers:
        r.use_packed(p, 1); r.forward(store, b, True); r.forward(store, b, True)
    for i in range(25):
        for p in packers:
            r.use_packed(p, 1)
            s = time.perf_counter(); r.forward(store, b, True); t[p].append(time.perf_counter() - s)
    print(k, {p: (round(min(v)*1000, 2), round(statistics.median(v)*1000, 2)) for p, v in t.items()}, flush=True)

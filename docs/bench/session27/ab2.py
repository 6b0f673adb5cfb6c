import torch, time, statistics
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.runtime.batch import causal_step, pack_steps
lm,_ = load_model(None, dtype="float32")
r = HFModelRunner(lm, packed_linear=True); r.use_packed("onednn", 1)
g = torch.Generator().manual_seed(0)
seq = torch.randint(49152, (32,), generator=g).repeat(20)
context = 256
store = r.new_store(1, context + 65)
r.forward(store, pack_steps([0], [0], [causal_step(seq[:context])]))
store.extend(0, context)
for k in (1, 4, 16):
    b = pack_steps([0], [context], [causal_step(seq[context:context + k], logits=k)])
    t = {False: [], True: []}
    for i in range(120):
        for flag in ((False, True) if i % 2 else (True, False)):
            s = time.perf_counter(); r.forward(store, b, flag); t[flag].append(time.perf_counter() - s)
    print(k, {f: (round(min(v)*1000, 2), round(statistics.median(v)*1000, 2)) for f, v in t.items()}, flush=True)

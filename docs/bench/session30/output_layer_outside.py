"""One-row compiled float32 steps over ~300 cached tokens, the output layer in the graph or outside it (argmax
layer), the two runners alternating in one process (session 30). It ran against the experiment's code, not kept
(`HFModelRunner.output_outside_graph`, the output layer taken out of the graph): a record
of what was measured, not runnable on the repository as it is (measurements.md)."""
import time, torch
import lookahead.hf as hf
from lookahead.models import load_model
from lookahead.runtime.batch import causal_step, pack_steps
torch.set_num_threads(2)
model, _ = load_model()
outside = hf.HFModelRunner(model, compile=True)
inside = hf.HFModelRunner(model, compile=True)
inside.output_outside_graph = False
inside._compiled = hf._compiled_forward(model, "default", "kernels-native")
print("outside:", outside.output_outside_graph)
def setup(runner):
    store = runner.new_store(1, 512)
    prompt = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(0))
    runner.forward(store, pack_steps([0], [0], [causal_step(prompt)]))
    store.extend(0, 300)
    return store
stores = {r: setup(r) for r in (outside, inside)}
import os
R = int(os.environ.get("ROWS", "1"))
step = pack_steps([0], [300], [causal_step(torch.arange(1234, 1234 + R), logits=R)])
for r in (outside, inside):
    for _ in range(3): r.forward(stores[r], step, argmax_only=True)
    print("equal argmax", )
a = outside.forward(stores[outside], step, argmax_only=True).argmax(-1); b = inside.forward(stores[inside], step, argmax_only=True).argmax(-1)
print("same argmax", torch.equal(a, b))
times = {outside: [], inside: []}
for k in range(16):
    for r in (outside, inside) if k % 2 else (inside, outside):
        t = time.perf_counter()
        for _ in range(20): r.forward(stores[r], step, argmax_only=True)
        times[r].append((time.perf_counter() - t) / 20 * 1e3)
for name, r in (("outside", outside), ("inside", inside)):
    ts = sorted(times[r]); print(name, "min %.2f median %.2f ms" % (ts[0], ts[len(ts)//2]))
print("paired diffs (inside - outside):", [round(i - o, 2) for i, o in zip(times[inside], times[outside])])
packs = hf._packs(model, "native")
hidden = torch.randn(1, 1, 576) * 2
real = None
import timeit
# the hidden state of the real step
from unittest import mock
outs = []
orig = packs.output_logits
def rec(h, a=False):
    outs.append(h); return orig(h, a)
packs.output_logits = rec
outside.forward(stores[outside], step, argmax_only=True)
packs.output_logits = orig
h = outs[0]
print("hidden", h.shape, h.is_contiguous())
for name, f in (("argmax layer", lambda: packs.output_logits(h, True)), ("native f32", lambda: packs.output_logits(h, False))):
    f(); print(name, "%.3f ms" % (min(timeit.repeat(f, number=50, repeat=5)) / 50 * 1e3))

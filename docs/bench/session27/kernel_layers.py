"""The 30 layers' linears of the default model's shapes (random weights, each read once a pass), oneDNN's
reordered packs against our kernel (`lookahead.kernels`), interleaved passes, medians of 15:
python kernel_layers.py 1 2 3 4 6 8 12 16  (rows per step)."""
import statistics
import sys
import time

import torch

from lookahead import kernels

torch.set_num_threads(2)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v stacked, o, gate/up stacked, down
layers = [[torch.randn(o, i) for o, i in shapes] for _ in range(30)]
onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in layers]
ours = [[kernels.pack(w) for w in layer] for layer in layers]
for rows in [int(a) for a in sys.argv[1:]]:
    xs = {i: torch.randn(rows, i) for _, i in shapes}
    with torch.inference_mode():
        def run_onednn():
            for layer, packs in zip(layers, onednn):
                for w, p in zip(layer, packs):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        def run_ours():
            for layer, packs in zip(layers, ours):
                for w, p in zip(layer, packs):
                    kernels.linear(xs[w.shape[1]], p, None, w.shape[0])

        run_onednn(), run_ours()
        a, m = [], []
        for _ in range(15):
            start = time.perf_counter(); run_onednn(); a.append(time.perf_counter() - start)
            start = time.perf_counter(); run_ours(); m.append(time.perf_counter() - start)
    print(rows, f"median: onednn {statistics.median(a) * 1e3:.2f} ms, ours {statistics.median(m) * 1e3:.2f} ms, "
          f"ratio {statistics.median(m) / statistics.median(a):.2f}", flush=True)

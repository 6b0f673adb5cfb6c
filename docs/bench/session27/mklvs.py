import torch, time, statistics
torch.set_num_threads(2)
F = torch.nn.functional
def b(f, n=15):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return min(ts) * 1e3
for o, i in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
    n = 30 if o < 10000 else 2
    Ws = [torch.randn(o, i) for _ in range(n)]
    P1 = [torch.ops.mkldnn._reorder_linear_weight(W, 64) for W in Ws]
    P2 = [torch.ops.mkl._mkl_reorder_linear_weight(W, 64) for W in Ws]
    res = []
    for rows in (1, 4, 16):
        x = torch.randn(rows, i)
        with torch.inference_mode():
            a = b(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in P1])
            m = b(lambda: [torch.ops.mkl._mkl_linear(x, p, W, None, rows) for p, W in zip(P2, Ws)])
            l = b(lambda: [F.linear(x, W) for W in Ws])
        res.append(f"r{rows}: onednn {a*1000/n:.0f} mkl {m*1000/n:.0f} blas {l*1000/n:.0f}")
    print((o, i), "; ".join(res), flush=True)

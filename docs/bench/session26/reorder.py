import torch, time
torch.set_num_threads(2)
torch.manual_seed(0)
W = torch.randn(1536, 576); b=None
ws = {"to_mkldnn": W.to_mkldnn()}
for h in (1, 2, 16, 64):
    ws[f"reorder{h}"] = torch.ops.mkldnn._reorder_linear_weight(W, h)
for k in (2, 8, 16):
    x = torch.randn(k, 576)
    ref = x @ W.t()
    for name, w in ws.items():
        y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        for _ in range(50): torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        t = time.perf_counter()
        for _ in range(500): torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        print(k, name, round((time.perf_counter()-t)/500*1e6,1), "us", (y-ref).abs().max().item())

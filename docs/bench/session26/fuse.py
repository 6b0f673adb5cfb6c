import torch, time
torch.set_num_threads(2)
P = lambda W: torch.ops.mkldnn._reorder_linear_weight(W, 64)
L = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
# 30 layers' worth of distinct weights so that they do not sit in cache
layers = []
for _ in range(30):
    q, k, v, g, u = torch.randn(576,576), torch.randn(192,576), torch.randn(192,576), torch.randn(1536,576), torch.randn(1536,576)
    layers.append(dict(sep=[P(q),P(k),P(v),P(g),P(u)], qkv=P(torch.cat([q,k,v])), gu=P(torch.cat([g,u]))))
for rows in (1, 4, 16):
    x = torch.randn(1, rows, 576)
    def sep():
        for l in layers:
            for w in l["sep"]: L(x, w)
    def fused():
        for l in layers:
            a = L(x, l["qkv"]); a[..., :576].contiguous(); a[..., 576:768].contiguous(); a[..., 768:].contiguous()
            b = L(x, l["gu"]); b[..., :1536].contiguous(); b[..., 1536:].contiguous()
    for f in (sep, fused): f(); f()
    res = {}
    for rnd in range(5):
        for name, f in (("sep", sep), ("fused", fused)):
            t = time.perf_counter(); f(); res.setdefault(name, []).append((time.perf_counter()-t)*1000)
    print(rows, {k: round(min(v), 2) for k, v in res.items()}, "ms for 30 layers")

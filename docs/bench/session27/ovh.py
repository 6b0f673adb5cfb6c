import torch, time, statistics
torch.set_num_threads(2)
F = torch.nn.functional
def b(f, n=2000):
    for _ in range(50): f()
    s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n * 1e6
W = torch.randn(8, 576); x = torch.randn(1, 576)
p = torch.ops.mkldnn._reorder_linear_weight(W, 64)
pm = torch.ops.mkl._mkl_reorder_linear_weight(W, 64)
with torch.inference_mode():
    print("onednn", b(lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")))
    print("mkl packed", b(lambda: torch.ops.mkl._mkl_linear(x, pm, W, None, 1)))
    print("F.linear", b(lambda: F.linear(x, W)))
    print("mv", b(lambda: torch.mv(W, x[0])))
    print("add (dispatch floor)", b(lambda: torch.add(x, x)))
    y = torch.empty(1, 8)
    print("mm out=", b(lambda: torch.mm(x, W.t(), out=y)))

"""Our float32 kernel, two builds side by side in one process (ctypes), alternating round by round over the
linears of 30 layers of the default model's shape (distinct weights: streamed from memory, as in a step); the
fastest of 15 rounds each, and whether their outputs are bitwise equal. Build each variant first:
  gcc -O3 -march=native -fopenmp -fPIC -shared old.c -o old.so   (likewise new.c)
Usage: python kernel_ab.py old,new 1,2,4,8,16"""
import ctypes, time, torch, sys
from lookahead import kernels
libs = {v: ctypes.CDLL(f"{v}.so") for v in sys.argv[1].split(",")}
for l in libs.values():
    l.linear_f32.argtypes = [ctypes.c_void_p]*4 + [ctypes.c_int]*4
torch.manual_seed(0)
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
layers = [[(kernels.pack(torch.randn(n, k)), n, k) for k, n in shapes] for _ in range(30)]
def run(lib, x, outs):
    for L in layers:
        for (p, n, k), xi, o in zip(L, x, outs):
            lib.linear_f32(xi.data_ptr(), p.data_ptr(), None, o.data_ptr(), xi.shape[0], n, k, 2)
ms = [int(a) for a in sys.argv[2].split(",")]
for m in ms:
    x = [torch.randn(m, k) for k, n in shapes]
    res = {}
    for v, lib in libs.items():
        outs = [torch.empty(m, n) for k, n in shapes]
        run(lib, x, outs); res[v] = [o.clone() for o in outs]
    base = res[next(iter(res))]; same = all(torch.equal(a, b) for r in res.values() for a, b in zip(base, r))
    best = {v: 1e9 for v in libs}
    for r in range(15):
        for v, lib in libs.items():
            outs = [torch.empty(m, n) for k, n in shapes]
            t = time.perf_counter(); run(lib, x, outs); best[v] = min(best[v], time.perf_counter() - t)
    print(f"m={m:3d} " + "  ".join(f"{v} {b*1e3:6.2f} ms" for v, b in best.items()) + f"  identical {same}", flush=True)

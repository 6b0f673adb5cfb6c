import torch, time, sys
torch.set_num_threads(2)
L=60
dt=torch.float32
ws=[torch.randn(1536,576,dtype=dt) for _ in range(L)]
x=torch.randn(1,576,dtype=dt)
mk=[w.to_mkldnn() for w in ws]
mkl=[torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in ws]
halves=[w.view(2,768,576) for w in ws]
x2=x.view(1,576,1).expand(2,576,1)
xt=x.t().contiguous()
def timeit(name, f, args):
    for a in args: f(a)
    best=1e9
    for r in range(7):
      t=time.perf_counter()
      for a in args: f(a)
      best=min(best,time.perf_counter()-t)
    print(name,f"{best*1e3:.2f} ms  {L*1536*576*4/best/1e9:.1f} GB/s",flush=True)
timeit("linear", lambda w: torch.nn.functional.linear(x,w), ws)
timeit("onednn packed", lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), mk)
timeit("mkl packed", lambda pw: torch.ops.mkl._mkl_linear(x, pw[0], pw[1], None, 1), list(zip(mkl, ws)))
timeit("bmm halves", lambda h: torch.bmm(h, x2), halves)
timeit("w@xT", lambda w: w@xt, ws)
timeit("mul-sum", lambda w: (w*x).sum(-1), ws)
for M in (2,4,8):
  xm=torch.randn(M,576)
  timeit(f"linear M={M}", lambda w: torch.nn.functional.linear(xm,w), ws)
  timeit(f"onednn M={M}", lambda w: torch.ops.mkldnn._linear_pointwise(xm, w, None, "none", [], ""), mk)

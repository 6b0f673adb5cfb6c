import torch, time, sys
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv)>1 else 2)
L=60
for dt in (torch.float32, torch.bfloat16):
  ws=[torch.randn(1536,576,dtype=dt) for _ in range(L)]  # 212 MB f32: out of cache
  x=torch.randn(1,576,dtype=dt)
  xv=x[0]
  for name,f in [("linear",lambda w: torch.nn.functional.linear(x,w)),("mv",lambda w: torch.mv(w,xv)),("matmul_xwT",lambda w: x@w.t())]:
    for w in ws: f(w)
    best=1e9
    for r in range(5):
      t=time.perf_counter()
      for w in ws: f(w)
      best=min(best,time.perf_counter()-t)
    nb=sum(w.numel()*w.element_size() for w in ws)
    print(dt,name,f"{best*1e3:.2f} ms  {nb/best/1e9:.1f} GB/s",flush=True)

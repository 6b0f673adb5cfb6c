import torch, time
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, timed_seconds
lm,_ = load_model(None, dtype="float32")
sizes=(1,2,4,8,16)
arms = {}
r = HFModelRunner(lm, packed_linear=True); r.use_packed("onednn", 1); arms["eager-stacked"] = r
r = HFModelRunner(lm, packed_linear=True, compile=True); r.use_packed("onednn", 1); arms["compiled-frozen"] = r
runs = {n: _steps_over_context(r, 300, sizes if "compiled" not in n else sizes[1:], 1) for n, r in arms.items()}
for n, rs in runs.items():
    for k, run in rs.items():
        run()
res={}
for rnd in range(4):
  for n, rs in (list(runs.items()) if rnd%2==0 else list(runs.items())[::-1]):
    for k, run in rs.items():
      for _ in range(2): run()
      res.setdefault((n,k),[]).append(min(timed_seconds(run, torch.device("cpu")) for _ in range(10))*1000)
for key,v in res.items(): print(key, [round(x,1) for x in v], "best", round(min(v),1))

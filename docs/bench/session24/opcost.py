import torch, time
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead import hf
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, timed_seconds
lm,_ = load_model(None, dtype="float32")
runner = HFModelRunner(lm, packed_linear=True)
runner.use_packed("onednn", 1)
pl = runner._packed
op_forwards = list(pl._forwards)
def closure(w, b):
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
cl_forwards = [(m, closure(hf._PACKS["onednn"][m.weight.data_ptr()], m.bias)) for m, _ in op_forwards]
runs = _steps_over_context(runner, 300, (1,4), 1)
best = {}
for r in range(6):
    for name, fw in (("op", op_forwards), ("closure", cl_forwards)):
        pl._forwards = fw
        for k, run in runs.items():
            for _ in range(3): run()
            t = min(timed_seconds(run, runner.device) for _ in range(5))
            best[name, k] = min(best.get((name, k), 1e9), t)
for key, t in sorted(best.items()): print(key, round(t*1000, 2))

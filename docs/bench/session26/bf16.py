import torch
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, timed_seconds
sizes = (1, 2, 4, 8, 16)
runs = {}
for dtype in ("float32", "bfloat16"):
    lm, _ = load_model(None, dtype=dtype)
    r = HFModelRunner(lm, packed_linear=True); r.use_packed("onednn", 1)
    runs[dtype] = _steps_over_context(r, 300, sizes, 1)
res = {}
for rnd in range(4):
    for n, rs in (list(runs.items()) if rnd % 2 == 0 else list(runs.items())[::-1]):
        for k, run in rs.items():
            for _ in range(2): run()
            res.setdefault((n, k), []).append(min(timed_seconds(run, torch.device("cpu")) for _ in range(10)) * 1000)
for key, v in res.items(): print(key, [round(x, 1) for x in v], "best", round(min(v), 1))

import sys, torch
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import forward_cost, cost_curve
for dtype in sys.argv[1].split(","):
    lm,_ = load_model(None, dtype=dtype)
    for packed in (False, True):
        try:
            runner = HFModelRunner(lm, packed_linear=packed)
        except Exception as e:
            print(dtype, packed, "n/a", e); continue
        for batch in (1, 8):
            pts = forward_cost(runner, context=128, sizes=(1,2,3,4,8), repeats=3, batch=batch)
            print(dtype, "packed" if packed else "plain", "B=%d" % batch, " ".join(f"h{p.tokens}:{p.seconds*1000:.1f}ms({p.relative:.2f})" for p in pts), flush=True)

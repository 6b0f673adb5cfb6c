import torch, time
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context
lm,_ = load_model(None, dtype="float32")
runner = HFModelRunner(lm, packed_linear=False, compile=True)
run = _steps_over_context(runner, 100, (2,), 1)[2]
t=time.perf_counter(); run(); print("first call of a frozen 2-row step", round(time.perf_counter()-t,1), "s", flush=True)

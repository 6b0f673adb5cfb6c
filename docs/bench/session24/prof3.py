import sys, torch, time
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, timed_seconds
dtype=sys.argv[1]; compile=sys.argv[2]=="1"; packers=sys.argv[3].split(",")
lm,_ = load_model(None, dtype=dtype)
runner = HFModelRunner(lm, packed_linear=True, compile=compile)
for packer in packers:
    runner.use_packed(None if packer=="none" else packer, 1)
    runs = _steps_over_context(runner, 300, (1,4), 1)
    for k, run in runs.items():
        t=time.perf_counter(); run(); first=time.perf_counter()-t
        for _ in range(5): run()
        ts=[timed_seconds(run, runner.device) for _ in range(15)]
        print(dtype, "compiled" if compile else "eager", packer, "k", k, "min ms", round(min(ts)*1000,1), "first", round(first,1), flush=True)

import sys, torch, time
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, timed_seconds
lm,_ = load_model(None, dtype="float32")
for packed in (sys.argv[1:] or ["0","1"]):
    runner = HFModelRunner(lm, packed_linear=packed=="1", compile=True)
    print("packer", runner.packer, flush=True)
    runs = _steps_over_context(runner, 300, (1,4), 1)
    for k, run in runs.items():
        t=time.perf_counter(); run(); print("first call", round(time.perf_counter()-t,1), "s", flush=True)
        for _ in range(5): run()
        ts=[timed_seconds(run, runner.device) for _ in range(15)]
        print("compiled packed" if packed=="1" else "compiled plain", "k", k, "min ms", round(min(ts)*1000,1), flush=True)

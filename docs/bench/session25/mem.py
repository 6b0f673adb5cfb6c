import sys, torch, time, gc
torch.set_num_threads(2)
import lookahead.hf as hf
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, timed_seconds
def rss(): return int(open("/proc/self/statm").read().split()[1])*4096//2**20
lm,_ = load_model(None, dtype="float32")
print("model loaded rss", rss(), flush=True)
def compiled(model, mode):
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(model, options={"size_asserts": False, "freezing": True})
hf._compiled_forward = compiled
if len(sys.argv) > 1: torch._inductor.config.freezing = True
runner = HFModelRunner(lm, packed_linear=False, compile=True)
for batch, k in [(1,2),(1,4),(2,2),(2,1),(3,1)]:
    run = _steps_over_context(runner, 100, (k,), batch)[k]
    t=time.perf_counter(); run(); c=time.perf_counter()-t
    gc.collect()
    ts=[timed_seconds(run, runner.device) for _ in range(10)]
    print("B", batch, "k", k, "compile s", round(c,1), "min ms", round(min(ts)*1000,1), "rss MB", rss(), flush=True)

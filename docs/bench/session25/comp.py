import sys, torch, time
torch.set_num_threads(2)
import lookahead.hf as hf
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, timed_seconds
variant = sys.argv[1]
lm,_ = load_model(None, dtype="float32")
opts = {"size_asserts": False}
if "guard" in variant:
    opts["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
if "oblivious" in variant:
    import torch.fx.experimental._config as fxc
    fxc.backed_size_oblivious = True
if "freeze" in variant:
    torch._inductor.config.freezing = True
def compiled(model, mode):
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(model, options=opts)
hf._compiled_forward = compiled
if "unbacked" in variant:
    orig = torch._dynamo.maybe_mark_dynamic
    def mm(t, d):
        try:
            torch._dynamo.decorators.mark_unbacked(t, d)
        except Exception as e:
            print("mark_unbacked failed", e); orig(t, d)
    torch._dynamo.maybe_mark_dynamic = mm
packed = "freeze" not in variant
runner = HFModelRunner(lm, packed_linear=packed, compile=True)
if packed: runner.use_packed("onednn", 1)
print(variant, "packer", runner.packer, flush=True)
runs = _steps_over_context(runner, 300, tuple(int(s) for s in sys.argv[2].split(",")), 1)
res = {}
for k, run in runs.items():
    t=time.perf_counter(); run(); print("first call", round(time.perf_counter()-t,1), "s", flush=True)
    for _ in range(5): run()
for r in range(3):
  for k, run in runs.items():
    ts=[timed_seconds(run, runner.device) for _ in range(15)]
    res.setdefault(k, []).append(min(ts)*1000)
for k in res: print(variant, "k", k, "min ms", [round(x,1) for x in res[k]], flush=True)
import resource; print("maxrss MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss//1024)

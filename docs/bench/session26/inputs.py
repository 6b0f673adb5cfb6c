import sys, torch, time
from contextlib import contextmanager, nullcontext
torch.set_num_threads(2)
from lookahead.models import load_model
import lookahead.hf as hf
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context, timed_seconds
from torch._inductor import lowering
OPS = (torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary)
FALLBACKS = {op: lowering.fallback_handler(op, add_to_fallback_set=False) for op in OPS}
@torch.library.register_fake("mkldnn::_linear_pointwise.binary")
def _fake_binary(x, other, w, b, attr):
    return x.new_empty((*x.shape[:-1], w.shape[0]))
@contextmanager
def as_extern():
    import torch._inductor.mkldnn_lowerings  # noqa
    saved = {op: lowering.lowerings.get(op) for op in OPS}
    lowering.lowerings.update(FALLBACKS)
    try: yield
    finally:
        for op, l in saved.items():
            if l is None: del lowering.lowerings[op]
            else: lowering.lowerings[op] = l
lm,_ = load_model(None, dtype="float32")
which = sys.argv[1]
sizes=tuple(int(s) for s in sys.argv[2].split(","))
r = HFModelRunner(lm, packed_linear=True, compile=which != "eager"); r.use_packed("onednn", 1)
if which == "inputs":
    r.freezes = False
    r.compiled_heights = hf.COMPILED_HEIGHTS[1:]
    orig = r._forward
    def _forward(input_ids, compiled=False, **kw):
        if not compiled: return orig(input_ids, compiled, **kw)
        start = time.perf_counter()
        with r._packed.active(), as_extern(), hf.stacked_heads(r.model):
            out = r._compiled(input_ids=input_ids, use_cache=True, **kw)
        r.forward_seconds += time.perf_counter() - start
        return out
    r._forward = _forward
runs = _steps_over_context(r, 300, sizes, 1)
t0=time.perf_counter()
for k, run in runs.items():
    t=time.perf_counter(); run(); print(which, k, "first", round(time.perf_counter()-t,1), flush=True)
from torch._dynamo.utils import counters
print({k: dict(v) for k, v in counters.items() if k in ("inductor","stats","frames")})
res={}
for rnd in range(4):
    for k, run in runs.items():
      for _ in range(2): run()
      res.setdefault(k,[]).append(min(timed_seconds(run, torch.device("cpu")) for _ in range(10))*1000)
for key,v in res.items(): print(which, key, [round(x,1) for x in v], "best", round(min(v),1))

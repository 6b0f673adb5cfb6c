"""Session 29: dynamo's guard lookup on a compiled step of the default model without our packed linears, with and
without torch._dynamo.config.use_recursive_dict_tags_for_guards: python dict_tags.py notags|tags"""
import sys, torch
torch.set_num_threads(2)
if sys.argv[1] == "tags": torch._dynamo.config.use_recursive_dict_tags_for_guards = True
import lookahead.hf as hf
from lookahead.costs import _steps_over_context
from lookahead.models import load_model
model, _ = load_model(dtype="float32")
runner = hf.HFModelRunner(model, packed_linear=False, compile=True)
runner.freezes = False  # plain compiled forward, no packs, no freezing
run = _steps_over_context(runner, 256, (2,), 1)[2]
for _ in range(3): run()
from torch.profiler import profile
with profile() as p:
    for _ in range(20): run()
ev = {e.key: e for e in p.key_averages()}
print(sys.argv[1], {k: round(ev[k].self_cpu_time_total / 20) for k in ("Pregraph bytecode", "TorchDynamo Cache Lookup") if k in ev})

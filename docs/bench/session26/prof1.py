import torch
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead.hf import HFModelRunner
from lookahead.costs import _steps_over_context
from torch.profiler import profile
lm,_ = load_model(None, dtype="float32")
r = HFModelRunner(lm, packed_linear=True); r.use_packed("onednn", 1)
run = _steps_over_context(r, 300, (1,), 1)[1]
for _ in range(5): run()
with profile(record_shapes=True) as p:
    for _ in range(10): run()
print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=16))

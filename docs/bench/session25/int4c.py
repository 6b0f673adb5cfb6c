import torch, time
torch.set_num_threads(2)
from lookahead.models import load_model
from lookahead import generate
from lookahead.config import PLAIN_CONFIG
lm, tok = load_model(None, dtype="int4")
ids = tok("def quicksort(xs):", return_tensors="pt").input_ids
ref = lm.generate(ids, max_new_tokens=48, do_sample=False)
t=time.perf_counter(); out = generate(lm, ids, max_new_tokens=48, compile=True); print("compiled auto", time.perf_counter()-t, torch.equal(out.sequences, ref), out.stats.compile_seconds)
for cfg in (PLAIN_CONFIG, None):
  for c in (False, True):
    t=time.perf_counter(); out = generate(lm, ids, max_new_tokens=48, config=cfg, compile=c); print(cfg and cfg.label, "compile", c, round(48/(time.perf_counter()-t),1), "tok/s", torch.equal(out.sequences, ref))

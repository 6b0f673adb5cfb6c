"""generate per prompt: fresh step prices per call (as now) vs one StepPrices shared by every call's engine."""
import time, sys, torch
torch.set_num_threads(2)
import lookahead.engine as E
from lookahead import generate
from lookahead.models import load_model
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
m, tok = load_model(dtype=sys.argv[3] if len(sys.argv) > 3 else "float32")
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload(sys.argv[1], 1, False, None, int(sys.argv[2]))]
orig_init = E.Engine.__init__
shared = {}
SHARE = False
def init(self, *a, **k):
    global SHARE
    orig_init(self, *a, **k)
    if SHARE:
        self.prices = shared.setdefault("p", self.prices)
E.Engine.__init__ = init
generate(m, prompts[0][None], max_new_tokens=16)
res = {}
for rnd in range(4):
    for SHARE in ((False, True) if rnd % 2 == 0 else (True, False)):
        shared.clear()
        n = steps = fed = 0; t = time.perf_counter(); outs = []
        for p in prompts:
            out = generate(m, p[None], max_new_tokens=256)
            s = out.stats; outs.append(out.sequences[0].tolist())
            n += s.new_tokens; steps += s.steps; fed += s.tokens_fed
        tps = n / (time.perf_counter() - t)
        res.setdefault(SHARE, []).append(tps)
        print(f"round {rnd} shared={SHARE}: {tps:.1f} tok/s, {n/steps:.2f} tokens/step, fed {fed/steps:.1f}", flush=True)
print({k: round(sum(v) / len(v), 1) for k, v in res.items()}, round(sum(res[True]) / sum(res[False]), 3))

"""Per rank: estimated acceptance (as the budget sees it, calibrated) vs actual, over fed nodes. Usage: calib.py DATASET N DTYPE H"""
import sys, torch, statistics
torch.set_num_threads(2)
import lookahead.engine as E
import lookahead.core.decoder as D
from lookahead.models import load_model
from lookahead.engine import Engine, RequestParams
from lookahead.config import AUTO_CONFIG
from lookahead.cli import _workload
from lookahead.prompts import encode_prompt
from lookahead.core.prices import StepPrices
ds, N, dt, H = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
m, tok = load_model(dtype=dt)
prompts = [encode_prompt(tok, p.turns[0])[0] for p in _workload(ds, 1, False, None, N)]
if H > 0:
    E.node_counts = lambda demands, cost, w=None: [d.nodes_within(H) for d in demands]
    StepPrices.drafts = lambda self, b: True
pending = {}
rows = []  # (rank, est, accepted)
oplan, ocommit = D.LookaheadDecoder.plan, D.LookaheadDecoder._commit
def plan(self, proposal=None, nodes=None, window=True):
    p = oplan(self, proposal, nodes, window)
    if proposal is not None and nodes:
        scale = self.stats.calibration
        pending[id(self)] = [(i, min(1.0, proposal.nodes.probabilities[i] * scale), proposal.nodes.prefixes[i]) for i in range(nodes)]
    else:
        pending.pop(id(self), None)
    return p
def commit(self, plan, verdict, wo):
    fed = pending.pop(id(self), None)
    if fed:
        acc = tuple(verdict.tokens[:-1])
        for i, est, pre in fed:
            rows.append((i, est, acc[:len(pre)] == pre))
    return ocommit(self, plan, verdict, wo)
D.LookaheadDecoder.plan, D.LookaheadDecoder._commit = plan, commit
e = Engine(m, max_batch=1, max_length=max(p.numel() for p in prompts) + 300)
params = RequestParams(max_new_tokens=256, config=AUTO_CONFIG, eos_token_id=m.generation_config.eos_token_id)
for p in prompts:
    e.add_request(p, params)
    while e.has_unfinished(): e.step()
print("tok/step", e.stats.new_tokens / e.stats.steps)
for lo, hi in [(0,1),(1,2),(2,4),(4,8),(8,12),(12,16),(16,24),(24,32),(32,64)]:
    sel = [(est, a) for i, est, a in rows if lo <= i < hi]
    if sel:
        print(f"ranks {lo}-{hi-1}: n={len(sel)} est {statistics.mean(s[0] for s in sel):.3f} actual {statistics.mean(s[1] for s in sel):.3f}")

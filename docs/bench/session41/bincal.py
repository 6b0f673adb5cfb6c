"""Prototype: calibration per estimate bin, learnt from fed nodes (plus the top node). Import to patch."""
import math
import lookahead.core.decoder as D
from lookahead.core.drafter import RowDemand
BINS = 12
table = {}  # id(stats) -> [[est, acc] per bin]
def _bin(p):
    return min(BINS - 1, int(-math.log2(max(p, 1e-9))))
def calibrated(stats, p):
    t = table.get(id(stats))
    prior = stats.calibration
    if t is None:
        return p * prior
    est, acc = t[_bin(p)]
    return p * (acc + prior) / (est + 1.0)
def record(stats, estimates, flags):
    t = table.setdefault(id(stats), [[0.0, 0.0] for _ in range(BINS)])
    for p, a in zip(estimates, flags):
        b = t[_bin(p)]
        if b[0] >= 50:
            b[0] /= 2; b[1] /= 2
        b[0] += p; b[1] += a
oplan, ocommit = D.LookaheadDecoder.plan, D.LookaheadDecoder._commit
pending = {}
def demand(self, proposal, window=True, most=None):
    base = self.base_rows(window)
    return RowDemand(base, [min(1.0, calibrated(self.stats, p)) for p in proposal.nodes.probabilities], self.cost is not None,
                     most if most is not None else base + len(proposal.nodes.prefixes))
def plan(self, proposal=None, nodes=None, window=True):
    p = oplan(self, proposal, nodes, window)
    pending[id(self)] = proposal.nodes.probabilities[:len(p.tree.tokens)] if proposal is not None else []
    return p
def commit(self, plan, verdict, wo):
    est = pending.pop(id(self), [])
    if est:
        acc = set(verdict.nodes)
        record(self.stats, est, [i in acc for i in range(len(est))])
    return ocommit(self, plan, verdict, wo)
ORIGINAL = D.LookaheadDecoder.plan, D.LookaheadDecoder._commit, D.LookaheadDecoder.demand
def enable(on=True):
    D.LookaheadDecoder.plan, D.LookaheadDecoder._commit, D.LookaheadDecoder.demand = (plan, commit, demand) if on else ORIGINAL

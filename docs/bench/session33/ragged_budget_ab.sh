#!/bin/bash
# The ragged budget (ragged_budget.diff applied to the tree) against the commit before it (a worktree at /tmp/old:
# git worktree add /tmp/old HEAD), processes alternating; each prints lookahead/plain on an engine of 8 slots.
cd /work/main && source .venv/bin/activate
for i in 1 2 3; do for ds in humaneval mt_bench; do for t in old new; do
  if [ $t = old ]; then P=/tmp/old/src; else P=src; fi
  echo "$t $(PYTHONPATH=$P python docs/bench/session33/ragged_budget_ab.py $ds 16 2 2>&1 | grep -v 'Warn\|Loading' | tr '\n' ' ')"
done; done; done

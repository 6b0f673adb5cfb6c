#!/bin/bash
# The kernel change end to end: the tree before it (a worktree of 8ef8c2f at $OLD) and after, in alternating
# processes, `lookahead bench` on HumanEval and MT-bench (8 prompts, 256 tokens, our plain loop beside).
OLD=${OLD:-/tmp/s32/old}
cd "$(dirname "$0")/../../.."
for round in 1 2; do
  for ds in humaneval mt_bench; do
    for tree in old new; do
      path=$([ $tree = old ] && echo "$OLD/src" || echo src)
      PYTHONPATH=$path .venv/bin/python -m lookahead bench --dataset $ds --limit 8 --max-new-tokens 256 \
        --baselines plain --config auto > /tmp/kernel_e2e_${ds}_${tree}_${round}.txt 2>&1
      echo "$ds $tree r$round: $(grep -E 'lookahead-auto \| all|plain \| all|drafts' /tmp/kernel_e2e_${ds}_${tree}_${round}.txt | tr '\n' ' ')"
    done
  done
done

#!/usr/bin/env bash
# The candidates issue's workloads, eager (the default path), one process each: session 27's forward.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/bench/session27
run() { .venv/bin/lookahead bench --dataset "$1" --limit "$2" --max-new-tokens 256 --baselines greedy,pld,plain \
          --config auto --out "$OUT/$1" > "$OUT/$1.txt" 2>&1; }
for spec in "${@:-mt_bench:8 humaneval:8 spec_bench:12 gsm8k:8}"; do
  for item in $spec; do run "${item%%:*}" "${item##*:}"; done
done

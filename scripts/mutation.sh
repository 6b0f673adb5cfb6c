#!/usr/bin/env bash
# Mutation testing of the framework-free algorithm, src/lookahead/core/, with mutmut 3 (docs/mutation.md).
# The configuration ([tool.mutmut] in pyproject.toml) copies src/ to mutants/src, mutates only core/, and runs
# the quick tier on core: tests/test_algorithm.py, the two sample_choice unit tests and a few cheap tiny-model
# exactness tests. Prints the score (killed / total) and lists every mutant that was not killed.
#
#   bash scripts/mutation.sh            # a fresh, full run (removes mutants/ first)
#   KEEP=1 bash scripts/mutation.sh     # keep mutants/ and its results: only new or changed mutants are run
#   JOBS=1 bash scripts/mutation.sh     # parallel workers (default: the number of CPU cores)
# Afterwards: .venv/bin/mutmut show <name> shows a mutant's diff; .venv/bin/mutmut results lists survivors.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
MUTMUT=.venv/bin/mutmut
if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("mutmut") != "3.8.1")' 2>/dev/null; then
    "$PY" -m pip install --quiet mutmut==3.8.1
fi

if [ "${KEEP:-0}" != 1 ]; then
    rm -rf mutants
fi

# Each worker runs its tests single-threaded: the tiny models gain nothing from threads, and JOBS workers
# with a full thread pool each would fight over the same cores.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

start=$(date +%s)
"$MUTMUT" run --max-children "${JOBS:-$(nproc)}"
elapsed=$(( $(date +%s) - start ))

"$MUTMUT" results --all true | "$PY" -c '
import sys
from collections import Counter

elapsed = int(sys.argv[1])
rows = [line.strip().rsplit(": ", 1) for line in sys.stdin if ": " in line]
status = Counter(state for _, state in rows)
# A timeout (or a kill at the CPU limit, which mutmut files as "segfault") is a detected mutant too.
detected = {"killed", "timeout", "segfault"}
killed = sum(n for state, n in status.items() if state in detected)
total = len(rows)
print()
print("mutants by status:", ", ".join(f"{state} {n}" for state, n in status.most_common()))
print(f"score: {killed} / {total} killed = {100 * killed / max(total, 1):.1f}%   ({elapsed // 60} min {elapsed % 60} s)")
survivors = [(name, state) for name, state in rows if state not in detected]
if survivors:
    print("not killed (see .venv/bin/mutmut show NAME):")
    for name, state in survivors:
        print(f"  {name}: {state}")
' "$elapsed"

#!/usr/bin/env bash
# The GPU check (issue 12), for a lent GPU machine with torch and transformers but no internet: exactness
# on the device, T(k) eager and with CUDA graphs, projected speedups. Nothing is installed; the sources run
# from src/. Results: $OUT/gpu_check.json and $OUT/gpu_check.txt (OUT defaults to ./gpu-check-out).
#   bash scripts/gpu_check.sh            # on the GPU: about 5 minutes
#   bash scripts/gpu_check.sh --quick    # a dry run of the same code on tiny shapes (a CPU will do)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
# Cost curves and kernels are cached here; a fresh folder where the home one may not be writable.
export LOOKAHEAD_CACHE="${LOOKAHEAD_CACHE:-$(mktemp -d)}"
python=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
PYTHONPATH=src timeout 470 "$python" scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.txt"

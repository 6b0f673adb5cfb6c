# Plain compiled decoding (256 tokens of one MT-bench-like prompt), two trees alternating in separate processes
# (sessions 29, 30): BASE, a checkout of the commit before the change; the work tree as "new". The machine's speed drifts
# by up to 1.3x between processes, so only rounds side by side compare.
#   BASE=/tmp/base DTYPE=int4 bash plain_compiled_ab.sh 3
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
for _ in $(seq "${1:-3}"); do
  for tree in "$BASE" "$ROOT"; do
    (cd "$tree" && PYTHONPATH="$tree/src" "$ROOT/.venv/bin/python" "$HERE/plain_compiled.py" | sed "s|^|$tree |")
  done
done

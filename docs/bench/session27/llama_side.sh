#!/usr/bin/env bash
# llama.cpp's plain decoding (llama-bench, before and after) beside ours, float32 and int4, eager (with the stacked
# linears of session 26, our kernel and the greedy output layer of session 27), on 4 MT-bench prompts: a shorter run of scripts/llama_cpp_bench.sh (built and converted by it before).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/bench/session27/llama_side
WORK="$HOME/.cache/lookahead/llama.cpp-0.3.16"
SRC="$WORK/llama_cpp_python-0.3.16/vendor/llama.cpp"
Q4=$(.venv/bin/python -c 'from lookahead.models import DEFAULT_GGUF_FILE, default_model_dir; print(default_model_dir() / DEFAULT_GGUF_FILE)')
mkdir -p "$OUT"
llama_bench() { "$SRC/build/bin/llama-bench" -m "$Q4" -m "$WORK/default-f32.gguf" -t 2 -p 0 -n 256 -d 128 -r 3 -o json > "$1"; }
llama_bench "$OUT/llama_bench_0.json"
for dtype in float32 int4; do
  .venv/bin/lookahead bench --dataset mt_bench --limit 4 --max-new-tokens 256 --baselines plain --config auto \
    --dtype $dtype --out "$OUT/ours-$dtype" > "$OUT/ours-$dtype.txt" 2>&1
done
llama_bench "$OUT/llama_bench_1.json"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = []
for i in (0, 1):
    runs.append({("Q4_1" if "Q4_1" in r["model_type"] else "F32"): r["avg_ts"] for r in json.loads((out / f"llama_bench_{i}.json").read_text())})
print("llama.cpp tokens/s, before and after:", runs)
for dtype, kind in (("float32", "F32"), ("int4", "Q4_1")):
    llama = (runs[0][kind] + runs[1][kind]) / 2
    mine = json.loads((out / f"ours-{dtype}" / "results.json").read_text())["runs"]
    for method in sorted({r["method"] for r in mine}):
        rows = [r for r in mine if r["method"] == method]
        tokens = sum(r["new_tokens"] for r in rows)
        decoding = tokens / sum(r["seconds"] - r["phase_seconds"].get("prefill", 0.0) for r in rows)
        print(f"{dtype} {method}: {decoding:.1f} tokens/s decoding alone = {decoding / llama:.2f}x llama.cpp {kind} ({llama:.1f})")
PY

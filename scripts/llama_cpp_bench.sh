#!/usr/bin/env bash
# llama.cpp's plain decoding speed on the default model, on this machine: the yardstick of the speed
# issue's stretch target (our tokens/s against llama.cpp's). Everything comes from package registries:
# llama.cpp is built from the copy vendored in the llama-cpp-python sdist (PyPI), and the F32/BF16 GGUF
# files are converted from the dequantised default model with llama.cpp's own converter.
#
#   bash scripts/llama_cpp_bench.sh [threads] [out]   # llama-bench's table, then ours side by side
#   DTYPES="float32 int4" PROMPTS=4 COMPILE=--compile bash scripts/llama_cpp_bench.sh 2 OUT   # a shorter run
#
# In the same run it then decodes with our plain loop and lookahead (`auto`), eager and compiled, in
# float32, bfloat16 and with int4 weights (`--dtype int4`; DTYPES chooses), 8 MT-bench prompts (PROMPTS) of
# 256 new tokens, runs llama-bench again, and prints ours (decoding alone, as llama-bench measures it) against
# the mean of llama.cpp's two figures on the same weights (F32, BF16; Q4_1 for int4) and on Q4_1 (results
# under [out], default docs/bench/llama_cpp). COMPILE: how ours also runs compiled, `--cpp-wrapper` (the
# default), `--compile`, or empty (eager only).
#
# Needs cmake and a C++ compiler; the build (a few minutes) and the converted files are kept for reruns.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
THREADS="${1:-2}"
OUT="${2:-docs/bench/llama_cpp}"
VERSION=0.3.16
WORK="${LOOKAHEAD_CACHE:-$HOME/.cache/lookahead}/llama.cpp-$VERSION"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
PY=.venv/bin/python
mkdir -p "$WORK"

if [ ! -x "$SRC/build/bin/llama-bench" ]; then
  $PY -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
  tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF >/dev/null
  cmake --build "$SRC/build" -j "$(nproc)" --target llama-bench >/dev/null 2>&1
fi

# The Q4_1 file the default model is read from, and the same weights as F32 and BF16 GGUF.
Q4=$($PY -c 'from lookahead.models import DEFAULT_GGUF_FILE, default_model_dir; print(default_model_dir() / DEFAULT_GGUF_FILE)')
HF_DIR=$($PY -c 'from lookahead.models import load_model; m, _ = load_model(); print(m.config._name_or_path)')
if [ ! -d "$WORK/converter-deps" ]; then
  $PY -m pip install --quiet --target "$WORK/converter-deps" mistral_common sentencepiece
fi
for type in f32 bf16; do
  if [ ! -f "$WORK/default-$type.gguf" ]; then
    PYTHONPATH="$SRC/gguf-py:$WORK/converter-deps" $PY "$SRC/convert_hf_to_gguf.py" "$HF_DIR" \
      --outtype "$type" --outfile "$WORK/default-$type.gguf" >/dev/null 2>&1
  fi
done

mkdir -p "$OUT"
llama_bench() {
  "$SRC/build/bin/llama-bench" -m "$Q4" -m "$WORK/default-f32.gguf" -m "$WORK/default-bf16.gguf" \
    -t "$THREADS" -p 0 -n 256 -d 128 -r 3 -o json > "$1"
}
# llama.cpp runs before and after each of our dtypes (this machine's speed drifted by up to 1.6x over the
# half hour of a run): each dtype of ours is compared with the mean of the two runs beside it.
read -r -a DTYPES <<< "${DTYPES:-float32 bfloat16 int4}"
# By default compiled with the C++ wrapper (in one process, 3-7% faster int4 steps and 4% faster float32 ones
# on an earlier machine; the first compilation takes minutes, then inductor's cache).
COMPILE="${COMPILE---cpp-wrapper}"
llama_bench "$OUT/llama_bench_0.json"
for i in "${!DTYPES[@]}"; do
  # shellcheck disable=SC2086  # COMPILE: one option or none
  .venv/bin/lookahead bench --dataset mt_bench --limit "${PROMPTS:-8}" --max-new-tokens 256 --baselines plain \
    --config auto $COMPILE --dtype "${DTYPES[$i]}" --threads "$THREADS" --out "$OUT/ours-${DTYPES[$i]}" > /dev/null
  llama_bench "$OUT/llama_bench_$((i + 1)).json"
done
$PY - "$OUT" "${DTYPES[@]}" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
same = {"float32": "F32", "bfloat16": "BF16", "int4": "Q4_1"}  # ours -> llama.cpp on the same weights
dtypes = {dtype: same[dtype] for dtype in sys.argv[2:]}
runs = []  # per llama-bench run: weights -> tokens/s
for index in range(len(dtypes) + 1):
    run = {}
    for row in json.loads((out / f"llama_bench_{index}.json").read_text()):
        kind = "Q4_1" if "Q4_1" in row["model_type"] else ("F32" if "F32" in row["model_type"] else "BF16")
        run[kind] = row["avg_ts"]
    runs.append(run)
lines = ["| llama.cpp, plain, tokens/s | " + " | ".join(f"run {i}" for i in range(len(runs))) + " |",
         "|---|" + "---|" * len(runs)]
lines += [f"| {kind} | " + " | ".join(f"{run[kind]:.1f}" for run in runs) + " |" for kind in ("Q4_1", "F32", "BF16")]
# llama-bench's figure is decoding alone (its 128-token context is filled before the clock starts): ours is
# compared decoding alone too (without the prompt's prefill), and also shown with it; each dtype of ours
# against the mean of the llama.cpp runs before and after it.
lines += ["", "| ours | tokens/s | decoding alone | tokens/step | vs llama.cpp, same weights (runs beside it) "
          "| vs llama.cpp Q4_1 (runs beside it) |", "|---|---|---|---|---|---|"]
for index, (dtype, kind) in enumerate(dtypes.items()):
    beside = {k: (runs[index][k] + runs[index + 1][k]) / 2 for k in runs[index]}
    mine_all = json.loads((out / f"ours-{dtype}" / "results.json").read_text())["runs"]
    for method in sorted({r["method"] for r in mine_all}, key=lambda name: (name.count("-"), name)):
        mine = [r for r in mine_all if r["method"] == method]
        tokens, seconds, steps = (sum(r[k] for r in mine) for k in ("new_tokens", "seconds", "steps"))
        decoding = tokens / (seconds - sum(r["phase_seconds"].get("prefill", 0.0) for r in mine))
        lines.append(f"| {method} {dtype} | {tokens / seconds:.1f} | {decoding:.1f} | {tokens / steps:.2f} "
                     f"| {decoding / beside[kind]:.2f}x {kind} | {decoding / beside['Q4_1']:.2f}x |")
(out / "side_by_side.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY

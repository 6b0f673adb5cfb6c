#!/usr/bin/env bash
# llama.cpp's plain decoding speed on the default model, on this machine: the yardstick of the speed
# issue's stretch target (our tokens/s against llama.cpp's). Everything comes from package registries:
# llama.cpp is built from the copy vendored in the llama-cpp-python sdist (PyPI), and the F32/BF16 GGUF
# files are converted from the dequantised default model with llama.cpp's own converter.
#
#   bash scripts/llama_cpp_bench.sh [threads] [out]   # llama-bench's table, then ours side by side
#
# In the same run it then decodes with our plain loop and lookahead (`auto`), eager and compiled, in
# float32 and with int4 weights (`--dtype int4`), 8 MT-bench prompts of 256 new tokens, runs llama-bench
# again, and prints ours (decoding alone, as llama-bench measures it) against the mean of llama.cpp's two
# Q4_1 and F32 figures (results under [out], default docs/bench/llama_cpp).
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
# llama.cpp runs before and after ours (this machine's speed drifts by 10-20% over minutes): ours is
# compared with the mean of the two.
llama_bench "$OUT/llama_bench.json"
# Both compile with the C++ wrapper (in one process, 3-7% faster int4 steps and 4% faster float32 ones
# here; the first compilation takes minutes, then inductor's cache).
for dtype in float32 int4; do
  .venv/bin/lookahead bench --dataset mt_bench --limit 8 --max-new-tokens 256 --baselines plain --config auto \
    --cpp-wrapper --dtype "$dtype" --threads "$THREADS" --out "$OUT/ours-$dtype" > /dev/null
done
llama_bench "$OUT/llama_bench_after.json"
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
llama_runs: dict[str, list[float]] = {}  # weights -> tokens/s before ours, after ours
for name in ("llama_bench.json", "llama_bench_after.json"):
    for row in json.loads((out / name).read_text()):
        kind = "Q4_1" if "Q4_1" in row["model_type"] else ("F32" if "F32" in row["model_type"] else "BF16")
        llama_runs.setdefault(kind, []).append(row["avg_ts"])
llama = {kind: sum(speeds) / len(speeds) for kind, speeds in llama_runs.items()}
lines = ["| llama.cpp, plain | tokens/s before ours | after ours | mean |", "|---|---|---|---|"]
lines += [f"| {k} | {llama_runs[k][0]:.1f} | {llama_runs[k][1]:.1f} | {llama[k]:.1f} |" for k in llama]
# llama-bench's figure is decoding alone (its 128-token context is filled before the clock starts): ours is
# compared decoding alone too (without the prompt's prefill), and also shown with it.
lines += ["", "| ours | tokens/s | decoding alone | tokens/step | vs llama.cpp Q4_1 (mean) | vs llama.cpp F32 (mean) |",
          "|---|---|---|---|---|---|"]
for dtype in ("float32", "int4"):
    runs = json.loads((out / f"ours-{dtype}" / "results.json").read_text())["runs"]
    for method in ("plain", "lookahead-auto", "plain-cpp-wrapper", "lookahead-auto-cpp-wrapper"):
        mine = [r for r in runs if r["method"] == method]
        tokens, seconds, steps = (sum(r[k] for r in mine) for k in ("new_tokens", "seconds", "steps"))
        decoding = tokens / (seconds - sum(r["phase_seconds"].get("prefill", 0.0) for r in mine))
        lines.append(f"| {method} {dtype} | {tokens / seconds:.1f} | {decoding:.1f} | {tokens / steps:.2f} "
                     f"| {decoding / llama['Q4_1']:.2f}x | {decoding / llama['F32']:.2f}x |")
(out / "side_by_side.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY

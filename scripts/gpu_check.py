"""The GPU check (issue 12): run by scripts/gpu_check.sh on a lent GPU machine with torch and transformers
but no internet and nothing of ours installed, within a few minutes. Writes gpu_check.json under --out.

1. Exactness on the device: `lookahead.generate` against transformers' greedy `generate` on random-weight
   models built from configs (a tiny Llama, SmolLM2-135M's shape, Llama-3.2-1B's shape), float32, with the
   automatic config and W5 N4 G5; a divergence is reported with the reference's top-2 logit gap there.
2. T(k), k = 1..128 new tokens over a 256-token context: our step (custom 4-D mask, our KV store) in eager
   mode and compiled (`compile=True`: padded heights, inductor); transformers' forward over a static cache,
   eager and compiled with CUDA graphs (torch.compile mode="reduce-overhead"), for the 135M shape (float32)
   and the 1B and 7B shapes (bfloat16).
3. The projected speedup of lookahead per mode: tokens/step(k) x T(1) / T(k), with tokens/step(k) from the
   fit measured on CPU with the real model (docs/bench/sweep/sweep.json: a + b ln k), best k reported.

Each part is guarded: a failure is recorded and the next part runs. The cost curves run every shape's eager
modes first, then the compiled ones, each mode only while the time it may need is left before --budget s;
gpu_check.json is written after every mode, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32),
}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXT = 256
# Seconds a mode may take (a compiled one compiles several graphs of a large model on a fresh machine): none
# starts with less than this left before the budget's end.
NEEDS = {"ours_eager": 30, "hf_static_eager": 30, "hf_static_cuda_graphs": 150, "ours_compiled": 150}


def build(shape: str, dtype: torch.dtype, device: str, spread: float | None = None) -> LlamaForCausalLM:
    """Random weights of a known shape, built on the device. `spread`: redraw the matrices with this
    standard deviation, so that greedy text is peaked and repeats (lookahead then accepts guesses)."""
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if spread is not None:
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() >= 2:
                    parameter.normal_(0.0, spread / math.sqrt(parameter.shape[-1] / 64))
    return model.eval()


def exactness(device: str, shapes: list[str]) -> list[dict]:
    from lookahead import LookaheadConfig, generate

    rows = []
    for shape in shapes:
        model = build(shape, torch.float32, device, spread=0.15)
        generator = torch.Generator().manual_seed(1)
        for case in range(3):
            motif = torch.randint(3, 200, (6 + case,), generator=generator)
            prompt = torch.cat([motif, motif[:4], motif, torch.randint(3, 200, (5,), generator=generator)])
            ids = prompt.view(1, -1).to(device)
            reference = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0,
                                       output_scores=True, return_dict_in_generate=True)
            expected = reference.sequences[0, ids.shape[1]:].tolist()
            for label, config in (("auto", None), ("W5N4G5", LookaheadConfig())):
                start = time.perf_counter()
                out = generate(model, ids, max_new_tokens=64, config=config, eos_token_id=[])
                got = out.sequences[0, ids.shape[1]:].tolist()
                row = {"shape": shape, "prompt": case, "config": label, "identical": got == expected,
                       "tokens_per_step": out.stats.tokens_per_step, "seconds": time.perf_counter() - start}
                if got != expected:
                    at = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
                    top = reference.scores[at][0].float().topk(2).values
                    row.update(first_divergence=at, reference_top2_gap=float(top[0] - top[1]))
                _record(rows, row)
        del model
        _free(device)
    return rows


def static_costs(model: LlamaForCausalLM, device: str, compiled: bool, repeats: int) -> dict[int | str, float]:
    """transformers' forward over a StaticCache holding CONTEXT tokens, k new tokens with a causal mask, the
    cache rewound after each run; compiled: torch.compile(mode="reduce-overhead"), which captures CUDA
    graphs per shape, and "cudagraph_skips": the graphs inductor ran without them (0: the mode is what it says)."""
    from torch._dynamo.utils import counters

    from lookahead.costs import median_seconds

    cache = StaticCache(config=model.config, max_cache_len=CONTEXT + max(SIZES))
    parameters = inspect.signature(model.forward).parameters
    cache_argument = "cache" if "cache" in parameters else "past_key_values"
    vocab = model.config.vocab_size
    with torch.inference_mode():
        model(torch.randint(vocab, (1, CONTEXT), device=device), use_cache=True, **{cache_argument: cache},
              **({"cache_position": torch.arange(CONTEXT, device=device)} if "cache_position" in parameters else {}))
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False) if compiled else model.forward
    skipped_before = counters["inductor"]["cudagraph_skips"]
    seconds: dict[int | str, float] = {}
    for k in SIZES:
        ids = torch.randint(vocab, (1, k), device=device)
        position = torch.arange(CONTEXT, CONTEXT + k, device=device)
        extra = {"cache_position": position} if "cache_position" in parameters else {}

        def run():
            with torch.inference_mode():  # the rewind too: on CUDA the cache's counter is an inference tensor
                forward(input_ids=ids, position_ids=position[None], use_cache=True, **{cache_argument: cache}, **extra)
                _rewind(cache, k)

        for _ in range(2 if compiled else 0):  # compile and capture before timing
            run()
        seconds[k] = median_seconds(run, repeats, torch.device(device))
    if compiled:
        seconds["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skipped_before
    return seconds


def _rewind(cache: StaticCache, k: int) -> None:
    """Undo a k-token step where the static cache counts its own length (transformers 5.x); older versions
    write at the cache_position given and count nothing."""
    for layer in getattr(cache, "layers", []):
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.sub_(k)


def cost_curves(device: str, shapes: list[tuple[str, torch.dtype]], compiled: bool, deadline: float,
                save: Callable[[list[dict]], None]) -> list[dict]:
    """One row per shape: each mode's seconds by k, "skipped" or "failed: ...". Eager modes of every shape
    first, then the compiled ones (CUDA only); `save(rows)` after every mode."""
    from lookahead.costs import forward_cost
    from lookahead.hf import HFModelRunner

    def ours(model: LlamaForCausalLM, compile: bool) -> dict:
        runner = HFModelRunner(model, compile=compile)
        sizes = tuple(k for k in SIZES if not compile or k <= max(runner.compiled_heights))  # past them: eager
        seconds = {str(p.tokens): p.seconds for p in forward_cost(runner, context=CONTEXT, sizes=sizes, repeats=5)}
        if compile:  # which heights compiled, in how long; any that failed ran eagerly
            seconds.update(compile_seconds={str(shape): t for shape, t in runner.compile_seconds.items()},
                           eager_shapes=sorted(map(str, runner._eager_shapes)))
        return seconds

    measures = {
        "ours_eager": lambda model: ours(model, False),
        "hf_static_eager": lambda model: static_costs(model, device, False, 5),
        "hf_static_cuda_graphs": lambda model: static_costs(model, device, True, 5),
        # generate(compile=True)'s path: padded heights through torch.compile (inductor, no CUDA graphs)
        "ours_compiled": lambda model: ours(model, True),
    }
    rows = [{"shape": shape, "dtype": str(dtype).removeprefix("torch.")} for shape, dtype in shapes]
    passes = [("ours_eager", "hf_static_eager")] + ([("hf_static_cuda_graphs", "ours_compiled")] if compiled else [])
    if not compiled:
        for row in rows:
            row.update(hf_static_cuda_graphs="skipped: CUDA only", ours_compiled="skipped: CUDA only")
    for modes in passes:
        for row, (shape, dtype) in zip(rows, shapes):
            if all(time.time() + NEEDS[mode] > deadline for mode in modes):
                row.update({mode: "skipped: time budget spent" for mode in modes})
                continue
            model = build(shape, dtype, device)
            for mode in modes:
                if time.time() + NEEDS[mode] > deadline:
                    row[mode] = "skipped: time budget spent"
                    continue
                try:
                    row[mode] = {str(k): v for k, v in measures[mode](model).items()}
                except Exception as error:  # noqa: BLE001 - record it, go on with the next mode
                    row[mode] = f"failed: {type(error).__name__}: {error}"[:500]
                print(json.dumps({"shape": shape, mode: row[mode]}), flush=True)
                save(rows)
            del model
            _free(device)
    return rows


def _record(rows: list[dict], row: dict) -> None:
    """Keep a result and show it at once (a run cut short by the time limit still printed it)."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def _free(device: str) -> None:
    """Give the memory of the model just dropped back before building the next one."""
    if device == "cuda":
        torch.cuda.empty_cache()


def projections(curves: list[dict], fit: dict) -> list[dict]:
    """tokens/step(k) x T(1)/T(k) per shape and mode, tokens/step(k) = max(1, a + b ln k), 1 at k = 1."""
    rows = []
    for row in curves:
        for mode, measured in row.items():
            if not isinstance(measured, dict):
                continue
            seconds = {k: t for k, t in measured.items() if k.isdigit()}
            t1 = seconds["1"]
            speedups = {k: (1.0 if k == "1" else max(1.0, fit["intercept"] + fit["slope"] * math.log(int(k)))) * t1 / t
                        for k, t in seconds.items()}
            best = max(speedups, key=speedups.get)
            rows.append({"shape": row["shape"], "mode": mode, "T1_ms": 1000 * t1, "best_k": int(best),
                         "projected_speedup": speedups[best],
                         "relative_T": {k: t / t1 for k, t in seconds.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds the whole check may take (gpu_check.sh stops it at 470)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (a dry run on a CPU)")
    args = parser.parse_args()
    deadline = time.time() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available() or args.device == "cpu" and not args.quick:
        parser.error("the full check runs on a CUDA device (none is visible here); --quick is the dry run for a CPU")
    report: dict = {"environment": {
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}}
    print(json.dumps(report["environment"]), flush=True)

    def save() -> None:
        """Write what is measured so far, projections included, whole: a run cut off keeps a file that parses."""
        if isinstance(report.get("cost_curves"), list):
            report["projections"] = projections(report["cost_curves"], fit)
        partial = args.out / "gpu_check.json.partial"
        partial.write_text(json.dumps(report, indent=1))
        os.replace(partial, args.out / "gpu_check.json")

    save()  # the environment, whatever fails next (an import of ours on an older transformers, say)
    sweep = Path(__file__).resolve().parent.parent / "docs" / "bench" / "sweep" / "sweep.json"
    fit = json.loads(sweep.read_text())["fit"]  # read by save() once there are cost curves
    exact_shapes = ["tiny"] if args.quick else ["tiny", "smollm2-135m", "llama-1b"]
    cost_shapes = [("tiny", torch.float32)] if args.quick else [
        ("smollm2-135m", torch.float32), ("llama-1b", torch.bfloat16), ("llama-7b", torch.bfloat16)]
    for part, run in (("exactness", lambda: exactness(args.device, exact_shapes)),
                      ("cost_curves", lambda: cost_curves(args.device, cost_shapes, args.device == "cuda", deadline,
                                                          lambda rows: report.update(cost_curves=rows) or save()))):
        if time.time() > deadline:
            report[part] = "skipped: time budget spent"
            continue
        try:
            report[part] = run()
        except Exception:  # noqa: BLE001 - record it, go on with the next part
            report[part] = "failed: " + traceback.format_exc()[-2000:]
            print(f"{part} {report[part]}", flush=True)
        save()
    for row in report.get("projections", []):
        print(f"{row['shape']:>14} {row['mode']:>22}: T(1) {row['T1_ms']:.2f} ms, best k {row['best_k']}, "
              f"projected speedup {row['projected_speedup']:.2f}x", flush=True)
    found = problems(report)
    if found:
        sys.exit(f"failed: {'; '.join(found)} (see above and gpu_check.json)")


def problems(report: dict) -> list[str]:
    """What went wrong: a part or a mode that failed, an output that parted from generate's."""
    found = [part for part in ("exactness", "cost_curves") if str(report.get(part, "")).startswith("failed")]
    for row in report.get("exactness") if isinstance(report.get("exactness"), list) else ():
        if not row["identical"]:
            found.append(f"exactness {row['shape']} prompt {row['prompt']} {row['config']} diverged")
    for row in report.get("cost_curves") if isinstance(report.get("cost_curves"), list) else ():
        found += [f"cost_curves {row['shape']} {mode}" for mode, value in row.items()
                  if isinstance(value, str) and value.startswith("failed")]
    return found


if __name__ == "__main__":
    main()

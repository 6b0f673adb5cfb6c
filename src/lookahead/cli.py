"""The `lookahead` command line."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from itertools import product, zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional
from urllib.parse import urlsplit

import typer

from .config import AUTO_CONFIG, LookaheadConfig
from .workloads import BUILTIN, CORPUS_PAIRS, load_workload

if TYPE_CHECKING:
    from rich.progress import Progress

# torch, transformers and the modules on them are imported by the commands that run: `--help`, `--version` and
# a refused option answer in a fraction of a second instead of the seconds those imports take.

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Lookahead decoding for Hugging Face causal LMs.")

ModelOption = Annotated[
    Optional[str], typer.Option("--model", help="Local folder, hub id or .gguf path; default: SmolLM2-135M-Instruct.")
]
GgufOption = Annotated[Optional[str], typer.Option("--gguf-file", help="GGUF file name inside --model's folder.")]
DtypeOption = Annotated[str, typer.Option("--dtype", help=(
    "float32, bfloat16 or float16: the whole model in that dtype; int8 or int4: linear weights kept quantised "
    "(int8 per channel; int4 in groups of 32 with a minimum, like GGUF Q4_1; CPU only), float32 elsewhere."))]


TopKOption = Annotated[Optional[int], typer.Option(help="Sampling: keep the k likeliest tokens (0: all).")]
TopPOption = Annotated[Optional[float], typer.Option(help="Sampling: nucleus mass in (0, 1].")]
CppWrapperOption = Annotated[bool, typer.Option("--cpp-wrapper", help="Compile (implies --compile) with the code that calls the kernels in C++: a few % faster steps, compiles up to 9x longer (cached on disk).")]


def _seed(value: int) -> int:
    if not -2**63 <= value < 2**64:  # torch's range (checked here: typer's min/max would print it in --help)
        raise typer.BadParameter(f"must be in [-2**63, 2**64), got {value}")
    return value


SeedOption = Annotated[int, typer.Option(callback=_seed, help="Seed for sampling.")]


def _fail(message: str) -> NoReturn:
    """End the command with one line on stderr and exit code 2, as for a bad option."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(2)


def _sampling_options(
    temperature: float, top_k: int | None, top_p: float | None, repetition_penalty: float | None = None
) -> dict:
    """generate() options; checked here so that a bad value is reported before the model loads. An option not
    given is left out (the model's generation config's, else transformers' default): None given would switch it off."""
    options = {"do_sample": temperature > 0, "temperature": temperature}
    options |= {name: value for name, value in (("top_k", top_k), ("top_p", top_p),
                                                ("repetition_penalty", repetition_penalty)) if value is not None}
    for name, value, valid, allowed in [
        ("--temperature", temperature, temperature >= 0, "a number >= 0 (0 means greedy)"),
        ("--top-k", top_k, top_k is None or top_k >= 0, "an integer >= 0"),
        ("--top-p", top_p, top_p is None or 0 < top_p <= 1, "a number in (0, 1]"),
        ("--repetition-penalty", repetition_penalty, repetition_penalty is None or repetition_penalty > 0, "a number > 0"),
    ]:
        if not valid:
            raise typer.BadParameter(f"must be {allowed}, got {value!r}", param_hint=name)
    for name, value in (("--top-k", top_k), ("--top-p", top_p)):
        if value is not None and not options["do_sample"]:
            raise typer.BadParameter("applies only when sampling: give --temperature > 0 too", param_hint=name)
    if not options["do_sample"]:  # greedy: plain generate takes no sampling options
        del options["temperature"]
    return options


def _refuse_given(ctx: typer.Context, names: list[str], why: str) -> None:
    """A usage error naming the options of `names` given on the command line, which this run would ignore."""
    # By name: typer may bring its own copy of click, whose ParameterSource is another enum.
    given = [name for name in names if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]
    if given:
        raise typer.BadParameter(why, param_hint=", ".join("--" + name.replace("_", "-") for name in given))


def _config(window: int | None, ngram: int | None, guesses: int | None, suffix: int | None) -> LookaheadConfig | None:
    """None (the automatic config) when no option is given; else the given values over the defaults."""
    given = {k: v for k, v in {"window": window, "ngram": ngram, "guesses": guesses, "suffix": suffix}.items()
             if v is not None}
    if not given:
        return None
    try:
        return LookaheadConfig(**given)
    except ValueError as error:
        raise _config_refusal(error, {name: f"--{name}" for name in given}) from error


def _config_refusal(error: ValueError, options: dict[str, str]) -> typer.BadParameter:
    """A LookaheadConfig error said of the option that set the field it names ("LookaheadConfig.window must be
    ..." -> --window: must be ...), where `options` (field -> option) holds it; one of several fields (a window
    too large for a step) as it is."""
    field, _, rest = str(error).removeprefix("LookaheadConfig.").partition(" ")
    if field in options:
        return typer.BadParameter(rest, param_hint=options[field])
    return typer.BadParameter(str(error))


@app.command("generate")
def generate_command(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(help="The prompt text; - reads it from standard input (less its last line end, unless --raw).")],
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    max_new_tokens: Annotated[Optional[int], typer.Option(
        min=1, help="Most tokens to generate (default: the generation config's, else 128 or what the model's context "
                    "leaves after the prompt).")] = None,
    window: Annotated[Optional[int], typer.Option(help="W: lookahead window columns (0: off).")] = None,
    ngram: Annotated[Optional[int], typer.Option(help="N: n-gram size (>= 2).")] = None,
    guesses: Annotated[Optional[int], typer.Option(help="G: n-grams verified per step (0: off).")] = None,
    suffix: Annotated[Optional[int], typer.Option(help="Longest suffix-source draft (0: off).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    compare: Annotated[bool, typer.Option("--compare", help="Also run plain model.generate and compare.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")] = False,
    temperature: Annotated[float, typer.Option(help="0: greedy (exact); > 0: sampling.")] = 0.0,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(help="> 0; 1 is none.")] = None,
    seed: SeedOption = 0,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="End the reply at the first token that completes this string, the string kept (generate's stop_strings); repeat for several.")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Processes that share each step (lookahead parallelism over gloo; a fixed W,N,G).")] = 1,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch threads per process (default: torch's choice; with --workers, the cores shared out).")] = None,
    tensor_parallel: Annotated[bool, typer.Option("--tensor-parallel", help="Under torchrun: split the model's weights across the processes (transformers' tp_plan='auto') and decode as one process.")] = False,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the decoding steps (padded to a few heights, each compiled on first use).")] = False,
    cpp_wrapper: CppWrapperOption = False,
) -> None:
    """Generate text with lookahead decoding, streaming it to the terminal.

    Without --window/--ngram/--guesses/--suffix the automatic config is used (every draft source, each
    step sized to the measured forward cost); any of them given overrides LookaheadConfig's defaults
    (W=5, N=4, G=5, no suffix source, no budget). With --workers K (or under torchrun) K processes share
    each step; their config is fixed (W=5, N=4, G=5 unless given)."""
    config = _config(window, ngram, guesses, suffix)
    compile = _compile_mode(compile, cpp_wrapper)
    if prompt == "-":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun hands its standard input to one process alone
            raise typer.BadParameter("a prompt from standard input ('-') reaches one of torchrun's processes only: "
                                     "pass the prompt as an argument", param_hint="PROMPT")
        prompt = sys.stdin.read()
        if not raw:  # the line end that `echo` or a file adds is no part of a chat message (raw: the text as it is)
            prompt = prompt.removesuffix("\n").removesuffix("\r")
    if not prompt.strip():
        raise typer.BadParameter("the prompt is empty" + (" (or blank)" if prompt else ""), param_hint="PROMPT")
    sampling = _sampling_options(temperature, top_k, top_p, repetition_penalty)
    if temperature == 0:
        _refuse_given(ctx, ["seed"], "applies only with sampling (--temperature > 0); greedy decoding draws nothing")
    if stop is not None and not all(stop):
        raise typer.BadParameter("a stop string must not be empty", param_hint="--stop")
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's processes
    # Under tensor parallelism every process decodes the same tokens; rank 0 reports them.
    reports = not tensor_parallel or int(os.environ.get("RANK", "0")) == 0
    if tensor_parallel:
        from .quant import QUANTISED_WEIGHTS

        if dtype in QUANTISED_WEIGHTS:
            raise typer.BadParameter(f"--dtype {dtype} keeps weights quantised in layers of our own, which "
                                     "transformers cannot split: leave out one of the two", param_hint="--tensor-parallel")
        if launched < 2 or workers > 1:
            raise typer.BadParameter("takes processes started by torchrun (torchrun --nproc-per-node K -m lookahead "
                                     "generate ... --tensor-parallel), without --workers", param_hint="--tensor-parallel")
        if not reports:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
        launched = 1  # one logical process: the model's forward spans them all
    elif workers > 1 or launched > 1:
        if workers > 1 and launched > 1:
            raise typer.BadParameter("torchrun started the processes already; drop --workers", param_hint="--workers")
        several = "drop --workers" if workers > 1 else "not under torchrun"
        for given, option in ((compare, "--compare"), (compile, "--compile/--cpp-wrapper"), (stop, "--stop")):
            if given:
                raise typer.BadParameter(f"{option} runs in one process; {several}", param_hint=option)
    import torch  # after the checks above, which need none of these
    import torch.distributed as dist
    from transformers import TextStreamer

    from .baseline import hf_generate
    from .engine import check_request
    from .generation import generate, new_token_count
    from .hf import context_length
    from .prompts import encode_prompt

    lm, tokenizer = _load_model(model, gguf_file, dtype, threads if workers == 1 else None, tensor_parallel)
    if tensor_parallel and dist.is_initialized():  # transformers made the group: ended before exit, where gloo's
        ctx.call_on_close(dist.destroy_process_group)  # threads left running had aborted a loaded process
    input_ids = encode_prompt(tokenizer, prompt, raw=raw)
    try:
        if max_new_tokens is None:  # as generate takes it: the generation config's, else what the context leaves
            max_new_tokens = new_token_count(lm.generation_config, None, input_ids.shape[1], context_length(lm))
        check_request(lm, input_ids, max_new_tokens)
    except ValueError as error:
        _fail(str(error))
    if workers > 1 or launched > 1:
        from .parallel import check_one_process_settings

        try:  # before any worker starts
            check_one_process_settings(lm)
        except ValueError as error:
            _fail(str(error))
        call = {"input_ids": input_ids, "max_new_tokens": max_new_tokens, "config": config, **sampling, "seed": seed}
        if launched > 1:
            out = _torchrun_rank(lm, call)
        else:
            del lm  # each worker loads its own copy
            out = _local_workers(workers, threads, (model, gguf_file, dtype), call)
        if out is None:  # a torchrun rank other than 0: rank 0 reports
            return
        text = tokenizer.decode(out.sequences[0, input_ids.shape[1]:], skip_special_tokens=True)
        stats = out.stats
        if as_json:
            print(json.dumps({"text": text, "workers": max(workers, launched), **stats.as_dict()}))
        else:
            print(text)
            print(f"[{stats.new_tokens} new tokens, {stats.steps} steps, {stats.tokens_per_step:.2f} tokens/step, "
                  f"{stats.tokens_per_second:.1f} tokens/s, {max(workers, launched)} processes]", file=sys.stderr)
        return

    # The tokenizer always: a model's generation config may hold stop strings of its own (taken without --stop).
    stops = {"tokenizer": tokenizer} | ({} if stop is None else {"stop_strings": stop})

    def ours(tokens: int, streamer=None):
        return generate(lm, input_ids, max_new_tokens=tokens, config=config, streamer=streamer, seed=seed,
                        compile=compile, **sampling, **stops)

    def theirs(tokens: int, streamer=None):
        torch.manual_seed(seed)
        return hf_generate(lm, input_ids, max_new_tokens=tokens, streamer=streamer, **sampling, **stops)

    def streamer() -> TextStreamer | None:  # the reply streamed as it is made (not with --json)
        return None if as_json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    try:  # what only decoding finds wrong (the model's generation config, a context too short to time steps in)
        if compare:  # warm both paths up so that neither pays one-off costs in the timed run
            ours(2)
            theirs(2)
        start = time.perf_counter()
        out = ours(max_new_tokens, streamer())
        seconds = time.perf_counter() - start  # the whole call, as the baseline's: its set-up too
    except ValueError as error:
        _fail(str(error))
    new_ids = out.sequences[0, input_ids.shape[1] :]
    stats = out.stats
    report: dict[str, object] = {"text": tokenizer.decode(new_ids, skip_special_tokens=True), **stats.as_dict()}
    if compare:
        from .bench.runner import per_token_speedup

        # Where ours streamed the text, theirs streams it too, unshown: each call pays the streamer's decoding.
        with contextlib.redirect_stdout(io.StringIO()):
            baseline, baseline_seconds = theirs(max_new_tokens, streamer())
        report.update(
            baseline_seconds=baseline_seconds,
            # per new token: two samples may end at different lengths
            call_seconds=seconds,  # ours, timed as baseline_seconds is: the whole call (stats.seconds: decoding)
            speedup=per_token_speedup(baseline_seconds, baseline.shape[1] - input_ids.shape[1], seconds,
                                      out.sequences.shape[1] - input_ids.shape[1]),
            # two samples are not comparable token for token; greedy outputs must be identical
            identical=None if sampling.get("do_sample") else torch.equal(baseline.cpu(), out.sequences),
        )
    if as_json:
        print(json.dumps(report))
        return
    summary = (
        f"[{stats.new_tokens} new tokens, {stats.steps} steps, {stats.tokens_per_step:.2f} tokens/step, "
        f"{stats.tokens_per_second:.1f} tokens/s"
    )
    if compile:
        summary += f", {stats.compile_seconds:.1f}s of it compiling"
    if compare:
        summary += (
            f"; model.generate {report['baseline_seconds']:.2f}s vs lookahead {seconds:.2f}s, "
            f"speedup {report['speedup']:.2f}x, identical: "
            + ("not compared (sampled)" if report["identical"] is None else str(report["identical"]))
        )
    if reports:
        print(summary + "]", file=sys.stderr)  # the reply alone on stdout, for a pipe or a file


def _print_version(asked: bool) -> None:
    if asked:
        from . import __version__

        print(f"lookahead {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the installed version and exit.")] = False,
) -> None:
    """Lookahead decoding for Hugging Face causal LMs."""


bench_app = typer.Typer(help="Benchmarks: methods side by side on a workload or at batch sizes; subcommands: the (W, N, G) "
                             "sweep, the forward cost curve, a shared corpus, a server under load, lookahead parallelism.")
app.add_typer(bench_app, name="bench")

ThreadsOption = Annotated[Optional[int], typer.Option(min=1, help="torch threads (default: torch's choice).")]


def _out_folder(out: Path | None) -> Path | None:
    """--out made (or found) before any work: a run must not end unable to write what it measured."""
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):  # a folder that exists may still refuse files
                pass
        except OSError as error:
            raise typer.BadParameter(f"cannot write into the folder {out}: {error.strerror or error}") from error
    return out


OutOption = Annotated[Optional[Path], typer.Option("--out", callback=_out_folder,
                                                   help="Folder for results.json, report.md and plots.")]


def _parse_config(text: str) -> LookaheadConfig:
    name, colon, width = text.strip().partition(":")
    if name == "auto":
        if not colon:
            return AUTO_CONFIG
        columns = _integer(width)
        if columns is None or columns < 0:
            raise typer.BadParameter(f"expected auto:W with W an integer >= 0 (the most window columns), got "
                                     f"{text!r}", param_hint="--config")
        try:  # what the window adds, measured against auto
            return dataclasses.replace(AUTO_CONFIG, window=columns)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--config") from error
    values = [_integer(part) for part in text.split(",")]
    if len(values) != 3 or None in values:
        raise typer.BadParameter(f"expected W,N,G (three integers), auto or auto:W, got {text!r}",
                                 param_hint="--config")
    window, ngram, guesses = values
    try:
        return LookaheadConfig(window=window, ngram=ngram, guesses=guesses)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--config") from error


def _integer(text: str) -> int | None:
    """The integer a command-line value spells, None for anything else (what str.isdigit takes, such as '²', too)."""
    try:
        return int(text)
    except ValueError:
        return None


def _torchrun_rank(lm, call: dict):
    """This rank's part of `generate` under torchrun: the output on rank 0, None on the others."""
    import torch.distributed as dist

    from .parallel import DEFAULT_TIMEOUT, parallel_generate

    if not dist.is_initialized():
        dist.init_process_group("nccl" if lm.device.type == "cuda" else "gloo", timeout=DEFAULT_TIMEOUT)
    try:
        out = parallel_generate(lm, **call)
    except ValueError as error:  # every rank finds it: each says it in one line, as one process would
        _fail(str(error))
    finally:
        dist.destroy_process_group()
    return out if int(os.environ.get("RANK", "0")) == 0 else None


def _local_workers(workers: int, threads: int | None, source: tuple, call: dict):
    """`generate --workers`: `workers` local processes, each loading the model from `source`."""
    from .parallel import WorkerError, run_workers

    try:
        return run_workers(workers, _parallel_worker, source, call, threads=threads)
    except WorkerError as error:
        _fail(str(error))


def _parallel_worker(source: tuple[str | None, str | None, str], call: dict):
    """One process of `generate --workers`: its own copy of the model (name, GGUF file, dtype), its share of
    every step."""
    from transformers.utils import logging as hf_logging

    from .models import load_model
    from .parallel import parallel_generate

    hf_logging.disable_progress_bar()
    model, gguf_file, dtype = source
    lm, _ = load_model(model, gguf_file=gguf_file, dtype=dtype)
    return parallel_generate(lm, **call)


def _load_model(model: str | None, gguf_file: str | None, dtype: str, threads: int | None,
                tensor_parallel: bool = False):
    import torch
    from transformers.utils import logging as hf_logging

    from .hf import check_model
    from .models import WEIGHT_CHOICES, ModelLoadError, load_model

    if dtype not in WEIGHT_CHOICES:
        raise typer.BadParameter(f"must be one of {list(WEIGHT_CHOICES)}, got {dtype!r}", param_hint="--dtype")
    if gguf_file is not None and model is None:  # load_model's message would name its own arguments
        raise typer.BadParameter(f"names a file inside --model's folder: give --model too (or the .gguf file's path "
                                 f"as --model, without --gguf-file), got {gguf_file!r} alone", param_hint="--gguf-file")
    if threads is not None:
        torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    try:
        loaded = load_model(model, gguf_file=gguf_file, dtype=dtype, **({"tp_plan": "auto"} if tensor_parallel else {}))
    except ModelLoadError as error:  # the message says what was looked for and where
        _fail(str(error))
    try:
        check_model(loaded[0])  # every command decodes with lookahead: a model it cannot run is refused here, once
    except ValueError as error:
        _fail(str(error))
    return loaded


def _check_prompts(lm, prompts, max_new_tokens: int) -> None:
    """Every prompt (token ids) fits the model's context with max_new_tokens, before any run: else one line, exit 2
    (a benchmark had failed part-way, after its baselines, with a traceback)."""
    from .engine import check_request

    try:
        for ids in prompts:
            check_request(lm, ids, max_new_tokens)
    except ValueError as error:
        _fail(str(error))


def _workload(dataset: str, turns: int, raw: bool, category: str | None, limit: int | None):
    try:
        prompts = load_workload(dataset, turns=turns, raw=raw)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--dataset") from error
    if category is not None:
        known = sorted({p.category for p in prompts})
        if category not in known:
            raise typer.BadParameter(f"{category!r} is not in {dataset}; categories: {known}", param_hint="--category")
        prompts = [p for p in prompts if p.category == category]
    if limit is not None:  # round-robin over categories, so that a small limit still covers each of them
        by_category: dict[str, list] = {}
        for prompt in prompts:
            by_category.setdefault(prompt.category, []).append(prompt)
        interleaved = [p for rank in zip_longest(*by_category.values()) for p in rank if p is not None]
        prompts = interleaved[:limit]
    return prompts


@bench_app.callback(invoke_without_command=True)
def bench_command(
    ctx: typer.Context,
    dataset: Annotated[str, typer.Option(help=f"One of {', '.join(BUILTIN)}, or a JSONL file with 'prompt' or 'turns'.")] = "mt_bench",
    limit: Annotated[Optional[int], typer.Option(min=1, help="Most prompts, taken evenly from the categories.")] = None,
    category: Annotated[Optional[str], typer.Option(help="Only this category.")] = None,
    turns: Annotated[int, typer.Option(min=1, max=2, help="User turns of multi-turn data.")] = 1,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template (HumanEval: raw completion).")] = False,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 256,
    config: Annotated[Optional[list[str]], typer.Option("--config", help="Lookahead W,N,G, auto, or auto:W (the automatic config with at most W window columns; auto:0 without the window); repeat for several (default: auto and 5,4,5).")] = None,
    baselines: Annotated[str, typer.Option(help="Comma list from greedy, pld, plain (empty: none).")] = "greedy,pld,plain",
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    threads: ThreadsOption = None,
    out: OutOption = None,
    profile: Annotated[bool, typer.Option("--profile", help="Print where each method's time goes.")] = False,
    compile: Annotated[bool, typer.Option("--compile", help="Also run each of our methods compiled (generate(compile=True)), as <name>-compiled (<name>-cpp-wrapper with --cpp-wrapper); with --batch-size, our engines compile instead.")] = False,
    cpp_wrapper: CppWrapperOption = False,
    sample: Annotated[bool, typer.Option("--sample", help="Sample instead of greedy decoding, in every method.")] = False,
    temperature: Annotated[float, typer.Option(help="With --sample.")] = 1.0,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    seed: SeedOption = 0,
    batch_size: Annotated[Optional[str], typer.Option(help="Comma list of batch sizes: compare transformers' batched generate, our plain engine and lookahead (the first --config, default auto) at each, on --limit prompts (default 16).")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="With --batch-size: rounds of the three methods, each round in the reverse order of the one before (the machine's speed drifts).")] = 2,
) -> None:
    """Run greedy generate, prompt lookup, our plain loop and lookahead side by side on a workload."""
    if ctx.invoked_subcommand is not None:
        _refuse_given(ctx, list(ctx.params), f"is an option of `lookahead bench` itself, which `bench "
                      f"{ctx.invoked_subcommand}` does not read: give the subcommand's options after its name")
        return
    from .bench.batch import batch_runs, batch_table
    from .bench.report import (
        divergence_table, drafts_line, profile_line, summary_table, write_batch, write_benchmark,
    )
    from .bench.runner import environment, run_benchmark, standard_methods, summarize
    from .prompts import encode_prompt, has_chat_template

    configs = [_parse_config(c) for c in config] if config else None
    compile = _compile_mode(compile, cpp_wrapper)
    if batch_size is not None:
        sizes = _int_list(batch_size, "--batch-size")
        if not sizes or min(sizes) < 1:
            raise typer.BadParameter(f"expected batch sizes >= 1, got {batch_size!r}", param_hint="--batch-size")
        _refuse_given(ctx, ["sample", "temperature", "top_k", "top_p", "seed", "turns", "baselines", "profile"],
                      "not used with --batch-size (the batch benchmark decodes the first user turn greedily, "
                      "against transformers' batched generate and our plain engine)")
        if configs is not None and len(configs) > 1:
            raise typer.BadParameter("--batch-size runs one lookahead config: give --config once", param_hint="--config")
        prompts = _workload(dataset, 1, raw, category, limit or 16)
        if max(sizes) > len(prompts):  # its runs would decode fewer sequences together than their label says
            raise typer.BadParameter(f"batch size {max(sizes)} needs as many prompts; the workload gives "
                                     f"{len(prompts)} (--limit, --dataset, --category)", param_hint="--batch-size")
        lm, tokenizer = _load_model(model, gguf_file, dtype, threads)
        inputs = [encode_prompt(tokenizer, p.turns[0], raw=p.raw)[0] for p in prompts]
        _check_prompts(lm, inputs, max_new_tokens)
        with _progress() as progress:
            task = progress.add_task("batch sizes", total=len(sizes) * 3, last="")
            try:
                runs = batch_runs(lm, inputs, sizes, max_new_tokens, configs[0] if configs else AUTO_CONFIG,
                                  on_run=lambda r: progress.update(task, advance=1, last=f"B={r.batch_size} {r.method} "
                                                                   f"{r.tokens_per_second:.1f} tok/s"), compile=compile,
                                  rounds=rounds)
            except MemoryError as error:  # an engine of that many slots
                raise typer.BadParameter(str(error), param_hint="--batch-size") from error
        env = {**environment(lm), "compiled engines": compile}
        print(batch_table(runs))
        print("\n" + ", ".join(f"{k}: {v}" for k, v in env.items()))
        if out is not None:
            for path in write_batch(out, runs, env, "lookahead bench " + shlex.join(sys.argv[2:])):
                print(f"wrote {path}")
        return
    _refuse_given(ctx, ["rounds"], "only applies with --batch-size (the workload benchmark rotates the order of "
                  "its methods per prompt)")
    names = [b.strip() for b in baselines.split(",") if b.strip()]
    unknown = set(names) - {"greedy", "pld", "plain"}
    if unknown:
        raise typer.BadParameter(f"unknown {sorted(unknown)}; allowed: greedy, pld, plain", param_hint="--baselines")
    prompts = _workload(dataset, turns, raw, category, limit)
    if not sample:
        _refuse_given(ctx, ["temperature", "top_k", "top_p", "seed"], "applies only with --sample")
    sampling = None
    if sample:
        if temperature <= 0:
            raise typer.BadParameter(f"must be > 0 with --sample, got {temperature!r}", param_hint="--temperature")
        sampling = _sampling_options(temperature, top_k, top_p)
        del sampling["do_sample"]
        sampling["seed"] = seed
    if turns > 1 and raw:  # a second turn continues the conversation through the chat template
        raise typer.BadParameter("a second turn needs the chat template: leave out --raw", param_hint="--turns")
    if configs is None:  # the automatic config, and the paper's fixed W5 N4 G5 beside it
        configs = [AUTO_CONFIG, LookaheadConfig()]
    try:
        methods = standard_methods(configs, names, sampling=sample, compile=compile)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--config, --baselines") from error
    lm, tokenizer = _load_model(model, gguf_file, dtype, threads)
    if turns > 1 and not has_chat_template(tokenizer):
        raise typer.BadParameter("a second turn needs the model's chat template, which this tokenizer lacks",
                                 param_hint="--turns")
    _check_prompts(lm, [encode_prompt(tokenizer, p.turns[0], raw=p.raw) for p in prompts], max_new_tokens)
    total = len(methods) * sum(len(p.turns) for p in prompts)
    with _progress() as progress:
        task = progress.add_task(f"{dataset}", total=total, last="")
        try:
            runs = run_benchmark(
                lm, tokenizer, prompts, methods, max_new_tokens,
                on_run=lambda r: progress.update(task, advance=1, last=f"{r.method} {r.tokens_per_step:.2f} tok/step"),
                sampling=sampling,
            )
        except ValueError as error:  # what only a run finds: a later turn past the context, a sample of inf scores
            _fail(str(error))
    baseline = "sample" if sample else "greedy"
    rows = summarize(runs, baseline=baseline)
    env = environment(lm)
    if sampling is not None:
        env["sampling"] = ", ".join(f"{k}={v}" for k, v in sampling.items())
    print(summary_table(rows, baseline))
    print("\n" + divergence_table(runs))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in env.items()))
    for method in (m for m in methods if m.kind == "lookahead"):
        print(drafts_line(method.name, [r for r in runs if r.method == method.name]))
    if profile:
        for row in (r for r in rows if r.category == "all" and r.overhead_fraction is not None):
            print(profile_line(row, [r for r in runs if r.method == row.method]))
    if out is not None:
        for path in write_benchmark(out, runs, rows, env, "lookahead bench " + shlex.join(sys.argv[2:]), baseline):
            print(f"wrote {path}")


@bench_app.command("sweep")
def sweep_command(
    dataset: Annotated[str, typer.Option(help=f"One of {', '.join(BUILTIN)}, or a JSONL file (first turns).")] = "mt_bench",
    limit: Annotated[int, typer.Option(min=1, help="Most prompts, taken evenly from the categories.")] = 8,
    windows: Annotated[str, typer.Option(help="Comma list of W.")] = "1,3,5,8",
    ngrams: Annotated[str, typer.Option(help="Comma list of N.")] = "3,4,5",
    guesses: Annotated[str, typer.Option(help="Comma list of G.")] = "2,5",
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    threads: ThreadsOption = None,
    out: Annotated[Optional[Path], typer.Option("--out", callback=_out_folder, help="Folder for sweep.json and sweep.png.")] = None,
) -> None:
    """Grid over (W, N, G): tokens/step against tokens fed per step, with a fitted log line."""
    from .bench.sweep import sweep
    from .bench.report import fit_log_line, write_sweep
    from .bench.runner import environment
    from .prompts import encode_prompt

    grid = [_int_list(windows, "--windows"), _int_list(ngrams, "--ngrams"), _int_list(guesses, "--guesses")]
    for values, hint in zip(grid, ("--windows", "--ngrams", "--guesses")):
        if not values:
            raise typer.BadParameter("expected at least one value", param_hint=hint)
    for w, n, g in product(*grid):  # every point valid before the model loads
        try:
            LookaheadConfig(window=w, ngram=n, guesses=g)
        except ValueError as error:
            raise _config_refusal(error, {name: f"--{name}s" for name in ("window", "ngram", "guesses")}) from error
    prompts = _workload(dataset, 1, False, None, limit)
    lm, tokenizer = _load_model(model, gguf_file, dtype, threads)
    inputs = [encode_prompt(tokenizer, p.turns[0], raw=p.raw) for p in prompts]
    _check_prompts(lm, inputs, max_new_tokens)
    points = sweep(lm, inputs, *grid, max_new_tokens)
    print("| W | N | G | tokens fed/step | tokens/step | seconds |\n|---|---|---|---|---|---|")
    for p in points:
        print(f"| {p.window} | {p.ngram} | {p.guesses} | {p.tokens_fed_per_step:.1f} | {p.tokens_per_step:.2f} | {p.seconds:.1f} |")
    fit = fit_log_line(points)
    if fit is not None:
        print(f"fit: tokens/step = {fit[0]:.3f} + {fit[1]:.3f} * ln(tokens fed per step)")
    else:
        print("fit: none (the points feed the same number of tokens a step)")
    if out is not None:
        for path in write_sweep(out, points, environment(lm)):
            print(f"wrote {path}")


@bench_app.command("cost")
def cost_command(
    context: Annotated[int, typer.Option(min=1, help="Cached tokens before the step.")] = 256,
    max_k: Annotated[int, typer.Option(min=1, help="Largest k (powers of two up to it).")] = 128,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds, each timing every k in turn (the fastest round of each k is kept).")] = 5,
    packed_linear: Annotated[Optional[bool], typer.Option(help="Prepacked linears (CPU: MKL or oneDNN) or not; default: the path generate takes on this machine (measured).")] = None,
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    threads: ThreadsOption = None,
    out: Annotated[Optional[Path], typer.Option("--out", callback=_out_folder, help="Folder for cost.json and cost.png.")] = None,
    compile: Annotated[bool, typer.Option("--compile", help="Also compiled steps (padded to the compiled heights), timed in the same rounds as the eager ones.")] = False,
    cpp_wrapper: CppWrapperOption = False,
) -> None:
    """The model's forward cost T(k) for k new tokens per step over a cached context."""
    from .bench.report import write_cost
    from .bench.runner import environment
    from .costs import cost_curve, eager_and_compiled_cost, forward_cost
    from .hf import HFModelRunner, context_length

    lm, _ = _load_model(model, gguf_file, dtype, threads)
    room = context_length(lm)
    if room is not None and context + max_k > room:
        raise typer.BadParameter(f"--context ({context}) + --max-k ({max_k}) exceeds the model's context of {room} "
                                 "positions", param_hint="--max-k")
    sizes = tuple(sorted({1, *(2**i for i in range(max_k.bit_length()) if 2**i <= max_k), max_k}))
    try:
        runner = HFModelRunner(lm, packed_linear=packed_linear, compile=_compile_mode(compile, cpp_wrapper))
    except ValueError as error:  # packed linears for a model that has none to pack
        raise typer.BadParameter(str(error), param_hint="--packed-linear") from error
    if runner.packing is None:
        cost_curve(runner)  # settles which linear path generate takes here
    if runner.compile:
        curves = eager_and_compiled_cost(runner, context=context, sizes=sizes, repeats=repeats)
    else:
        curves = {"eager": forward_cost(runner, context=context, sizes=sizes, repeats=repeats)}
    names = list(curves)
    print("| k | " + " | ".join(f"{name}: ms | T(k)/T(1)" for name in names) + " |" +
          (" compiled / eager |" if runner.compile else "") + "\n|---|" + "---|---|" * len(names) +
          ("---|" if runner.compile else ""))
    for k, points in zip(sizes, zip(*curves.values())):
        ratio = f" {points[1].seconds / points[0].seconds:.2f} |" if runner.compile else ""
        print(f"| {k} | " + " | ".join(f"{1000 * p.seconds:.1f} | {p.relative:.2f}" for p in points) + " |" + ratio)
    if out is not None:
        for path in write_cost(out, curves, environment(lm)):
            print(f"wrote {path}")


@bench_app.command("corpus")
def corpus_command(
    limit: Annotated[int, typer.Option(min=1, help="Spec-Bench summarization articles.")] = 5,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    chars: Annotated[int, typer.Option(min=100, help="Characters of each article kept.")] = 1500,
    pair: Annotated[str, typer.Option(help=f"The two requests: {' or '.join(CORPUS_PAIRS)} (the same request twice).")] = "summaries",
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    threads: ThreadsOption = None,
) -> None:
    """Two requests over each article (differently worded, or the same twice): the second with and without
    a corpus shared with the first (tokens/step; greedy outputs must not change)."""
    from .bench.corpus import corpus_runs, corpus_table

    if pair not in CORPUS_PAIRS:
        raise typer.BadParameter(f"one of {', '.join(CORPUS_PAIRS)}, got {pair!r}", param_hint="--pair")
    articles = [p for p in load_workload("spec_bench") if p.category == "summarization"][:limit]
    lm, tokenizer = _load_model(model, gguf_file, dtype, threads)
    documents = {p.id: p.turns[0].removeprefix("Summarize: ")[:chars] for p in articles}
    try:
        runs = corpus_runs(lm, tokenizer, documents, max_new_tokens, pair)
    except ValueError as error:  # a request past the context: at the first article's
        _fail(str(error))
    print(corpus_table(runs))


@bench_app.command("serve")
def bench_serve_command(
    ctx: typer.Context,
    clients: Annotated[int, typer.Option(min=1, help="Concurrent streaming clients.")] = 16,
    requests: Annotated[Optional[int], typer.Option(min=1, help="Requests per mode in each round (default: 2 per client); the report counts every round's.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    dataset: Annotated[str, typer.Option(help=f"Prompts: one of {', '.join(BUILTIN)} or a JSONL file (first turns).")] = "mt_bench",
    time_limit: Annotated[float, typer.Option(min=1, help="Seconds per mode after which no new request starts.")] = 600,
    url: Annotated[Optional[str], typer.Option(help="A running `lookahead serve` to load (default: start one here on --model).")] = None,
    served_model: Annotated[Optional[str], typer.Option(help="With --url: the model name it serves (default: asked from /v1/models).")] = None,
    api_key: Annotated[Optional[str], typer.Option(help="With --url: a key it accepts.")] = None,
    max_batch: Annotated[Optional[int], typer.Option(min=1, help="Without --url: the server's slots (default: --clients).")] = None,
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    threads: ThreadsOption = None,
    out: OutOption = None,
    compile: Annotated[bool, typer.Option("--compile", help="Without --url: the server compiles its decoding steps (as `serve --compile`).")] = False,
    cpp_wrapper: CppWrapperOption = False,
    rounds: Annotated[Optional[int], typer.Option(min=1, help="Rounds of the two modes, each in the reverse order of the one before (the machine's speed drifts); each round's modes get API keys of their own, so that no run drafts from another's replies. Default 2; with --url only 1 (one key).")] = None,
) -> None:
    """Load a server with concurrent streaming chat clients, lookahead on and off in turn: TTFT, inter-token
    latency, throughput, failures."""
    from .bench.report import write_serve
    from .bench.runner import environment
    from .bench.serve import load_table, serve_load
    from .models import DEFAULT_MODEL_NAME
    from .prompts import has_chat_template
    from .serve import create_app, serve_in_thread

    if url is not None:
        address = urlsplit(url)
        if address.scheme not in ("http", "https") or not address.netloc:
            raise typer.BadParameter(f"expected the server's address, http://HOST:PORT, got {url!r}", param_hint="--url")
        _refuse_given(ctx, ["model", "gguf_file", "dtype", "threads", "max_batch", "compile", "cpp_wrapper"],
                      "sets up the server started here; with --url the running server decides: start it so, e.g. "
                      "`lookahead serve --compile`")
        if rounds is not None and rounds > 1:
            raise typer.BadParameter("with --url only 1: every round would send the same key, and the server's "
                                     "corpus for it would hold the earlier rounds' replies to the same prompts",
                                     param_hint="--rounds")
    else:
        _refuse_given(ctx, ["served_model", "api_key"], "only applies with --url (the server started here "
                      "serves --model, without a key)")
    wanted = requests or 2 * clients
    prompts = [p.turns[0] for p in _workload(dataset, 1, False, None, wanted)]
    if len(prompts) < wanted:  # repeating prompts would let the shared corpus draft replies it has seen
        raise typer.BadParameter(f"{dataset} has {len(prompts)} prompts, fewer than the {wanted} requests asked "
                                 "for per mode: lower --requests (or --clients), or give a larger --dataset",
                                 param_hint="--requests")
    compile = _compile_mode(compile, cpp_wrapper)

    rounds = rounds or (1 if url is not None else 2)

    def measure(base: str, name: str, keys: tuple[str | None, ...]) -> list:
        with _progress() as progress:
            task = progress.add_task("modes", total=2 * rounds, last="")
            return serve_load(base, name, prompts, clients, max_new_tokens, keys, time_limit, rounds,
                              on_run=lambda r: progress.update(task, advance=1, last=f"{r.mode}: "
                                                               f"{r.tokens_per_second:.1f} tok/s"))

    if url is not None:
        base = url.rstrip("/")
        name = served_model or _served_model(base, api_key)
        runs = measure(base, name, (api_key,))
        env = {"server": base, "model": name, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    else:
        lm, tokenizer = _load_model(model, gguf_file, dtype, threads)
        if not has_chat_template(tokenizer):  # the clients send chat requests, which the server would refuse
            raise typer.BadParameter("the benchmark's clients chat, and this model's tokenizer has no chat template",
                                     param_hint="--model")
        name = model or DEFAULT_MODEL_NAME
        keys = tuple(f"bench-{run}" for run in range(2 * rounds))  # a corpus per run
        try:
            server_app = create_app(lm, tokenizer, model_name=name, max_batch=max_batch or clients,
                                    max_queue=max(requests or 2 * clients, clients), compile=compile, api_keys=keys)
        except (ValueError, MemoryError) as error:
            _fail(str(error))
        with serve_in_thread(server_app) as base:
            runs = measure(base, name, keys)
        env = {**environment(lm), "max_batch": max_batch or clients, "compiled": compile}
    env.update(clients=clients, max_new_tokens=max_new_tokens, dataset=dataset, rounds=rounds)
    print(load_table(runs))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in env.items()))
    if out is not None:
        for path in write_serve(out, runs, env, "lookahead bench serve " + shlex.join(sys.argv[3:])):
            print(f"wrote {path}")
    failures = [f"{run.mode}: {run.failed} of {run.requests} requests failed ({'; '.join(run.errors)})"
                for run in runs if run.failed]
    if failures:  # the figures above leave those requests out: no comparison to trust
        _fail("; ".join(failures))


def _served_model(url: str, api_key: str | None) -> str:
    import urllib.error
    import urllib.request

    models = f"{url}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(models, headers=headers), timeout=30) as reply:
            body = reply.read()
    except urllib.error.HTTPError as error:
        hint = " (give a key it accepts: --api-key)" if error.code == 401 else ""
        raise typer.BadParameter(f"{models} answered HTTP {error.code} {error.reason}{hint}",
                                 param_hint="--url") from error
    except (OSError, ValueError) as error:  # unreachable, not a URL
        raise typer.BadParameter(f"cannot reach {models}: {getattr(error, 'reason', None) or error}",
                                 param_hint="--url") from error
    try:
        return json.loads(body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise typer.BadParameter(f"{models} did not answer with a list of models (is it a `lookahead serve`?): "
                                 f"{body[:200]!r}", param_hint="--url") from error


@bench_app.command("parallel")
def bench_parallel_command(
    workers: Annotated[str, typer.Option(help="Comma list of worker counts (1 first: the others are compared with it).")] = "1,2",
    threads: Annotated[int, typer.Option(min=1, help="torch threads per worker.")] = 1,
    window: Annotated[int, typer.Option(min=0)] = 15,
    ngram: Annotated[int, typer.Option(min=2)] = 5,
    guesses: Annotated[int, typer.Option(min=0)] = 15,
    dataset: Annotated[str, typer.Option(help=f"One of {', '.join(BUILTIN)}, or a JSONL file.")] = "humaneval",
    raw: Annotated[bool, typer.Option("--raw/--chat", help="No chat template (HumanEval: raw code completion).")] = True,
    limit: Annotated[int, typer.Option(min=1)] = 4,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    max_devices: Annotated[int, typer.Option(min=1, help="Predict the speedup for 1..this many devices.")] = 8,
    cost_file: Annotated[Optional[Path], typer.Option(help="cost.json of `lookahead bench cost --out` (e.g. measured on a GPU) for the prediction; default: T(k) measured here at --threads.")] = None,
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    out: OutOption = None,
) -> None:
    """1..K worker processes sharing each step (gloo, --threads each) at one fixed W,N,G: tokens/s, steps/s,
    identical outputs; and the speedup a cost model predicts for K devices from T(k)."""
    from .bench.parallel import curve_from_points, parallel_runs, parallel_table, predicted_speedups, prediction_table
    from .bench.report import write_parallel
    from .bench.runner import environment
    from .costs import CostCurve, forward_cost
    from .hf import HFModelRunner
    from .parallel import WorkerError
    from .prompts import encode_prompt

    counts = _int_list(workers, "--workers")
    if not counts or min(counts) < 1 or counts[0] != 1:
        raise typer.BadParameter(f"expected worker counts >= 1 starting with 1, got {workers!r}", param_hint="--workers")
    try:
        config = LookaheadConfig(window=window, ngram=ngram, guesses=guesses)
    except ValueError as error:
        raise _config_refusal(error, {name: f"--{name}" for name in ("window", "ngram", "guesses")}) from error
    given_curve = None
    if cost_file is not None:
        try:
            given_curve = curve_from_points(json.loads(cost_file.read_text())["points"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise typer.BadParameter(f"not a cost.json of `lookahead bench cost`: {error}",
                                     param_hint="--cost-file") from error
    prompts = _workload(dataset, 1, raw, None, limit)
    lm, tokenizer = _load_model(model, gguf_file, dtype, threads)
    inputs = [encode_prompt(tokenizer, p.turns[0], raw=p.raw)[0].tolist() for p in prompts]
    _check_prompts(lm, inputs, max_new_tokens)  # here, before any worker starts
    with _progress() as progress:
        task = progress.add_task("worker counts", total=len(counts), last="")
        try:
            runs = parallel_runs(model, gguf_file, dtype, inputs, counts, threads, max_new_tokens, config,
                                 on_run=lambda r: progress.update(task, advance=1, last=f"{r.workers} workers: "
                                                                  f"{r.tokens_per_second:.1f} tok/s"))
        except WorkerError as error:
            _fail(str(error))
    if given_curve is not None:
        curve, source = given_curve, str(cost_file)
    else:
        points = forward_cost(HFModelRunner(lm, packed_linear=False), context=256,
                              sizes=(1, 2, 4, 8, 16, 32, 64, 128, 192), repeats=3)
        curve = CostCurve([p.tokens for p in points], [p.seconds for p in points])
        source = f"measured here, {threads} thread(s)"
    predictions = predicted_speedups(curve, runs[0].rows_per_step, config, max_devices)
    env = {**environment(lm), "config": config.label, "dataset": dataset, "prompts": len(inputs), "cost curve": source}
    print(parallel_table(runs))
    print()
    print(prediction_table(predictions, runs))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in env.items()))
    if out is not None:
        for path in write_parallel(out, runs, predictions, env, "lookahead bench parallel " + shlex.join(sys.argv[3:])):
            print(f"wrote {path}")


@app.command("serve")
def serve_command(
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on; 0: any free one (the line on stderr says which).")] = 8000,
    max_batch: Annotated[int, typer.Option(min=1, help="Requests decoded together (KV slots).")] = 8,
    max_queue: Annotated[int, typer.Option(min=0, help="Requests that may wait for a slot; more get 429.")] = 64,
    max_length: Annotated[Optional[int], typer.Option(min=2, help="Most positions of a request (default: the model's context, at most 4096).")] = None,
    api_key: Annotated[Optional[list[str]], typer.Option("--api-key", help="Accepted key (Authorization: Bearer KEY); repeat for several. Default: none needed.")] = None,
    corpus_mb: Annotated[float, typer.Option(min=0, help="Memory cap (MB) of each API key's corpus: its earlier requests' text, which the suffix and recycle sources draft from. 0: no corpus.")] = 64,
    allow_origin: Annotated[Optional[list[str]], typer.Option("--allow-origin", help="A web origin whose pages may call the API from a browser (CORS), e.g. http://localhost:3000, or * for any; repeat for several. Default: none.")] = None,
    allow_host: Annotated[Optional[list[str]], typer.Option("--allow-host", help="A name requests may be addressed to (their Host header) beside the loopback names a server on 127.0.0.1 answers, e.g. the name a reverse proxy forwards; * for any; repeat for several. On another --host: the only names answered (default: any).")] = None,
    threads: ThreadsOption = None,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the decoding steps (their few shapes compile before the server starts serving).")] = False,
    cpp_wrapper: CppWrapperOption = False,
) -> None:
    """An OpenAI-compatible server (chat and text completions, streaming) on the lookahead engine."""
    import signal

    import uvicorn

    from .models import DEFAULT_MODEL_NAME
    from .serve import check_corpus_megabytes, create_app, hosts_to_allow

    _check_address(host, port)  # before the model loads (minutes with --compile)
    try:  # before the model loads (typer's min=0 refuses below 0)
        check_corpus_megabytes(corpus_mb, "--corpus-mb")
    except ValueError as error:
        _fail(str(error))
    lm, tokenizer = _load_model(model, gguf_file, dtype, threads)
    name = model or DEFAULT_MODEL_NAME
    try:
        server_app = create_app(lm, tokenizer, model_name=name, max_batch=max_batch, max_queue=max_queue,
                                max_length=max_length, api_keys=tuple(api_key or ()), corpus_megabytes=corpus_mb,
                                compile=_compile_mode(compile, cpp_wrapper), allow_origins=tuple(allow_origin or ()),
                                allowed_hosts=hosts_to_allow(host, allow_host or ()))
    except (ValueError, MemoryError) as error:
        _fail(str(error))

    class Server(uvicorn.Server):
        interrupted = False

        def handle_exit(self, sig: int, frame) -> None:
            self.interrupted |= sig == signal.SIGINT
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            # Ctrl-C or SIGTERM: replies in progress end now, with an error event (uvicorn alone waited for
            # each to reach its max_tokens); connections still open after SHUTDOWN_GRACE seconds are cut.
            print("stopping: replies in progress end now", file=sys.stderr, flush=True)
            server_app.state.engine_loop.stop()
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(server_app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=SHUTDOWN_GRACE))
    threading.Thread(target=_say_where, args=(server, name), daemon=True).start()
    server.run()
    if server.interrupted:  # uvicorn raises Ctrl-C's SIGINT again once stopped, but asyncio's runner, whose handler
        raise typer.Exit(130)  # that is, may end with the server's coroutine and return as if nothing had happened


SHUTDOWN_GRACE = 5  # seconds


def _check_address(host: str, port: int) -> None:
    """Exit 2 with one line where `serve` could not listen on host:port (a port in use, a host not of this
    machine)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as error:
        _fail(f"cannot listen on {host}:{port}: {error.strerror or error}")


def _say_where(server, model: str) -> None:
    """One line on stderr once the server listens: where (the port the system chose for --port 0)."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.1)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    address = f"[{host}]" if ":" in host else host
    print(f"serving {model} on http://{address}:{port} (the chat page at /, the API at /v1; Ctrl-C stops)",
          file=sys.stderr, flush=True)


def _progress() -> Progress:
    """A progress bar on stderr whose tasks carry `last`: the latest run's figures."""
    from rich.console import Console
    from rich.progress import Progress, TextColumn

    return Progress(*Progress.get_default_columns(), TextColumn("{task.fields[last]}"), console=Console(stderr=True))


def _compile_mode(compile: bool, cpp_wrapper: bool) -> bool | str:
    """`compile=` for --compile and --cpp-wrapper."""
    return "cpp-wrapper" if cpp_wrapper else compile


def _int_list(text: str, hint: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as error:
        raise typer.BadParameter(f"expected a comma list of integers, got {text!r}", param_hint=hint) from error


def main() -> None:
    app()

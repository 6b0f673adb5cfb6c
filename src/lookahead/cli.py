"""The `lookahead` command line."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import torch
import typer
from transformers import TextStreamer
from transformers.utils import logging as hf_logging

from .baseline import greedy_generate
from .config import LookaheadConfig
from .generation import DEFAULT_CONFIG, generate
from .models import DTYPES, load_model
from .prompts import encode_prompt

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Lookahead decoding for Hugging Face causal LMs.")

ModelOption = Annotated[
    Optional[str], typer.Option("--model", help="Local folder, hub id or .gguf path; default: SmolLM2-135M-Instruct.")
]
GgufOption = Annotated[Optional[str], typer.Option("--gguf-file", help="GGUF file name inside --model's folder.")]
DtypeOption = Annotated[str, typer.Option("--dtype", help=f"One of {', '.join(DTYPES)}.")]


def _config(window: int, ngram: int, guesses: int) -> LookaheadConfig:
    try:
        return LookaheadConfig(window=window, ngram=ngram, guesses=guesses)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error


@app.command("generate")
def generate_command(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    model: ModelOption = None,
    gguf_file: GgufOption = None,
    dtype: DtypeOption = "float32",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate.")] = 128,
    window: Annotated[int, typer.Option(help="W: lookahead window columns (0: off).")] = DEFAULT_CONFIG.window,
    ngram: Annotated[int, typer.Option(help="N: n-gram size (>= 2).")] = DEFAULT_CONFIG.ngram,
    guesses: Annotated[int, typer.Option(help="G: n-grams verified per step (0: off).")] = DEFAULT_CONFIG.guesses,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    compare: Annotated[bool, typer.Option("--compare", help="Also run plain greedy model.generate and compare.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")] = False,
) -> None:
    """Generate text with lookahead decoding, streaming it to the terminal."""
    config = _config(window, ngram, guesses)
    hf_logging.disable_progress_bar()
    if dtype not in DTYPES:
        raise typer.BadParameter(f"must be one of {sorted(DTYPES)}, got {dtype!r}", param_hint="--dtype")
    if not prompt:
        raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
    lm, tokenizer = load_model(model, gguf_file=gguf_file, dtype=dtype)
    input_ids = encode_prompt(tokenizer, prompt, raw=raw)
    if compare:  # warm both paths up so that neither pays one-off costs in the timed run
        generate(lm, input_ids, max_new_tokens=2, config=config)
        greedy_generate(lm, input_ids, max_new_tokens=2)
    streamer = None if as_json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = generate(lm, input_ids, max_new_tokens=max_new_tokens, config=config, streamer=streamer)
    new_ids = out.sequences[0, input_ids.shape[1] :]
    stats = out.stats
    report: dict[str, object] = {"text": tokenizer.decode(new_ids, skip_special_tokens=True), **stats.as_dict()}
    if compare:
        baseline, baseline_seconds = greedy_generate(lm, input_ids, max_new_tokens=max_new_tokens)
        report.update(
            baseline_seconds=baseline_seconds,
            speedup=baseline_seconds / stats.seconds,
            identical=torch.equal(baseline.cpu(), out.sequences),
        )
    if as_json:
        print(json.dumps(report))
        return
    summary = (
        f"[{stats.new_tokens} new tokens, {stats.steps} steps, {stats.tokens_per_step:.2f} tokens/step, "
        f"{stats.tokens_per_second:.1f} tokens/s"
    )
    if compare:
        summary += (
            f"; greedy generate {report['baseline_seconds']:.2f}s vs lookahead {stats.seconds:.2f}s, "
            f"speedup {report['speedup']:.2f}x, identical: {report['identical']}"
        )
    print(summary + "]")


@app.callback()
def _root() -> None:
    """Lookahead decoding for Hugging Face causal LMs."""


def main() -> None:
    app()

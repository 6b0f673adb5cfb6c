"""Model loading: the content-keyed cache of dequantised GGUF files, and one-line ModelLoadError messages.

The cache tests use a tiny GGUF file written here with gguf's GGUFWriter (a 1-layer llama, a byte-level BPE
tokenizer; ~30 kB), so that a dequantisation takes well under a second and the real 98 MB model is never
dequantised by this file.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from huggingface_hub import constants as hub_constants
from transformers import PreTrainedTokenizerBase
from typer.testing import CliRunner

from lookahead import ModelLoadError, load_model
from lookahead import machine, models
from lookahead.cli import app

TINY = "tiny.gguf"


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what a byte-level BPE vocabulary holds)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 1-layer llama GGUF file (float32 tensors) with a byte-level BPE tokenizer, that transformers loads."""
    hidden, heads, kv_heads, ff = 16, 2, 1, 32
    tokens = ["<|endoftext|>", *_byte_symbols(), "Ġt", "he"]
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    kv_size = kv_heads * hidden // heads
    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.attn_q.weight", weight(hidden, hidden))
    writer.add_tensor("blk.0.attn_k.weight", weight(kv_size, hidden))
    writer.add_tensor("blk.0.attn_v.weight", weight(kv_size, hidden))
    writer.add_tensor("blk.0.attn_output.weight", weight(hidden, hidden))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", weight(ff, hidden))
    writer.add_tensor("blk.0.ffn_up.weight", weight(ff, hidden))
    writer.add_tensor("blk.0.ffn_down.weight", weight(hidden, ff))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory) -> dict[int, bytes]:
    """The bytes of the tiny GGUF file for seeds 0 and 1 (two contents of the same shape)."""
    folder = tmp_path_factory.mktemp("gguf")
    return {seed: write_tiny_gguf(folder / f"{seed}.gguf", seed).read_bytes() for seed in (0, 1)}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(root))
    return root


@pytest.fixture
def gguf_path(tmp_path, tiny_gguf_bytes) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    path = folder / TINY
    path.write_bytes(tiny_gguf_bytes[0])
    return path


@pytest.fixture
def dequantisations(monkeypatch) -> list[Path]:
    """The destinations of every dequantisation (GGUF read + save) made during the test."""
    calls: list[Path] = []
    real = models._dequantise

    def counted(folder, gguf_file, destination):
        calls.append(destination)
        return real(folder, gguf_file, destination)

    monkeypatch.setattr(models, "_dequantise", counted)
    return calls


def _entries(cache: Path) -> list[str]:
    """The cache's entries, less the lock files."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def _copy_name(model) -> str:
    return Path(model.config._name_or_path).name


def _embeddings(model) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach().clone()


# ---------------------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------------------


def test_cache_folder_is_named_by_content_dtype_and_format_version(cache, gguf_path, tiny_gguf_bytes, monkeypatch):
    model, tokenizer = load_model(gguf_path)
    digest = models.file_hash(gguf_path)
    assert digest == hashlib.blake2b(tiny_gguf_bytes[0], digest_size=32).hexdigest()
    expected = f"tiny-{digest[:16]}-float32-v{models.CACHE_FORMAT_VERSION}"
    assert _entries(cache) == [expected]
    assert _copy_name(model) == expected  # loaded from the cached copy
    assert (cache / expected / "model.safetensors").is_file()
    assert tokenizer("the hi").input_ids  # the tokenizer was saved with it
    assert not model.training

    same_size_other_content = gguf_path.with_name("other.gguf")
    same_size_other_content.write_bytes(tiny_gguf_bytes[1])
    assert len(tiny_gguf_bytes[0]) == len(tiny_gguf_bytes[1])
    assert models.cache_folder(same_size_other_content).name.split("-")[1] != digest[:16]
    monkeypatch.setattr(models, "CACHE_FORMAT_VERSION", models.CACHE_FORMAT_VERSION + 1)
    assert models.cache_folder(gguf_path).name == f"tiny-{digest[:16]}-float32-v{models.CACHE_FORMAT_VERSION}"


def test_the_cache_root_is_absolute_and_an_empty_setting_means_the_default(monkeypatch, tmp_path):
    """LOOKAHEAD_CACHE="" (an unset variable passed on) means ~/.cache/lookahead, not the working folder; a
    relative setting names a folder below the working folder, as an absolute path."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", "")
    assert machine.cache_root() == (Path.home() / ".cache" / "lookahead").resolve()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOKAHEAD_CACHE", "relative")
    assert machine.cache_root() == tmp_path.resolve() / "relative"


def test_touching_or_reinstalling_the_file_reuses_the_copy(cache, gguf_path, tmp_path, dequantisations):
    first, _ = load_model(gguf_path)
    folder = Path(first.config._name_or_path)
    inode, mtime = folder.stat().st_ino, folder.stat().st_mtime_ns
    assert len(dequantisations) == 1

    os.utime(gguf_path, (time.time() + 3600, time.time() + 3600))  # touched: new mtime, same content
    second, _ = load_model(gguf_path)
    # "reinstalled": the same content as a new file elsewhere (new inode, new mtime), loaded by folder
    reinstalled = tmp_path / "site-packages" / TINY
    reinstalled.parent.mkdir()
    shutil.copyfile(gguf_path, reinstalled)
    third, _ = load_model(reinstalled.parent, gguf_file=TINY)

    assert len(dequantisations) == 1
    assert _copy_name(second) == _copy_name(third) == folder.name
    assert (folder.stat().st_ino, folder.stat().st_mtime_ns) == (inode, mtime)
    assert _entries(cache) == [folder.name]
    assert torch.equal(_embeddings(first), _embeddings(third))


def test_new_content_gets_a_new_copy_and_older_copies_of_the_stem_are_removed(
    cache, gguf_path, tiny_gguf_bytes, dequantisations
):
    old, _ = load_model(gguf_path)
    cache.joinpath("tiny-98362432-1796084455").mkdir()  # the naming before content keys
    cache.joinpath("tiny-0123456789abcdef-bfloat16-v0").mkdir()  # another dtype / format version
    unrelated = ["tiny-extra-0123456789abcdef-float32-v1", "tiny-extra-1-2", "tinyx-1-2", "notes", "tiny.txt"]
    for name in unrelated:
        cache.joinpath(name).mkdir()

    gguf_path.write_bytes(tiny_gguf_bytes[1])  # an upgrade: same file name, new content
    new, _ = load_model(gguf_path)

    assert len(dequantisations) == 2
    assert _copy_name(new) != _copy_name(old)
    assert not torch.equal(_embeddings(new), _embeddings(old))
    assert _entries(cache) == sorted([_copy_name(new), *unrelated])


def test_two_files_of_the_same_name_keep_a_copy_each(cache, tmp_path, tiny_gguf_bytes, dequantisations):
    """`model.gguf` in two folders (a common name on the hub): each has its own copy, and loading one does not
    remove the other's (each load had dequantised again)."""
    paths = []
    for seed in (0, 1):
        folder = tmp_path / f"models-{seed}"
        folder.mkdir()
        paths.append(folder / TINY)
        paths[-1].write_bytes(tiny_gguf_bytes[seed])
    names = [_copy_name(load_model(path)[0]) for path in paths + paths]
    assert len(dequantisations) == 2 and names[:2] == names[2:] and names[0] != names[1]
    assert _entries(cache) == sorted(names[:2])


def test_a_leftover_partial_copy_is_never_loaded_and_is_removed(cache, gguf_path, dequantisations):
    target = models.cache_folder(gguf_path)
    cache.mkdir()
    leftovers = [
        f".{target.name}.partial-4242-0badc0de",  # this code's naming: a writer killed mid-write
        "tiny-98362432-1796084455.partial-4242",  # the older code's naming
    ]
    for name in leftovers:
        cache.joinpath(name).mkdir()
        cache.joinpath(name, "config.json").write_text("{ half written")  # loading it would fail

    model, _ = load_model(gguf_path)

    assert len(dequantisations) == 1
    assert _copy_name(model) == target.name
    assert _entries(cache) == [target.name]


def test_an_interrupted_write_leaves_no_folder_that_a_later_run_loads(cache, gguf_path, monkeypatch, dequantisations):
    def disk_full(self, *args, **kwargs):  # the model is saved, then the tokenizer's save fails
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
        with pytest.raises(ModelLoadError, match=r"could not write the dequantised copy of .*tiny\.gguf to .*") as info:
            load_model(gguf_path)
    assert "No space left on device" in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert _entries(cache) == []  # neither a final folder nor the partial one

    model, tokenizer = load_model(gguf_path)
    assert len(dequantisations) == 2
    assert _entries(cache) == [_copy_name(model)]
    assert (cache / _copy_name(model) / "tokenizer.json").is_file()


def test_two_concurrent_first_runs_dequantise_once(cache, gguf_path, monkeypatch, dequantisations):
    real = models._dequantise

    def slow(folder, gguf_file, destination):  # widen the window in which the other run would start its own
        time.sleep(0.5)
        return real(folder, gguf_file, destination)

    monkeypatch.setattr(models, "_dequantise", slow)
    start = threading.Barrier(2)
    results, errors = [], []

    def first_run():
        start.wait()
        try:
            results.append(load_model(gguf_path)[0])
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=first_run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(results) == 2
    assert len(dequantisations) == 1
    assert _copy_name(results[0]) == _copy_name(results[1])
    assert torch.equal(_embeddings(results[0]), _embeddings(results[1]))
    assert _entries(cache) == [_copy_name(results[0])]


def test_cache_deleted_while_a_run_writes_then_that_run_finishes(cache, gguf_path, monkeypatch, dequantisations):
    """A run midway through its write sees the cache folder (and the lock file) deleted and a second run
    write the copy meanwhile: its rename into place then fails, and it keeps the second run's copy."""
    real_save = PreTrainedTokenizerBase.save_pretrained
    other: list = []
    replaced = threading.Event()

    def save_after_the_cache_is_replaced(self, *args, **kwargs):
        if not replaced.is_set():  # the first run's save only
            replaced.set()
            shutil.rmtree(cache)
            second = threading.Thread(target=lambda: other.append(load_model(gguf_path)[0]))
            second.start()  # a fresh lock file: it does not wait for us
            second.join(60)
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", save_after_the_cache_is_replaced)
    model, _ = load_model(gguf_path)

    assert len(other) == 1 and len(dequantisations) == 2
    assert _copy_name(model) == _copy_name(other[0])
    assert _entries(cache) == [_copy_name(model)]


KILLED_WRITER = """
import sys, time
from pathlib import Path
from transformers import PreTrainedTokenizerBase
from lookahead import load_model

def hang(self, *args, **kwargs):  # the model is saved: say so, and wait to be killed
    Path(sys.argv[2]).write_text("saving")
    time.sleep(120)

PreTrainedTokenizerBase.save_pretrained = hang
load_model(sys.argv[1])
"""


def test_a_run_killed_mid_dequantisation_then_cache_deleted_then_a_new_run_works(cache, gguf_path, tmp_path):
    marker = tmp_path / "marker"
    env = {**os.environ, "LOOKAHEAD_CACHE": str(cache)}
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(gguf_path), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and writer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the writer did not reach its save"
        partials = [p for p in cache.iterdir() if ".partial-" in p.name]
        assert len(partials) == 1 and (partials[0] / "model.safetensors").is_file()
        assert not models.cache_folder(gguf_path).exists()
    finally:
        writer.kill()
        writer.wait()
    shutil.rmtree(cache)

    model, _ = load_model(gguf_path)
    assert _copy_name(model) == models.cache_folder(gguf_path).name
    assert _entries(cache) == [_copy_name(model)]


# ---------------------------------------------------------------------------------------------------------------
# One clear line for every model-loading failure
# ---------------------------------------------------------------------------------------------------------------


def _corrupt(kind: str, folder: Path, tiny_gguf_bytes) -> Path:
    path = folder / "x.gguf"
    if kind == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    else:  # a truncated copy, as an interrupted download leaves
        path.write_bytes(tiny_gguf_bytes[0][: len(tiny_gguf_bytes[0]) * 2 // 3])
    return path


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 (as huggingface_hub reads it at import), with an empty hub cache."""
    hub_cache = tmp_path / "hub"
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


ERROR_CASES = ["missing path", "missing gguf in folder", "missing gguf path", "random bytes", "truncated", "hub offline"]


@pytest.fixture
def error_case(request, tmp_path, cache, tiny_gguf_bytes, offline_hub):
    """(load_model arguments, CLI arguments, a regex the message must match) for each failure."""
    folder = tmp_path / "models"
    folder.mkdir()
    kind = request.param
    if kind == "missing path":
        return ["/nonexistent"], None, r"^model path not found: /nonexistent$"
    if kind == "missing gguf in folder":
        (folder / "present.gguf").write_bytes(b"")
        return [str(folder)], "absent.gguf", rf"^GGUF file not found: {re.escape(str(folder / 'absent.gguf'))} .*present\.gguf"
    if kind == "missing gguf path":
        return [str(folder / "absent.gguf")], None, rf"^GGUF file not found: {re.escape(str(folder / 'absent.gguf'))}$"
    if kind in ("random bytes", "truncated"):
        path = _corrupt(kind, folder, tiny_gguf_bytes)
        return [str(path)], None, rf"^could not read GGUF file {re.escape(str(path))}: \w+"
    assert kind == "hub offline"
    return ["nobody/no-such-model"], None, rf"'nobody/no-such-model'.* hub cache {re.escape(str(offline_hub))} .*offline"


@pytest.mark.parametrize("error_case", ERROR_CASES, indirect=True)
def test_load_model_raises_one_line_model_load_error(error_case, cache):
    args, gguf_file, pattern = error_case
    with pytest.raises(ModelLoadError, match=pattern) as info:
        load_model(*args, gguf_file=gguf_file)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)
    if "not found" not in str(info.value):  # a wrapped failure keeps the original as its cause
        assert info.value.__cause__ is not None
    assert not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()]  # nothing half-made is left


@pytest.mark.parametrize("error_case", ERROR_CASES, indirect=True)
def test_cli_prints_one_error_line_and_exits_2(error_case):
    args, gguf_file, pattern = error_case
    argv = ["generate", "hi", "--model", args[0], *(["--gguf-file", gguf_file] if gguf_file else [])]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("Error: ")
    assert re.search(pattern, lines[0][len("Error: "):])


def test_lookahead_command_reports_a_missing_model_path_in_one_line():
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lookahead")), "generate", "hi", "--model", "/nonexistent"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["Error: model path not found: /nonexistent"]


def test_a_load_error_is_said_on_one_line_whole_not_cut_at_its_first():
    """transformers' message for a folder without tokenizer files breaks its sentence across lines: the first
    line alone ended at "from one of:"."""
    from lookahead.models import _one_line

    error = ValueError("Couldn't instantiate the backend tokenizer from one of:\n(1) a `tokenizers` file,\n\n(2) a slow one.")
    assert _one_line(error) == ("ValueError: Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` "
                                "file, (2) a slow one.")
    assert _one_line(ValueError("x" * 1000)) == "ValueError: " + "x" * 399 + "…"
    assert _one_line(OSError()) == "OSError"


def test_a_tensor_parallel_load_of_a_gguf_file_holds_no_lock_the_other_processes_wait_on(cache, gguf_path, monkeypatch):
    """Every process of a torchrun launch loads the file; the load itself waits for all of them (transformers makes
    the process group), so it must not hold the copy's lock, which the others take first (they hung for good).
    A plain load holds it, so that a concurrent run cannot remove the copy under it."""
    from filelock import FileLock, Timeout

    held = {}

    def loaded(source, torch_dtype, where, tp_plan=None):
        try:
            FileLock(Path(source).parent / f".{gguf_path.stem}.lock").acquire(timeout=0).lock.release()
            held[tp_plan] = False
        except Timeout:
            held[tp_plan] = True
        return "model", "tokenizer"

    monkeypatch.setattr(models, "_from_pretrained", loaded)
    assert load_model(gguf_path, tp_plan="auto") == load_model(gguf_path) == ("model", "tokenizer")
    assert held == {"auto": False, None: True}


def test_tensor_parallelism_over_heads_that_do_not_divide_is_refused_before_loading(tiny_dir, monkeypatch):
    """2 query heads and 1 key/value head over 2 processes: refused by name, not a shape error in the first forward."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ModelLoadError, match=r"2 query heads and 1 key/value heads do not divide by 2 \(launch"):
        load_model(tiny_dir, tp_plan="auto")


def test_tensor_parallelism_checks_a_heterogeneous_configs_heads_layer_by_layer(tmp_path, monkeypatch):
    """Gemma 4 with shared keys and values: its full layers have 1 key/value head, its sliding ones 2. Read from
    the whole config, num_key_value_heads had raised transformers' per-layer attribute error, reported as a
    failed load."""
    from transformers import Gemma4TextConfig

    Gemma4TextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     layer_types=["sliding_attention", "full_attention"], attention_k_eq_v=True,
                     num_global_key_value_heads=1, head_dim=16, global_head_dim=32).save_pretrained(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ModelLoadError, match=r"4 query heads and 1 key/value heads do not divide by 2 \(launch"):
        load_model(str(tmp_path), tp_plan="auto")

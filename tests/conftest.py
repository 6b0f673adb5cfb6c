"""Shared fixtures: tiny random models of several families, the real default model, transformers'
reference outputs cached on disk, the CLI run in-process, and the hypothesis profiles of the tiers."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import weakref

import pytest
import torch
import transformers
import typer.testing
from filelock import FileLock
from hypothesis import HealthCheck, settings
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lookahead import cli, engine, kernels, models, quant
from lookahead.baseline import hf_generate
from lookahead.core.prices import StepPrices
from lookahead.machine import cache_root
from lookahead.models import load_model
from lookahead.runtime.batch import StepInput

TINY_VOCAB = 128
_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _tiny(family: str):
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**_COMMON))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_COMMON))
    if family == "mistral":  # a sliding window shorter than the sequences, to exercise the sliding mask
        return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=24))
    if family == "phi3":
        return Phi3ForCausalLM(Phi3Config(**_COMMON))
    if family == "gemma3":  # hybrid: sliding and full layers alternate
        config = Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 3},
            head_dim=16,
            sliding_window=20,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        return Gemma3ForCausalLM(config)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gemma3")


def make_tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A small random model whose greedy output is varied enough to test with: larger init weights
    give peaked, input-dependent distributions instead of near-uniform ones."""
    torch.manual_seed(seed)
    return peaked(_tiny(family), 0.15)


def make_mla_model() -> torch.nn.Module:
    """A tiny random DeepSeek-V3 (multi-head latent attention): queries and keys of head size 24, values of 16 (192
    and 128 in its checkpoints); its cache holds one head of the latent (32) and of the rotary key (8)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2)).eval()


def peaked(model: torch.nn.Module, std: float) -> torch.nn.Module:
    """Re-draw the weight matrices with a larger spread, in eval mode."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, std)
    return model.eval()


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def llama_tiny():
    return make_tiny_model("llama")


@functools.cache
def _load_once(name_or_path: str | None, gguf_file: str | None, dtype: str):
    return load_model(name_or_path, gguf_file=gguf_file, dtype=dtype)


@pytest.fixture(autouse=True, scope="session")
def _models_loaded_once():
    """Each model is loaded once per test process, also by the in-process CLI, which imports `load_model` when a
    command runs (a failed load is not kept). Test modules bound the real one at import."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_model", lambda name_or_path=None, gguf_file=None, dtype="float32":
                      _load_once(name_or_path, gguf_file, dtype))
        yield


@pytest.fixture(autouse=True)
def _fresh_acceptance_stats(monkeypatch):
    """Each test starts from acceptance statistics of its own: those an engine learns outlive it (per model,
    `engine.acceptance_stats`), so without this what a test drafts would depend on the tests run before it in
    the same process. test_engine tests the sharing itself."""
    monkeypatch.setattr(engine, "_ACCEPTANCE", weakref.WeakKeyDictionary())


@pytest.fixture
def drafts_always(monkeypatch):
    """Steps of the automatic budget always carry drafts. On a tiny model, proposing drafts costs more than
    the forward passes they save, and the engine (`StepPrices.drafts`) rightly stops proposing them; tests of
    what drafts do need them."""
    monkeypatch.setattr(StepPrices, "drafts", lambda self, batch: True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved with the default model's tokenizer, so the CLI can load it by path."""
    _, tokenizer = _load_once(None, None, "float32")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def default_model():
    return _load_once(None, None, "float32")


@pytest.fixture(scope="session")
def default_model_int4():
    return _load_once(None, None, "int4")


# Example counts of the property tests: `scripts/test.sh --quick` runs the quick profile, the full run the
# full one; both are seeded (derandomize), so a failure reproduces, and hypothesis prints the example.
settings.register_profile("quick", max_examples=50, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("full", parent=settings.get_profile("quick"), max_examples=1000)
settings.load_profile("quick")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one torch thread per worker: the workers share the cores
    torch.set_num_threads(1)


# transformers' greedy outputs, the reference of every exactness test, are cached on disk: the key holds
# everything the output depends on (the weights' bytes, the config, the prompt, the length, the EOS ids,
# the versions of torch and transformers, the source of the call); LOOKAHEAD_TEST_REFERENCE_CACHE=0
# recomputes them all.
REFERENCE_CACHE = cache_root() / "test-references"
_FINGERPRINTS: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of what the model computes: its class, config, generation config and every weight's bytes."""
    if model not in _FINGERPRINTS:
        digest = hashlib.blake2b(digest_size=20)
        config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
        digest.update(json.dumps([type(model).__name__, config, model.generation_config.to_dict()],
                                 sort_keys=True, default=str).encode())
        for name, tensor in model.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        _FINGERPRINTS[model] = digest.hexdigest()
    return _FINGERPRINTS[model]


# The call, and the quantised layers' code and our kernels' (a quantised model's output depends on them, not only on
# its weights).
_REFERENCE_SOURCE = hashlib.blake2b("".join([inspect.getsource(hf_generate), inspect.getsource(quant),
                                             *(source.read_text() for source in kernels.SOURCES)]).encode(),
                                    digest_size=8).hexdigest()


def reference_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None, **options) -> torch.Tensor:
    """transformers' own greedy `generate` ([1, n + new]), from the disk cache when it has run before."""
    eos = eos_token_id if eos_token_id is None or isinstance(eos_token_id, int) else sorted(eos_token_id)
    key = json.dumps([model_fingerprint(model), torch.as_tensor(input_ids).tolist(), max_new_tokens, eos, options,
                      torch.__version__, transformers.__version__, _REFERENCE_SOURCE], sort_keys=True, default=str)
    path = REFERENCE_CACHE / f"{hashlib.blake2b(key.encode(), digest_size=20).hexdigest()}.pt"
    if os.environ.get("LOOKAHEAD_TEST_REFERENCE_CACHE", "1") == "0":
        return hf_generate(model, input_ids, max_new_tokens, eos_token_id=eos_token_id, **options)[0].cpu()
    REFERENCE_CACHE.mkdir(parents=True, exist_ok=True)
    # One worker computes a reference at a time; another that needs it waits, then reads it.
    with FileLock(path.with_name(f".{path.name}.lock")):
        if path.exists():
            return torch.load(path)
        sequences = hf_generate(model, input_ids, max_new_tokens, eos_token_id=eos_token_id, **options)[0].cpu()
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        torch.save(sequences, partial)
        os.replace(partial, path)  # atomic: a worker never reads half a file
    return sequences


class CliResult:
    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = exit_code, stdout, stderr


def run_cli(*args: str) -> CliResult:
    """The `lookahead` command run in this process (same parser, same code; no interpreter start-up and
    model load per call). tests/test_cli.py runs the installed script as a subprocess too."""
    result = typer.testing.CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "200"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return CliResult(result.exit_code, result.stdout, result.stderr)


def random_tree_step(size: int, generator: torch.Generator) -> StepInput:
    """A step of `size` rows: a random tree (each row attends a random earlier row's ancestors and itself)."""
    parents = [-1] + [int(torch.randint(row, (1,), generator=generator)) for row in range(1, size)]
    allowed = torch.eye(size, dtype=torch.bool)
    depth = [0] * size
    for row in range(1, size):
        allowed[row] |= allowed[parents[row]]
        depth[row] = depth[parents[row]] + 1
    tokens = torch.randint(3, 128, (size,), generator=generator)
    return StepInput(tokens, torch.tensor(depth), allowed, torch.arange(size))

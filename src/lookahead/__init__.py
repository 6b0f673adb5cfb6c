"""Lookahead decoding: exact, parallel decoding for Hugging Face causal LMs without a draft model."""

from importlib import import_module as _import_module
from importlib import metadata as _metadata
from typing import TYPE_CHECKING

from .config import AUTO_CONFIG, LookaheadConfig
from .core.suffix import Corpus

if TYPE_CHECKING:
    from .generation import GenerateOutput, GenerationStats, generate
    from .hf import UnsupportedModelError
    from .models import ModelLoadError, load_model

try:
    __version__ = _metadata.version("lookahead")  # the installed distribution's
except _metadata.PackageNotFoundError:  # run from a source tree (PYTHONPATH=src), as scripts/gpu_check.sh does
    __version__ = "0+unknown"

# Imported on first use (PEP 562): they pull in torch and transformers, which `lookahead --help` need not wait for.
_LAZY = {
    "GenerateOutput": ".generation", "GenerationStats": ".generation", "generate": ".generation",
    "UnsupportedModelError": ".hf", "ModelLoadError": ".models", "load_model": ".models",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AUTO_CONFIG", "Corpus", "GenerateOutput", "GenerationStats", "LookaheadConfig", "ModelLoadError",
    "UnsupportedModelError", "generate", "load_model",
]

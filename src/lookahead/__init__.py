"""Lookahead decoding: exact, parallel decoding for Hugging Face causal LMs without a draft model."""

from importlib import metadata as _metadata

from .config import AUTO_CONFIG, LookaheadConfig
from .core.suffix import Corpus
from .generation import GenerateOutput, GenerationStats, generate
from .hf import UnsupportedModelError
from .models import ModelLoadError, load_model

__version__ = _metadata.version("lookahead")  # the installed distribution's

__all__ = [
    "AUTO_CONFIG", "Corpus", "GenerateOutput", "GenerationStats", "LookaheadConfig", "ModelLoadError",
    "UnsupportedModelError", "generate", "load_model",
]

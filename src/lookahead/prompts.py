"""Turning user text into model input: the chat template when the tokenizer has one."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids [1, n] of a conversation through the chat template, ready for the assistant's turn."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return encoded if isinstance(encoded, torch.Tensor) else encoded["input_ids"]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, raw: bool = False) -> torch.Tensor:
    """Token ids [1, n]: one user turn through the chat template, or the raw text when `raw` is set or
    the tokenizer has no chat template."""
    if not raw and has_chat_template(tokenizer):
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return tokenizer(text, return_tensors="pt")["input_ids"]

"""The baseline a user has today: transformers' own `generate`, timed."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from transformers import PreTrainedModel


def hf_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | None = None,
    do_sample: bool = False,
    **generate_kwargs,
) -> tuple[torch.Tensor, float]:
    """Plain `model.generate` (greedy unless `do_sample`) on a [1, n] prompt; returns (sequences, seconds)."""
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    elif not isinstance(eos_token_id, int):
        eos_token_id = list(eos_token_id)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = eos_token_id if isinstance(eos_token_id, int) else (eos_token_id or [0])[0]
    start = time.perf_counter()
    with torch.inference_mode():
        sequences = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=do_sample,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad,
            **generate_kwargs,
        )
    return sequences, time.perf_counter() - start

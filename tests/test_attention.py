"""Attention with each key/value head's query heads stacked as rows (`lookahead.attention`): the same output
as transformers' SDPA path, and only inside our forwards."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lookahead import attention, generate
from lookahead.attention import NAME, stacked_heads, stacked_heads_attention
from lookahead.config import LookaheadConfig


class _Heads(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# value_dim 8 < 16: values of a smaller head size than the queries', as in MLA models (DeepSeek-V2/V3)
@pytest.mark.parametrize("batch,rows,kv_heads,group,value_dim", [(1, 1, 2, 2, 16), (3, 1, 2, 3, 16), (2, 4, 1, 4, 16),
                                                                (4, 3, 3, 3, 16), (2, 5, 2, 1, 16), (2, 4, 1, 4, 8)])
def test_stacked_heads_give_what_transformers_sdpa_gives(dtype, batch, rows, kv_heads, group, value_dim, monkeypatch):
    monkeypatch.setattr(attention._THREAD, "ours", True, raising=False)  # as inside one of our forwards
    generator = torch.Generator().manual_seed(batch * 100 + rows * 10 + group)
    length, dim = 37, 16
    query = torch.randn(batch, rows, kv_heads * group, dim, generator=generator).to(dtype).transpose(1, 2)
    # Keys and values as the KV store hands them over: the first `length` positions of longer buffers.
    key = torch.randn(batch, kv_heads, 64, dim, generator=generator).to(dtype)[:, :, :length]
    value = torch.randn(batch, kv_heads, 64, value_dim, generator=generator).to(dtype)[:, :, :length]
    visible = torch.rand(batch, 1, rows, length, generator=generator) > 0.3
    visible[..., 0] = True
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    module = _Heads(group)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    out, weights = stacked_heads_attention(module, query, key, value, mask, scaling=dim**-0.5)
    assert weights is None and out.shape == (batch, rows, kv_heads * group, value_dim)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=0)


def test_only_our_forwards_run_it_and_the_model_keeps_its_setting(llama_tiny):
    calls = []

    def recording(*args, **kwargs):
        calls.append(llama_tiny.config._attn_implementation)
        return stacked_heads_attention(*args, **kwargs)

    AttentionInterface.register(NAME, recording)
    try:
        assert llama_tiny.config._attn_implementation == "sdpa"
        generate(llama_tiny, torch.tensor([5, 6, 7, 8, 9]), max_new_tokens=4, config=LookaheadConfig(2, 3, 2))
        assert calls and set(calls) == {NAME}
        assert llama_tiny.config._attn_implementation == "sdpa"
        ours = len(calls)
        with torch.inference_mode():
            llama_tiny(torch.tensor([[5, 6, 7]]))  # transformers' own forward of the same model: SDPA
        assert len(calls) == ours
    finally:
        AttentionInterface.register(NAME, stacked_heads_attention)


def _attention_inputs(heads: int = 4, kv_heads: int = 2, mask_heads: int = 1):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, heads, 3, 8, generator=generator)
    key, value = (torch.randn(2, kv_heads, 11, 8, generator=generator) for _ in range(2))
    visible = torch.rand(2, mask_heads, 3, 11, generator=generator) > 0.3
    visible[..., 0] = True
    return query, key, value, torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("case", ["position bias", "a mask per head"])
def test_what_transformers_sdpa_folds_into_the_mask_is_left_to_it(case, monkeypatch):
    """A position bias (added to the mask there) or a mask of its own per head cannot take the stacked path."""
    monkeypatch.setattr(attention._THREAD, "ours", True, raising=False)
    query, key, value, mask = _attention_inputs(mask_heads=4 if case == "a mask per head" else 1)
    extra = {"position_bias": torch.randn(2, 4, 3, 11)} if case == "position bias" else {}
    expected, _ = sdpa_attention_forward(_Heads(2), query, key, value, mask, **extra)
    out, _ = stacked_heads_attention(_Heads(2), query, key, value, mask, **extra)
    torch.testing.assert_close(out, expected)


def test_the_repeated_masks_of_a_forward_follow_the_group_and_end_with_it(llama_tiny):
    mask = torch.zeros(2, 1, 3, 11)
    try:
        assert attention._masks(mask, 2)[0].shape == (2, 1, 6, 11)
        assert attention._masks(mask, 3)[0].shape == (2, 1, 9, 11)  # the same mask for another group: made again
    finally:
        attention._MASKS.clear()
    with stacked_heads(llama_tiny), torch.inference_mode():
        llama_tiny(torch.tensor([[5, 6, 7, 8], [0, 5, 6, 7]]), attention_mask=torch.tensor([[1] * 4, [0] + [1] * 3]))
        assert attention._MASKS
    assert not attention._MASKS  # none outlives the forward (each holds its step's masks)


def test_a_ragged_forward_off_the_stacked_path_computes_what_it_computes_stacked():
    """A ragged forward that transformers' SDPA path must take (here: attention weights asked for) gets the mask
    as it is, not repeated for the group."""
    from lookahead.attention import RaggedLayout, _ragged_attention

    layout = RaggedLayout.of([1, 3], [4, 2], torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 4, 8, generator=generator)  # 2 key/value heads of 2 query heads; 4 rows in all
    key, value = (torch.randn(2, 2, 7, 8, generator=generator) for _ in range(2))
    visible = torch.rand(2, 1, 3, 7, generator=generator) > 0.3
    visible[..., 0] = True
    mask = torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)
    try:
        stacked, _ = _ragged_attention(_Heads(2), query, key, value, mask, layout, 0.0, None)
        attention._MASKS.clear()
        plain, _ = _ragged_attention(_Heads(2), query, key, value, mask, layout, 0.0, None, output_attentions=True)
    finally:
        attention._MASKS.clear()
    torch.testing.assert_close(plain, stacked)


def test_a_model_loaded_on_our_attention_decodes_a_batch_as_greedy_and_keeps_its_setting(llama_tiny):
    """Loaded with attn_implementation="lookahead_sdpa": ragged steps crashed (the rows were laid out for our
    function, which took the forward for another's)."""
    from test_engine import STOPS, expected_row, prompts_of

    prompts = prompts_of([12, 4, 9], seed=3)
    width = max(p.numel() for p in prompts)
    pad = llama_tiny.generation_config.pad_token_id
    input_ids = torch.stack([torch.cat([torch.full((width - p.numel(),), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.numel()), torch.ones(p.numel())]) for p in prompts]).long()
    llama_tiny.config._attn_implementation = NAME
    try:
        out = generate(llama_tiny, input_ids, attention_mask=mask, max_new_tokens=24, eos_token_id=STOPS)
        assert llama_tiny.config._attn_implementation == NAME
    finally:
        llama_tiny.config._attn_implementation = "sdpa"
    for b, prompt in enumerate(prompts):
        new = out.sequences[b, width:]
        assert torch.equal(new, expected_row(llama_tiny, prompt, 24, pad)[prompt.numel():][: new.numel()]), b


def test_a_model_on_eager_attention_is_left_alone(llama_tiny):
    llama_tiny.config._attn_implementation = "eager"
    try:
        with stacked_heads(llama_tiny):
            assert llama_tiny.config._attn_implementation == "eager"
    finally:
        llama_tiny.config._attn_implementation = "sdpa"


def test_transformers_forwards_beside_ours_keep_their_path_and_the_setting_comes_back(llama_tiny, monkeypatch):
    """A server's engine thread and transformers' `generate` in another share the model: the latter's
    forwards stay on transformers' SDPA path while ours run, and the setting is restored once the last of
    ours (overlapping in two threads) has left."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 5, 6, 7, 8, 9]])
    padding = torch.tensor([[1] * 7, [0, 0] + [1] * 5])  # a 4-D mask reaches the attention
    with torch.inference_mode():
        alone = llama_tiny(ids, attention_mask=padding).logits
    transformers_path = []

    def counted(*args, **kwargs):
        transformers_path.append(threading.current_thread())
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counted)
    inside, release = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]

    def ours(index: int) -> None:
        with stacked_heads(llama_tiny):
            inside[index].set()
            release[index].wait(30)

    threads = [threading.Thread(target=ours, args=(i,)) for i in range(2)]
    for index, thread in enumerate(threads):
        thread.start()
        assert inside[index].wait(30)
    try:
        assert llama_tiny.config._attn_implementation == NAME
        with torch.inference_mode():
            beside = llama_tiny(ids, attention_mask=padding).logits
        assert transformers_path == [threading.current_thread()] * llama_tiny.config.num_hidden_layers
        assert torch.equal(beside, alone)
        release[0].set()
        threads[0].join(30)
        assert llama_tiny.config._attn_implementation == NAME  # the other thread's forward still runs
    finally:
        for event in release:
            event.set()
        for thread in threads:
            thread.join(30)
    assert llama_tiny.config._attn_implementation == "sdpa"

"""Grouped-query attention without copies of the cache (kibidango.backends.attention) against
transformers' own sdpa attention: the same logits on the shapes the runtime feeds."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kibidango.backends import attention
from tests.conftest import tiny_llama


def _padded_run(model, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """A left-padded batch of ``prompts`` fed at once, then ``steps`` one-token forwards of the
    greedy tokens, as the runtime's batching feeds a running batch: each forward's logits."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, outs = DynamicCache(), []
    with torch.inference_mode():
        for _ in range(steps + 1):
            out = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
            )
            outs.append(out.logits)
            ids = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
    return outs


def test_grouped_attention_gives_sdpa_logits_without_copying_the_cache(monkeypatch):
    stock, grouped = tiny_llama(3, hidden=48, layers=3), tiny_llama(3, hidden=48, layers=3)
    assert grouped.config.num_attention_heads == 2 * grouped.config.num_key_value_heads
    assert attention.install(grouped)
    assert grouped.config._attn_implementation == attention.NAME
    assert stock.config._attn_implementation == "sdpa"
    prompts = [[1, 5, 9, 33, 2, 7], [1, 60], [1, 17, 3, 40]]
    expected = _padded_run(stock, prompts, steps=4)

    import transformers.integrations.sdpa_attention as hf_sdpa

    def copy(*args, **kwargs):
        raise AssertionError("the cache was copied per query head (repeat_kv)")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", copy)
    with pytest.raises(AssertionError, match="repeat_kv"):  # the check bites: stock sdpa copies here
        _padded_run(stock, prompts, steps=1)
    got = _padded_run(grouped, prompts, steps=4)
    for e, g in zip(expected, got):
        assert torch.allclose(e, g, rtol=0, atol=1e-10), (e - g).abs().max()


def test_grouped_attention_on_one_sequence_with_a_cache():
    """A session's own forwards: no mask, a prefill, a multi-token verification after a cache."""
    stock, grouped = tiny_llama(4), tiny_llama(4)
    attention.install(grouped)
    feeds = [[1, 9, 8, 7], [5], [6, 2, 3], [11]]
    caches = {id(stock): DynamicCache(), id(grouped): DynamicCache()}
    with torch.inference_mode():
        for feed in feeds:
            ids = torch.tensor([feed])
            e = stock(input_ids=ids, past_key_values=caches[id(stock)], use_cache=True).logits
            g = grouped(input_ids=ids, past_key_values=caches[id(grouped)], use_cache=True).logits
            assert torch.allclose(e, g, rtol=0, atol=1e-10)


def test_models_without_grouped_heads_keep_sdpa():
    model = tiny_llama(5, kv_heads=4)
    assert not attention.install(model)
    assert model.config._attn_implementation == "sdpa"

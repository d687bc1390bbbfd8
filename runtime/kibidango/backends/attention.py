"""Grouped-query attention that does not copy the key/value cache.

transformers' ``sdpa`` attention gives every query head its own copy of the key/value head it
shares (``repeat_kv``: the whole cache of a layer copied ``heads / kv_heads`` times, every layer,
every step) unless no attention mask is passed, and a padded batch — the runtime's continuous
batching — always passes one. On SmolLM2-135M (9 query heads on 3 key/value heads) that copy was
~60% of a batched decoding step on CPU (py-spy on stage 1B of the small preset).

:func:`gqa_sdpa_attention` folds the query heads of a group into the query length instead: the
``G`` heads that read key/value head ``h`` become ``G x q`` query rows of one SDPA call on head ``h``
([B, H_kv, G*q, D] against [B, H_kv, L, D]), and the mask (q x L per sequence: small) is tiled ``G``
times. The same dot products and softmaxes as ``sdpa``, no copy of the cache; float results agree
to rounding. Where the fold does not apply (no grouping, dropout, a position bias, no mask on a
multi-token forward — where ``sdpa`` itself already runs grouped), it is transformers' own ``sdpa``.

:func:`install` switches a loaded model to it (``set_attn_implementation``; registered under
:data:`NAME` with transformers' ``AttentionInterface`` and ``sdpa``'s mask), only where the model
runs ``sdpa``."""

from __future__ import annotations

import torch

__all__ = ["NAME", "gqa_sdpa_attention", "install"]

NAME = "kibidango_gqa_sdpa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    mask_per_head = attention_mask is not None and attention_mask.shape[1] != 1
    if (
        groups == 1
        or heads != groups * kv_heads
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions")
        or (attention_mask is None and q_len > 1)
        or mask_per_head
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # head h_kv * G + g, position i -> row g * q + i of head h_kv (a reshape of (H, q) into (H_kv, G * q))
    folded = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    out = out.reshape(batch, heads, q_len, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(NAME, gqa_sdpa_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


def install(hf_model) -> bool:
    """Run ``hf_model``'s attention through :func:`gqa_sdpa_attention` where it runs ``sdpa`` and
    groups its query heads; True if it does now."""
    config = hf_model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "_attn_implementation", None) != "sdpa" or not heads or kv_heads == heads:
        return False
    _register()
    hf_model.set_attn_implementation(NAME)
    return True

"""The engine models' attention: transformers' sdpa, without repeating grouped K/V heads in CPU
forwards that record no gradient.

transformers' sdpa path copies the K/V cache once per query head group (`repeat_kv`) whenever a
mask is given, which the decode loop's padded rows always have. On CPU,
`scaled_dot_product_attention(..., enable_gqa=True)` computes the same forward bit for bit without
that copy (tests/unit/test_attention.py). Its K/V gradient sums the groups in another order, so a
forward that records a gradient keeps transformers' own path, as do other devices (on CUDA a mask
with `enable_gqa` falls back to the math kernel).

The implementation is registered under `SDPA_GQA` with transformers' sdpa mask, so masks are built
exactly as for "sdpa".
"""

from __future__ import annotations

import functools

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SDPA_GQA = "sdpa_gqa_cpu_inference"


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def sdpa_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, with `enable_gqa` instead of `repeat_kv` where
    that gives the same bits (module docstring)."""
    grouped = key.shape[1] != query.shape[1]
    if (
        not grouped
        or query.device.type != "cpu"
        or dropout
        or kwargs.get("output_attentions")
        or _needs_grad(query, key, value)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # The causal flag as transformers derives it: only for a multi-token query without a mask.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    out_BHTD = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling, is_causal=causal, enable_gqa=True
    )
    return out_BHTD.transpose(1, 2).contiguous(), None


@functools.cache
def register() -> str:
    """Register the attention and its (sdpa) mask with transformers; returns the name to set as a
    config's `_attn_implementation`."""
    # The registries load transformers.modeling_utils (most of transformers): when a model is built.
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # likewise

    AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
    AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)
    return SDPA_GQA

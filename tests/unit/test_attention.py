"""The engine's attention (`local_server/engine/attention.py`) against transformers' sdpa path:
the same forward bits where it reads grouped K/V in place, transformers' own path (and gradient)
wherever a gradient is recorded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dppo_harness.local_server.engine import attention

MODULE = SimpleNamespace(num_key_value_groups=2, is_causal=True)


def _qkv(B: int, H: int, Hkv: int, Tq: int, Tk: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, Tq, 32, generator=g),
        torch.randn(B, Hkv, Tk, 32, generator=g),
        torch.randn(B, Hkv, Tk, 32, generator=g),
    )


def _padding_mask(B: int, Tq: int, Tk: int) -> torch.Tensor:
    """Boolean [B, 1, Tq, Tk]: row b cannot see its first b columns (left padding), plus causality."""
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
    mask = allowed.expand(B, 1, Tq, Tk).clone()
    for b in range(B):
        mask[b, :, :, :b] = False
    return mask


CASES = {  # (B, H, Hkv, Tq, Tk, mask)
    "decode step, padded rows": (16, 4, 2, 1, 600, "padding"),
    "batched prefill, padded rows": (4, 4, 2, 37, 37, "padding"),
    "prefill without a mask (causal flag)": (2, 4, 2, 64, 64, None),
    "four query heads per KV head": (3, 8, 2, 1, 129, "padding"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inference_forward_is_bitwise_transformers_sdpa(case):
    B, H, Hkv, Tq, Tk, kind = CASES[case]
    q, k, v = _qkv(B, H, Hkv, Tq, Tk)
    mask = _padding_mask(B, Tq, Tk) if kind else None
    module = SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True)
    with torch.no_grad():
        got, _ = attention.sdpa_gqa_attention(module, q, k, v, mask, scaling=32**-0.5)
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=32**-0.5)
    assert got.shape == want.shape == (B, Tq, H, 32) and got.is_contiguous()
    assert torch.equal(got, want)


def test_the_mask_is_applied():
    """A mask the attention ignored would show here: padded rows differ from unmasked ones."""
    q, k, v = _qkv(4, 4, 2, 1, 50)
    with torch.no_grad():
        masked, _ = attention.sdpa_gqa_attention(MODULE, q, k, v, _padding_mask(4, 1, 50))
        open_, _ = attention.sdpa_gqa_attention(MODULE, q, k, v, torch.ones(4, 1, 1, 50, dtype=torch.bool))
    assert torch.equal(masked[0], open_[0]) and not torch.equal(masked[1:], open_[1:])


def test_a_recorded_gradient_takes_transformers_path_bit_for_bit():
    """With a gradient, K/V gradients must equal transformers' (`enable_gqa` sums the query groups
    in another order: the last assertion shows the difference this guards against)."""
    q0, k0, v0 = _qkv(2, 4, 2, 40, 40, seed=3)
    mask = _padding_mask(2, 40, 40)
    grad_out = torch.randn(2, 40, 4, 32, generator=torch.Generator().manual_seed(4))

    def grads(fn):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, _ = fn(q, k, v)
        out.backward(grad_out)
        return out.detach(), q.grad, k.grad, v.grad

    ours = grads(lambda q, k, v: attention.sdpa_gqa_attention(MODULE, q, k, v, mask))
    theirs = grads(lambda q, k, v: sdpa_attention_forward(MODULE, q, k, v, mask))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    gqa = grads(
        lambda q, k, v: (
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2),
            None,
        )
    )
    assert torch.equal(gqa[0], theirs[0]) and not torch.equal(gqa[2], theirs[2])


def test_registered_with_the_sdpa_mask():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    name = attention.register()
    assert AttentionInterface._global_mapping[name] is attention.sdpa_gqa_attention
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is sdpa_mask

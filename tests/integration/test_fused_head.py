"""The fused, row-chunked output head of the tiny presets' trainer equals the plain computation
(head module, then the restricted-vocabulary log-softmax) in values and gradients."""

from __future__ import annotations

import peft
import pytest
import torch

from dppo_harness.local_server.engine import model
from dppo_harness.local_server.engine.logprobs import head_target_logprobs, lora_head_parts

H, V, R = 16, 101, 4  # V in-vocabulary columns + 1 input-only unk row


def _lora_head(seed: int, *, alpha: int = 8, dropout: float = 0.0) -> torch.nn.Module:
    """A peft LoRA `lm_head`, built the way the engine builds its models."""
    g = torch.Generator().manual_seed(seed)
    holder = torch.nn.Module()
    holder.lm_head = torch.nn.Linear(H, V + 1, bias=False)
    holder.lm_head.weight.data = torch.randn(V + 1, H, generator=g)
    holder.lm_head.weight.requires_grad_(False)
    config = peft.LoraConfig(r=R, lora_alpha=alpha, lora_dropout=dropout, target_modules=["lm_head"])
    head = peft.inject_adapter_in_model(config, holder).lm_head
    with torch.no_grad():  # B starts at zero in peft; a trained-looking delta exercises every term
        head.lora_A["default"].weight.copy_(torch.randn(R, H, generator=g) * 0.3)
        head.lora_B["default"].weight.copy_(torch.randn(V + 1, R, generator=g) * 0.3)
    return head


def _inputs(seed: int, n: int = 37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[[3, 20]] = V  # out-of-vocabulary targets map to the unk index
    return hidden, targets


def _plain(hidden, targets, head):
    return model.token_logprobs(head(hidden).unsqueeze(0), targets.unsqueeze(0), V)[0]


def _grads(lp, hidden, head, w):
    params = [hidden, *(p for p in head.parameters() if p.requires_grad)]
    return torch.autograd.grad((lp * w).sum(), params)


@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
@pytest.mark.parametrize("alpha", [4, 8])  # scaling 1 and 2
def test_lora_head_values_and_gradients_match_the_plain_path(chunk, alpha):
    head = _lora_head(0, alpha=alpha)
    hidden, targets = _inputs(1)
    w = torch.linspace(-1.0, 2.0, hidden.shape[0])
    plain = _plain(hidden, targets, head)
    got = head_target_logprobs(hidden, targets, head, V, oov_logprob=model.OOV_TARGET_LOGPROB, chunk_rows=chunk)
    torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-6)
    assert got.dtype == torch.float32 and float(got[3]) == float(got[20]) == model.OOV_TARGET_LOGPROB
    got_grads = _grads(got, hidden, head, w)
    # the chunked path sums the rows' gradient terms in another order: on sums that cancel to ~1e-2,
    # float32 rounding alone reaches a few 1e-6 on some CPUs (1.7e-6 seen on lora_B)
    for a, b in zip(got_grads, _grads(plain, hidden, head, w), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert float(got_grads[0][3].abs().sum()) == 0.0  # an OOV target's constant logprob has no gradient


def test_plain_linear_head_and_frozen_hidden():
    g = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(H, V + 1, bias=False)
    head.weight.data = torch.randn(V + 1, H, generator=g)
    head.weight.requires_grad_(False)
    hidden, targets = _inputs(5)
    w = torch.linspace(-1.0, 1.0, hidden.shape[0])
    got = head_target_logprobs(hidden, targets, head, V, oov_logprob=-30.0, chunk_rows=5)
    plain = _plain(hidden, targets, head)
    torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        torch.autograd.grad((got * w).sum(), hidden)[0],
        torch.autograd.grad((plain * w).sum(), hidden)[0],
        rtol=1e-5,
        atol=1e-6,
    )
    with torch.no_grad():
        assert not head_target_logprobs(hidden, targets, head, V, oov_logprob=-30.0).requires_grad


def test_the_comparison_can_fail_the_unk_column_is_excluded():
    """Including the unk column in the softmax (the wrong distribution) is detected."""
    head = _lora_head(6)
    hidden, targets = _inputs(7)
    got = head_target_logprobs(hidden, targets, head, V, oov_logprob=-30.0)
    with_unk = model.token_logprobs(head(hidden).unsqueeze(0), targets.unsqueeze(0), V + 1)[0]
    assert not torch.allclose(got, with_unk, atol=1e-6)


def test_unsupported_heads_and_inputs_are_refused():
    assert lora_head_parts(_lora_head(8, dropout=0.1)) is None  # dropout would make the pass random
    biased = torch.nn.Linear(H, V + 1, bias=True)
    assert lora_head_parts(biased) is None
    hidden, targets = _inputs(9)
    with pytest.raises(ValueError, match="does not support"):
        head_target_logprobs(hidden, targets, biased, V, oov_logprob=-30.0)
    with pytest.raises(ValueError, match="hidden rows"):
        head_target_logprobs(hidden, targets[:-1], _lora_head(8), V, oov_logprob=-30.0)
    with pytest.raises(ValueError, match="chunk_rows"):
        head_target_logprobs(hidden, targets, _lora_head(8), V, oov_logprob=-30.0, chunk_rows=0)


def test_backward_runs_once():
    head = _lora_head(10)
    hidden, targets = _inputs(11)
    lp = head_target_logprobs(hidden, targets, head, V, oov_logprob=-30.0)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        lp.sum().backward()

"""Chunked target log-softmax equals the naive full-logits computation, in values and gradients,
and never runs the output head on more than one chunk of rows."""

from __future__ import annotations

import pytest
import torch

from dppo_harness.local_server.engine.logprobs import chunked_target_logprobs, naive_target_logprobs


class LoraHead(torch.nn.Module):
    """Frozen base head plus a trainable low-rank delta (the shape of a peft LoRA lm_head)."""

    def __init__(self, H: int, V: int, r: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base = torch.nn.Linear(H, V, bias=False)
        self.base.weight.data = torch.randn(V, H, generator=g)
        self.base.weight.requires_grad_(False)
        self.A = torch.nn.Parameter(torch.randn(r, H, generator=g) * 0.3)
        self.B = torch.nn.Parameter(torch.randn(V, r, generator=g) * 0.3)
        self.rows_seen: list[int] = []

    def forward(self, x):
        self.rows_seen.append(x.shape[0])
        return self.base(x) + (x @ self.A.T) @ self.B.T


def _case(N=37, H=16, V=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = LoraHead(H, V, 4, seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    return head, hidden, targets


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
def test_values_and_gradients_match_naive(chunk):
    head, hidden, targets = _case()
    w = torch.linspace(-1.0, 2.0, hidden.shape[0])  # a weighted loss, so every row's gradient differs
    naive = naive_target_logprobs(hidden, targets, head)
    g_naive = torch.autograd.grad((naive * w).sum(), [hidden, head.A, head.B])
    head.rows_seen.clear()
    got = chunked_target_logprobs(hidden, targets, head, chunk_tokens=chunk)
    assert max(head.rows_seen) <= chunk  # the head never saw more than one chunk of rows
    g_got = torch.autograd.grad((got * w).sum(), [hidden, head.A, head.B])
    assert got.dtype == torch.float32 and got.shape == naive.shape
    torch.testing.assert_close(got, naive, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_got, g_naive, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert max(head.rows_seen) <= chunk  # backward recomputed chunks too, never the full batch


def test_a_wrong_target_alignment_is_detected():
    """The comparison above can fail: shifting the targets by one row changes the values."""
    head, hidden, targets = _case()
    naive = naive_target_logprobs(hidden, targets, head)
    shifted = chunked_target_logprobs(hidden, torch.roll(targets, 1), head, chunk_tokens=8)
    assert not torch.allclose(shifted, naive, atol=1e-3)


def test_no_grad_builds_no_graph_and_bf16_matches_bf16_naive():
    head, hidden, targets = _case()
    with torch.no_grad():
        got = chunked_target_logprobs(hidden, targets, head, chunk_tokens=10)
    assert not got.requires_grad
    head_bf16 = head.to(torch.bfloat16)
    h16 = hidden.detach().to(torch.bfloat16)
    with torch.no_grad():
        got16 = chunked_target_logprobs(h16, targets, head_bf16, chunk_tokens=10)
        naive16 = naive_target_logprobs(h16, targets, head_bf16)
    assert got16.dtype == torch.float32  # log-softmax in float32 over bf16 logits
    torch.testing.assert_close(got16, naive16, rtol=0, atol=1e-5)


def test_bad_shapes_are_refused():
    head, hidden, targets = _case()
    with pytest.raises(ValueError, match="hidden rows"):
        chunked_target_logprobs(hidden, targets[:-1], head)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_target_logprobs(hidden, targets, head, chunk_tokens=0)

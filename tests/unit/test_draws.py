"""The embedded server's CPU draws are bitwise torch's own: `exponential_cpu` against
`Tensor.exponential_`, `multinomial_one` against `torch.multinomial(p, 1)` (the presets' draw),
each from the same seeded generator, which must end in the same
state; and invalid probabilities are refused as torch refuses them."""

from __future__ import annotations

import pytest
import torch

from dppo_harness.local_server.engine import draws

# The presets' decode shape (8 samples x 15,254 drawable columns) and odd sizes around it.
SHAPES = [(8, 15_254), (3, 1), (1, 7), (5, 333)]


@pytest.mark.parametrize("shape", SHAPES)
def test_exponential_cpu_is_torchs_exponential_bitwise_and_leaves_the_same_generator_state(shape):
    ours, theirs = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    for _ in range(20):
        got = draws.exponential_cpu(torch.Size(shape), ours)
        want = torch.empty(shape).exponential_(generator=theirs)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(ours.get_state(), theirs.get_state())


def _probs(shape, seed: int, zeros: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4
    if zeros:  # a top_k cut leaves exact zeros
        x = x.masked_fill(x < x.median(dim=-1, keepdim=True).values, float("-inf"))
    return torch.softmax(x, dim=-1)


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_multinomial_one_draws_what_torch_multinomial_draws(shape, zeros):
    p = _probs(shape, 3, zeros)
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    got = torch.stack([draws.multinomial_one(p, ours) for _ in range(200)])
    want = torch.stack([torch.multinomial(p, 1, generator=theirs).squeeze(-1) for _ in range(200)])
    assert torch.equal(got, want)
    assert torch.equal(ours.get_state(), theirs.get_state())
    if shape[1] > 1:  # the check can fail: another seed draws other tokens
        other = torch.stack([draws.multinomial_one(p, torch.Generator().manual_seed(6)) for _ in range(20)])
        assert not torch.equal(other, got[:20])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_invalid_probabilities_are_refused_like_torch(bad):
    p = torch.full((2, 4), 0.25)
    p[1, 2] = bad
    with pytest.raises(RuntimeError, match="probability tensor contains either"):
        torch.multinomial(p, 1, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="probability tensor contains either"):
        draws.multinomial_one(p, torch.Generator().manual_seed(0))


def test_a_row_without_mass_is_refused_like_torch():
    p = torch.tensor([[0.5, 0.5], [0.0, 0.0]])
    with pytest.raises(RuntimeError, match="invalid multinomial distribution"):
        torch.multinomial(p, 1, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="invalid multinomial distribution"):
        draws.multinomial_one(p, torch.Generator().manual_seed(0))


def test_a_strided_input_is_drawn_in_torchs_memory_order():
    """A transposed (non-contiguous) probability matrix still draws what torch draws."""
    p = _probs((333, 5), 4, False).T.softmax(dim=-1)[:, ::2]
    assert not p.is_contiguous()
    got = draws.multinomial_one(p, torch.Generator().manual_seed(2))
    assert torch.equal(got, torch.multinomial(p, 1, generator=torch.Generator().manual_seed(2)).squeeze(-1))

"""One token per row from a decode step's logits, seeded by the request's own generator.

Temperature 0 is argmax. Otherwise the logits are tempered and cut to top_k / the top_p nucleus
(`filter_logits`), then drawn as `torch.multinomial(softmax(x), 1)` draws them, bitwise
(`multinomial_one`).

The Exp(1) noise that draw consumes comes from `exponential_cpu`, bitwise torch's `exponential_`,
which computes each value in one serial loop, most of a preset decode step's draw otherwise
(docs/benchmarks.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from dppo_harness.local_server.engine.sampling import DecodeRequest


def filter_logits(logits_RV: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Tempered logits with everything outside top_k / the top_p nucleus set to -inf."""
    x = logits_RV / temperature
    if top_k != -1 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = cum_before >= top_p  # keep the smallest prefix reaching top_p (always >= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


_LOW53 = (1 << 53) - 1


def exponential_cpu(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """float32 Exp(1) noise, bitwise `torch.empty(shape).exponential_(generator=generator)` on CPU.

    torch draws each value as float(-log1p(-u)) with u = (random64 & (2^53 - 1)) / 2^53, one
    element at a time. An int64 `random_` consumes the same random64 per element (keeping its low
    63 bits), and numpy's log1p is the same libm function, run over the whole array at once."""
    r = torch.empty(shape, dtype=torch.int64).random_(generator=generator).numpy()
    u = (r & _LOW53).astype(np.float64) * 2.0**-53
    return torch.from_numpy((-np.log1p(-u)).astype(np.float32))


def multinomial_one(probs_RV: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`torch.multinomial(probs_RV, 1, generator=generator)[:, 0]`, bitwise, for float32 probs: torch
    draws a single sample per row as argmax(p / E), E ~ Exp(1), after the same checks (a
    strided tensor, filled in its own memory order by torch, goes to torch itself)."""
    if (
        probs_RV.dtype != torch.float32
        or probs_RV.device.type != "cpu"
        or generator.device.type != "cpu"
        or not probs_RV.is_contiguous()
    ):
        return torch.multinomial(probs_RV, 1, generator=generator).squeeze(-1)
    if not bool(((probs_RV >= 0) & (probs_RV < float("inf"))).all()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((probs_RV.sum(dim=-1) == 0).any()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    return torch.argmax(probs_RV / exponential_cpu(probs_RV.shape, generator), dim=-1)


def draw(logits_RV: torch.Tensor, req: DecodeRequest, generator: torch.Generator) -> torch.Tensor:
    if req.temperature == 0.0:
        return logits_RV.argmax(dim=-1)
    x_RV = filter_logits(logits_RV, req.temperature, req.top_k, req.top_p)
    return multinomial_one(torch.softmax(x_RV, dim=-1), generator)

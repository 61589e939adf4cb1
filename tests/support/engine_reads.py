"""Reads of an in-process `Engine` that only tests make: its LoRA parameters, target logprobs with
their graph, and the plain-autograd gradient the two-pass `forward_backward_custom` path must
reproduce."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dppo_harness.local_server.engine.engine import DatumIn, Engine


def get_parameters(engine: Engine, model_id: str) -> dict[str, torch.Tensor]:
    tm = engine._get(model_id)
    with tm.lock:
        return {n: q.detach().clone() for n, q in tm.params}


def get_parameter_grads(engine: Engine, model_id: str) -> dict[str, torch.Tensor]:
    tm = engine._get(model_id)
    with tm.lock:
        return {n: (q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q)) for n, q in tm.params}


def compute_logprobs(
    engine: Engine, model_id: str, data: Sequence[DatumIn], *, grad: bool = False
) -> list[torch.Tensor]:
    """Per-datum target logprobs exactly as `Engine.forward` computes them (graph kept if grad)."""
    tm = engine._get(model_id)
    only_targets = [
        (t, {"target_tokens": inp["target_tokens"], "weights": np.zeros(len(t), np.float32)})
        if "target_tokens" in inp
        else (t, inp)
        for t, inp in data
    ]
    items = engine._validate(only_targets, "cross_entropy")
    out: list[torch.Tensor | None] = [None] * len(items)
    with tm.lock, torch.set_grad_enabled(grad):
        for idx in engine._microbatches(items):
            for lp, i in zip(engine._logprobs_mb(tm.net, items, idx), idx):
                out[i] = lp
    return [o for o in out if o is not None]


def direct_loss_grads(
    engine: Engine,
    model_id: str,
    data: Sequence[DatumIn],
    loss_of_logprobs: Callable[[list[torch.Tensor]], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Gradient of `loss_of_logprobs(per-datum target logprobs)` w.r.t. the LoRA parameters by plain
    autograd through the model (no accumulation into `.grad`)."""
    tm = engine._get(model_id)
    with tm.lock:
        loss = loss_of_logprobs(compute_logprobs(engine, model_id, data, grad=True))
        grads = torch.autograd.grad(loss, [q for _, q in tm.params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(q)).detach() for (n, q), g in zip(tm.params, grads)}

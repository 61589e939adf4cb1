"""Synthetic rehearsal for tests: loss-call records of a simulated policy through the real
recorder and loss (never evidence). Importable from tests as `diagnostic_rehearsal` (pytest's
`pythonpath` holds tests/support)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tinker
import torch

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss import loss_registry, losses


def simulate_records(
    *,
    seed: int = 0,
    n_updates: int = 16,
    minibatches_per_epoch: int = 8,
    sequences: int = 8,
    drift_per_update: float = 0.02,
    loss_cfg: Any = None,
) -> list[ins.LossCallRecord]:
    """Loss-call records of a simulated policy that moves each token's probability in its
    advantage's direction by about `drift_per_update` per update, through the real recorder and
    loss. Zero drift gives an on-policy run (the mask must stay silent)."""
    cfg = loss_cfg or losses.LossConfig(loss_registry.DPPO_LOSS, normalization="token_mean")
    rng = np.random.default_rng(seed)
    recorder = ins.LossCallRecorder(cfg)
    loss_fn = losses.make_loss_fn(cfg)
    batches = []
    for _mb in range(minibatches_per_epoch):
        data, q_list, a_list = [], [], []
        for _s in range(sequences):
            n_prompt, n_resp = int(rng.integers(2, 6)), int(rng.integers(4, 24))
            adv = float(rng.choice([-0.5, 0.0, 0.5, 0.25, -0.25]))
            q = np.clip(rng.beta(0.6, 0.6, size=n_resp), 1e-4, 1 - 1e-4)
            n = n_prompt + n_resp
            tokens = rng.integers(100, 5000, size=n + 1).tolist()
            data.append(
                tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * n_prompt + np.log(q).tolist(),
                        "advantages": [0.0] * n_prompt + [adv] * n_resp,
                        "mask": np.array([0.0] * n_prompt + [1.0] * n_resp, dtype=np.float32),
                    },
                )
            )
            q_list.append(q)
            a_list.append(adv)
        batches.append((data, q_list, a_list))
    for u in range(1, n_updates + 1):
        mb = (u - 1) % minibatches_per_epoch
        data, q_list, a_list = batches[mb]
        lps = []
        for d, q, a in zip(data, q_list, a_list, strict=True):
            n_prompt = d.model_input.length - len(q)
            step = drift_per_update * (u - 1) * np.sign(a) * rng.uniform(0.0, 2.0, size=q.size)
            p = np.clip(q + step, 1e-6, 1 - 1e-6)
            lps.append(
                torch.tensor(
                    np.concatenate([rng.normal(-2, 1, n_prompt), np.log(p)]), dtype=torch.float32, requires_grad=True
                )
            )
        loss, _ = recorder.wrap(loss_fn, update_index=u, epoch=(u - 1) // minibatches_per_epoch + 1, minibatch=mb)(
            data, lps
        )
        loss.backward()
    return recorder.records

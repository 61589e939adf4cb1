"""The packed loss path under test on the golden cases: each case as real ``tinker.Datum``s (or flat
float64 tensors) through ``losses``, its outputs scattered back into the padded layout so the parity
checks (``correctness_golden``) compare like with like. Imports torch and the SDK, which the
``validate`` CLI (``correctness``) never loads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tinker
import torch

from dppo_harness.loss import losses
from dppo_harness.loss.correctness_reference import MODES, GoldenCase, PackedCase
from dppo_harness.loss.loss_registry import DPPO_LOSS, GRPO_LOSS, Normalization


def to_datums(packed: PackedCase) -> list[tinker.Datum]:
    import tinker  # only where datums are built: the validate CLI needs numpy alone

    datums: list[tinker.Datum] = []
    for tokens, mu, adv, mask in zip(packed.tokens, packed.mu_T, packed.adv_T, packed.mask_T):
        datums.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
                    "logprobs": tinker.TensorData.from_numpy(mu.astype(np.float32)),
                    "advantages": tinker.TensorData.from_numpy(adv.astype(np.float32)),
                    "mask": tinker.TensorData.from_numpy(mask.astype(np.float32)),
                },
            )
        )
    return datums


@dataclass
class PackedRun:
    loss: float
    grad_BT: np.ndarray
    keep_BT: np.ndarray
    clipped_BT: np.ndarray
    metrics: dict[str, float]
    used_lp_BT: np.ndarray  # the values the loss actually saw
    used_mu_BT: np.ndarray
    used_adv_BT: np.ndarray
    prompt_grad_max_abs: float
    missing_grads: int


def run_packed(case: GoldenCase, packed: PackedCase, arm: str, normalization: Normalization, mode: str) -> PackedRun:
    """Run the packed path under test and scatter its outputs back into the padded layout."""

    cfg = losses.LossConfig(loss=DPPO_LOSS if arm == "dppo" else GRPO_LOSS, normalization=normalization)
    B, T = case.mask_BT.shape
    if mode == "float64":
        lps = [torch.tensor(lp, dtype=torch.float64, requires_grad=True) for lp in packed.lp_T]
        logprobs_N = torch.cat(lps) if lps else torch.zeros(0, dtype=torch.float64)
        cat = lambda xs: torch.from_numpy(np.concatenate(xs)) if xs else torch.zeros(0, dtype=torch.float64)  # noqa: E731
        mu_N, adv_N, mask_N = cat(packed.mu_T), cat(packed.adv_T), cat(packed.mask_T)
        call = losses.packed_loss_call(logprobs_N, mu_N, adv_N, mask_N, cfg)
        used_mu, used_adv = packed.mu_T, packed.adv_T
    elif mode in ("float32", "float64-datum"):
        dtype = torch.float32 if mode == "float32" else torch.float64
        datums = to_datums(packed)
        lps = [torch.tensor(lp, dtype=dtype).requires_grad_(True) for lp in packed.lp_T]
        _, call = losses.make_loss_fn(cfg).evaluate(datums, lps)
        used_mu = [mu.astype(np.float32).astype(np.float64) for mu in packed.mu_T]
        used_adv = [adv.astype(np.float32).astype(np.float64) for adv in packed.adv_T]
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    loss, terms = call.loss, call.terms
    loss.backward()
    grad_BT = np.zeros((B, T))
    keep_BT = np.zeros((B, T), dtype=bool)
    clipped_BT = np.zeros((B, T), dtype=bool)
    used_lp_BT = case.lp_BT.copy()
    used_mu_BT = case.mu_BT.copy()
    used_adv_BT = case.adv_BT.copy()
    prompt_max = 0.0
    missing = 0
    offset = 0
    keep_N = terms.dppo_keep_N.numpy()
    clip_N = terms.ppo_clipped_N.numpy()
    for b, (lp, p_len, r_len) in enumerate(zip(lps, packed.prompt_lens, packed.response_lens)):
        n_prompt = p_len - 1
        if lp.grad is None:
            missing += 1
            g = np.zeros(lp.shape[0])
        else:
            g = lp.grad.detach().to(torch.float64).numpy()
        prompt_max = max(prompt_max, float(np.max(np.abs(g[:n_prompt]), initial=0.0)))
        grad_BT[b, :r_len] = g[n_prompt:]
        keep_BT[b, :r_len] = keep_N[offset + n_prompt : offset + n_prompt + r_len]
        clipped_BT[b, :r_len] = clip_N[offset + n_prompt : offset + n_prompt + r_len]
        used_lp_BT[b, :r_len] = lp.detach().to(torch.float64).numpy()[n_prompt:]
        used_mu_BT[b, :r_len] = used_mu[b][n_prompt:]
        used_adv_BT[b, :r_len] = used_adv[b][n_prompt:]
        offset += lp.shape[0]
    return PackedRun(
        float(loss.detach()),
        grad_BT,
        keep_BT,
        clipped_BT,
        call.stats.metrics(),
        used_lp_BT,
        used_mu_BT,
        used_adv_BT,
        prompt_max,
        missing,
    )

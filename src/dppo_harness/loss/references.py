"""Independent numpy references of the registered losses (padded [B, T] layout, float64,
closed-form gradients, no autograd), written from ``/work/shared/reference/dppo-binary-tv.md`` and
sharing nothing with ``losses.py``. One signature: ``ref(lp_BT, mu_BT, adv_BT, mask_BT,
normalization, **params)``, ``params`` the registered loss's parameters under the same names plus
the options of a rule variant. ``ref_terms`` recomputes every decision of a loss call from them
(replay's independent check of the packed path).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dppo_harness.constants import DPPO_RATIO_CAP, LOG_RATIO_CLAMP_MAX, PPO_EPS


@dataclass(frozen=True)
class RefResult:
    loss: float
    grad_BT: np.ndarray
    decision_BT: np.ndarray  # dppo: kept (recorded mask); ppo: clipped


def ref_dppo(
    lp_BT: np.ndarray,
    mu_BT: np.ndarray,
    adv_BT: np.ndarray,
    mask_BT: np.ndarray,
    normalization: str,
    dppo_delta: float,
    ratio_cap: float = DPPO_RATIO_CAP,
    log_ratio_max: float = LOG_RATIO_CLAMP_MAX,
) -> RefResult:
    """DPPO Binary-TV on padded rows: loss -A*w*keep*m*lp, gradient -A*w*keep*m (per normalization)."""
    on = mask_BT > 0
    with np.errstate(over="ignore", invalid="ignore"):
        tv = np.exp(lp_BT) - np.exp(mu_BT)
        violates = np.where(adv_BT > 0, tv > dppo_delta, tv < -dppo_delta)
        kept = on & ~violates
        weight = np.minimum(np.exp(np.minimum(lp_BT - mu_BT, log_ratio_max)), ratio_cap)
        coef = np.where(kept, -adv_BT * weight, 0.0)
        loss = float(np.where(kept, coef * lp_BT, 0.0).sum())
    loss, grad = _normalize(loss, coef.astype(np.float64), mask_BT, normalization)
    return RefResult(loss, grad, kept)


def _normalize(loss: float, grad_BT: np.ndarray, mask_BT: np.ndarray, normalization: str) -> tuple[float, np.ndarray]:
    """`sum` as is; `token_mean` divides by the call's loss-token count (zero-advantage included)."""
    if normalization == "sum":
        return loss, grad_BT
    if normalization != "token_mean":
        raise ValueError(f"unknown normalization {normalization!r}")
    n = float(mask_BT.sum())
    scale = 1.0 / n if n > 0 else 0.0
    return loss * scale, grad_BT * scale


def ref_ppo(
    lp_BT: np.ndarray,
    mu_BT: np.ndarray,
    adv_BT: np.ndarray,
    mask_BT: np.ndarray,
    normalization: str = "sum",
    ppo_eps: float = PPO_EPS,
    log_ratio_clamp: float | None = None,
    dual_clip_c: float | None = None,
) -> RefResult:
    """Clipped-ratio loss -min(r*A, clamp(r, 1-eps, 1+eps)*A) on padded rows.

    Defaults are Tinker's built-in ``ppo`` (no log-ratio clamp, no dual clip). ``log_ratio_clamp=20,
    dual_clip_c=1e4`` reproduces verl's vanilla loss as recorded in the golden file.
    """
    on = mask_BT > 0
    log_ratio = np.where(on, lp_BT - mu_BT, 0.0)
    in_range = np.ones_like(on)
    if log_ratio_clamp is not None:
        # torch.clamp passes the gradient on the closed interval only.
        in_range = np.abs(log_ratio) <= log_ratio_clamp
        log_ratio = np.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(log_ratio)
        unclipped = -adv_BT * ratio
        clipped_val = -adv_BT * np.clip(ratio, 1 - ppo_eps, 1 + ppo_eps)
        token = np.maximum(unclipped, clipped_val)
        clipped = on & (((adv_BT > 0) & (ratio > 1 + ppo_eps)) | ((adv_BT < 0) & (ratio < 1 - ppo_eps)))
        grad = np.where(on & ~clipped & in_range, -adv_BT * ratio, 0.0)
        if dual_clip_c is not None:
            dual = on & (adv_BT < 0) & (-adv_BT * dual_clip_c < token)
            token = np.where(dual, -adv_BT * dual_clip_c, token)
            grad = np.where(dual, 0.0, grad)
        loss = float(np.where(on, token, 0.0).sum())
    grad = np.where(on & (adv_BT != 0), grad, 0.0)
    loss, grad = _normalize(loss, grad, mask_BT, normalization)
    return RefResult(loss, grad, clipped)


def ref_terms(
    tensors: Mapping[str, np.ndarray], *, dppo_delta: float, ratio_cap: float, ppo_eps: float
) -> dict[str, np.ndarray | float]:
    """Every field of `terms.TokenTerms`, by name, from a loss-call record's packed tensors (every
    decision is per token): the references' decisions, the ratio-cap hits, p - q and r, and the
    thresholds they were decided at."""
    lp, mu, adv, mask = (
        tensors[k].astype(np.float64) for k in ("logprobs_N", "sampler_logprobs_N", "advantages_N", "mask_N")
    )
    on = mask > 0
    keep = ref_dppo(lp, mu, adv, mask, "sum", dppo_delta, ratio_cap, LOG_RATIO_CLAMP_MAX).decision_BT
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.where(on, np.exp(np.where(on, lp - mu, 0.0)), 1.0)
        tv = np.where(on, np.exp(np.where(on, lp, 0.0)) - np.exp(np.where(on, mu, 0.0)), 0.0)
    return {
        "prob_diff_N": tv,
        "ratio_N": ratio,
        "dppo_keep_N": keep,
        "ppo_clipped_N": ref_ppo(lp, mu, adv, mask, "sum", ppo_eps=ppo_eps).decision_BT,
        "ratio_cap_hit_N": on & (adv != 0) & keep & (ratio > ratio_cap),  # the cap shapes only kept tokens
        "loss_token_N": on,
        "nonzero_adv_N": on & (adv != 0),
        "advantages_N": adv,
        "dppo_delta": dppo_delta,
        "ppo_eps": ppo_eps,
        "ratio_cap": ratio_cap,
    }

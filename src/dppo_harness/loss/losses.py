"""Packed loss path for ``TrainingClient.forward_backward_custom``.

Every loss a spec's arm may name is one registered `LossEntry` (``loss_registry.py``, re-exported
here): its packed per-token rule, its parameters, its metric names, the activation-gate metrics
it provides, its independent numpy reference (``references.py``) and its golden cases. The spec's
loss name is the one switch (``LossConfig.loss``); a plan naming an unregistered loss is refused
at load. Every rule sees the same per-token terms, so the family's
diagnostics are counted for every loss call (GRPO clip fraction while DPPO trains, DPPO masked
fraction while GRPO trains). Rules: ``/work/shared/reference/dppo-binary-tv.md``.

Layout (docs/architecture.md): each datum carries ``target_tokens``, sampler ``logprobs``,
``advantages`` and ``mask`` of length T; the SDK hands the loss one current-logprob tensor of
length T per datum. Everything is concatenated into packed ``_N`` tensors. Decisions and weights
are computed in float64 whatever the caller's dtype, so a float32 boundary token is decided on
the exact values the service returned (bf16/float32 probabilities flip boundary tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import tinker
import torch

from dppo_harness.constants import DPPO_DELTA, DPPO_RATIO_CAP, PPO_EPS
from dppo_harness.loss.loss_registry import (  # the registry; re-exported here for the loss path's callers
    DPPO_LOSS,
    DPPO_METRIC_NAMES,
    GRPO_LOSS,
    HARNESS_GATE_METRICS,
    LOSSES,
    PPO_METRIC_NAMES,
    GoldenCases,
    LossEntry,
    Normalization,
    UnknownLossError,
    gate_metric_sources,
    get_loss,
    loss_names,
    register_loss,
    unregister_loss,
)

_NORMALIZATIONS = ("sum", "token_mean")
_INPUT_KEYS = ("logprobs", "advantages", "mask")

# Metrics every loss call reports, whatever rule trains (token counts and drift tails).
SHARED_METRIC_NAMES = (
    "tokens/loss",
    "tokens/nonzero_adv",
    "drift/signed_p90",
    "drift/signed_p99",
    "drift/signed_max",
    "drift/signed_min",
    "drift/abs_p90",
    "drift/abs_p99",
    "drift/abs_max",
    "loss/arm_dppo",
    "loss/normalization_sum",
)
METRIC_NAMES = SHARED_METRIC_NAMES[:2] + DPPO_METRIC_NAMES + PPO_METRIC_NAMES + SHARED_METRIC_NAMES[2:]
_CONFIG_PARAMS = ("ppo_eps", "dppo_delta", "ratio_cap")  # LossConfig fields an entry's params may pin
__all__ = [
    "DPPO_LOSS",
    "GRPO_LOSS",
    "HARNESS_GATE_METRICS",
    "LOSSES",
    "GoldenCases",
    "LossEntry",
    "UnknownLossError",
    "gate_metric_sources",
    "get_loss",
    "loss_names",
    "register_loss",
    "unregister_loss",
]


@dataclass(frozen=True)
class LossConfig:
    """The loss one arm trains with: a registered name, the normalization, and the thresholds of
    the family's per-token terms (the DPPO mask, the PPO clip, the ratio cap), which every loss
    call also counts as diagnostics. `for_loss` takes the thresholds from the registry entry."""

    loss: str
    normalization: Normalization
    ppo_eps: float = PPO_EPS
    dppo_delta: float = DPPO_DELTA
    ratio_cap: float = DPPO_RATIO_CAP

    @classmethod
    def for_loss(cls, name: str, normalization: Normalization) -> LossConfig:
        entry = get_loss(name)
        return cls(name, normalization, **{k: v for k, v in entry.params.items() if k in _CONFIG_PARAMS})

    def __post_init__(self) -> None:
        get_loss(self.loss)  # UnknownLossError (a ValueError) naming the registered losses
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(f"LossConfig.normalization must be one of {_NORMALIZATIONS}, got {self.normalization!r}")
        for name in ("ppo_eps", "dppo_delta", "ratio_cap"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise ValueError(f"LossConfig.{name} must be a positive finite number, got {value!r}")
        if self.ppo_eps >= 1:
            raise ValueError(f"LossConfig.ppo_eps must be < 1, got {self.ppo_eps!r}")


@dataclass(frozen=True)
class TokenTerms:
    """Flat packed per-token terms over N tokens; all detached, float64 / bool."""

    prob_diff_N: torch.Tensor  # p - q on loss tokens, 0.0 elsewhere
    ratio_N: torch.Tensor  # r = exp(lp - mu) on loss tokens, 1.0 elsewhere
    dppo_keep_N: torch.Tensor  # recorded DPPO mask (includes the loss mask, like the reference)
    ppo_clipped_N: torch.Tensor  # clamp active and removing the gradient
    ratio_cap_hit_N: torch.Tensor  # loss & A != 0 & kept & r > C
    loss_token_N: torch.Tensor  # mask == 1
    nonzero_adv_N: torch.Tensor  # loss & A != 0
    advantages_N: torch.Tensor  # float64, as given (junk kept on non-loss tokens)


def as_numpy(value: tinker.TensorData | torch.Tensor | npt.ArrayLike) -> np.ndarray:
    """One loss_fn_inputs entry as numpy, whether TensorData (dense or sparse), torch or a list."""
    if isinstance(value, tinker.TensorData):
        return np.asarray(value.to_numpy())
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _as_numpy_1d(value: tinker.TensorData | torch.Tensor | npt.ArrayLike, key: str, index: int) -> np.ndarray:
    arr = as_numpy(value)
    if arr.ndim != 1:
        raise ValueError(f"datum {index}: loss_fn_inputs[{key!r}] must be 1-D, got shape {arr.shape}")
    return arr


def unpack_datums(
    data: Sequence[tinker.Datum],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Concatenate sampler logprobs, advantages and mask of all datums.

    Returns float64 ``sampler_logprobs_N``, ``advantages_N``, ``mask_N`` (1.0/0.0) and the per-datum
    lengths T. Copies, never views, so callers cannot mutate the datums through the result.
    """
    columns: dict[str, list[np.ndarray]] = {k: [] for k in _INPUT_KEYS}
    lengths: list[int] = []
    for i, datum in enumerate(data):
        inputs = getattr(datum, "loss_fn_inputs", None)
        if inputs is None:
            raise TypeError(f"datum {i}: expected a tinker.Datum with loss_fn_inputs, got {type(datum).__name__}")
        missing = [k for k in _INPUT_KEYS if k not in inputs]
        if missing:
            raise ValueError(f"datum {i}: loss_fn_inputs lacks {missing} (needs {list(_INPUT_KEYS)})")
        arrays = {k: _as_numpy_1d(inputs[k], k, i) for k in _INPUT_KEYS}
        length = arrays["mask"].shape[0]
        for k, arr in arrays.items():
            if arr.shape[0] != length:
                raise ValueError(f"datum {i}: loss_fn_inputs[{k!r}] has length {arr.shape[0]}, mask has {length}")
            columns[k].append(arr.astype(np.float64, copy=False))
        lengths.append(length)
    if not lengths:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty.clone(), empty.clone(), []
    sampler_N, adv_N, mask_N = (torch.from_numpy(np.concatenate(columns[k])) for k in _INPUT_KEYS)
    bad = ~((mask_N == 0) | (mask_N == 1))
    if bool(bad.any()):
        raise ValueError(f"loss mask must be 0/1, found {mask_N[bad][:5].tolist()}")
    return sampler_N, adv_N, mask_N, lengths


def _check_finite(name: str, values_N: torch.Tensor, loss_N: torch.Tensor) -> None:
    bad = loss_N & ~torch.isfinite(values_N)
    if bool(bad.any()):
        idx = int(bad.nonzero()[0, 0])
        raise ValueError(f"non-finite {name} on a loss token (packed index {idx}): {float(values_N[idx])}")


def token_terms(
    logprobs_N: torch.Tensor,
    sampler_logprobs_N: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_N: torch.Tensor,
    cfg: LossConfig,
) -> TokenTerms:
    """Per-token decisions of both rules, detached, in float64."""
    n = logprobs_N.shape[0]
    for name, t in (("sampler_logprobs_N", sampler_logprobs_N), ("advantages_N", advantages_N), ("mask_N", mask_N)):
        if t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs_N has ({n},)")
    lp_N = logprobs_N.detach().to(torch.float64)
    mu_N = sampler_logprobs_N.detach().to(torch.float64)
    adv_N = advantages_N.detach().to(torch.float64)
    loss_N = mask_N.detach() != 0
    _check_finite("current logprob", lp_N, loss_N)
    _check_finite("sampler logprob", mu_N, loss_N)
    _check_finite("advantage", adv_N, loss_N)
    zero = torch.zeros((), dtype=torch.float64)
    # Junk on non-loss positions never reaches exp(): no inf/NaN leaks into any term.
    lp_safe = torch.where(loss_N, lp_N, zero)
    mu_safe = torch.where(loss_N, mu_N, zero)
    diff_N = torch.where(loss_N, lp_safe.exp() - mu_safe.exp(), zero)
    ratio_N = torch.where(loss_N, (lp_safe - mu_safe).exp(), torch.ones((), dtype=torch.float64))
    pos_N = adv_N > 0
    neg_N = adv_N < 0
    nonzero_N = loss_N & (pos_N | neg_N)
    # Directional strict mask; A == 0 takes the negative branch (changes the record, not the grad).
    drop_N = torch.where(pos_N, diff_N > cfg.dppo_delta, diff_N < -cfg.dppo_delta)
    keep_N = loss_N & ~drop_N
    clipped_N = loss_N & ((pos_N & (ratio_N > 1 + cfg.ppo_eps)) | (neg_N & (ratio_N < 1 - cfg.ppo_eps)))
    # Only a KEPT token is shaped by the cap; a dropped one gets no gradient at all, so the cap
    # never counts a token the mask already removed.
    cap_hit_N = nonzero_N & keep_N & (ratio_N > cfg.ratio_cap)
    return TokenTerms(
        prob_diff_N=diff_N,
        ratio_N=ratio_N,
        dppo_keep_N=keep_N,
        ppo_clipped_N=clipped_N,
        ratio_cap_hit_N=cap_hit_N,
        loss_token_N=loss_N,
        nonzero_adv_N=nonzero_N,
        advantages_N=adv_N,
    )


def _frac(num: int, den: int) -> float:
    return float(num) / float(den) if den > 0 else 0.0


def loss_metrics(terms: TokenTerms, cfg: LossConfig | None = None) -> dict[str, float]:
    """Plain-float metrics over loss tokens; names in METRIC_NAMES (docs/architecture.md)."""
    loss_N = terms.loss_token_N
    nonzero_N = terms.nonzero_adv_N
    n_loss = int(loss_N.sum())
    n_nonzero = int(nonzero_N.sum())
    removed_N = nonzero_N & ~terms.dppo_keep_N
    adv_N = terms.advantages_N
    n_removed = int(removed_N.sum())
    n_clipped = int(terms.ppo_clipped_N.sum())
    delta = cfg.dppo_delta if cfg is not None else DPPO_DELTA
    diff_L = terms.prob_diff_N[loss_N]
    metrics = {
        "tokens/loss": float(n_loss),
        "tokens/nonzero_adv": float(n_nonzero),
        "dppo/removed": float(n_removed),
        "dppo/removed_pos_adv": float((removed_N & (adv_N > 0)).sum()),
        "dppo/removed_neg_adv": float((removed_N & (adv_N < 0)).sum()),
        "dppo/masked_frac_loss_tokens": _frac(n_removed, n_loss),
        "dppo/masked_frac_nonzero_adv": _frac(n_removed, n_nonzero),
        "dppo/mask_zero_adv": float((loss_N & ~nonzero_N & ~terms.dppo_keep_N).sum()),
        "dppo/exceed_pos": float((diff_L > delta).sum()),
        "dppo/exceed_neg": float((diff_L < -delta).sum()),
        "dppo/ratio_cap_hits": float(terms.ratio_cap_hit_N.sum()),
        "ppo/clipped": float(n_clipped),
        "ppo/clip_frac_loss_tokens": _frac(n_clipped, n_loss),
        "ppo/clip_frac_nonzero_adv": _frac(n_clipped, n_nonzero),
    }
    if n_loss > 0:
        # numpy's partition-based linear quantile: same definition as torch.quantile, ~10x cheaper.
        d_L = diff_L.numpy()
        abs_L = np.abs(d_L)
        q_signed = np.quantile(d_L, (0.9, 0.99))
        q_abs = np.quantile(abs_L, (0.9, 0.99))
        metrics.update(
            {
                "drift/signed_p90": float(q_signed[0]),
                "drift/signed_p99": float(q_signed[1]),
                "drift/signed_max": float(d_L.max()),
                "drift/signed_min": float(d_L.min()),
                "drift/abs_p90": float(q_abs[0]),
                "drift/abs_p99": float(q_abs[1]),
                "drift/abs_max": float(abs_L.max()),
            }
        )
    else:
        for name in METRIC_NAMES:
            if name.startswith("drift/"):
                metrics[name] = 0.0
    if cfg is not None:
        metrics["loss/arm_dppo"] = 1.0 if cfg.loss == DPPO_LOSS else 0.0
        metrics["loss/normalization_sum"] = 1.0 if cfg.normalization == "sum" else 0.0
    return metrics


def packed_loss(
    logprobs_N: torch.Tensor,
    sampler_logprobs_N: torch.Tensor,
    terms: TokenTerms,
    cfg: LossConfig,
) -> torch.Tensor:
    """Scalar loss with gradient into ``logprobs_N`` (float64 arithmetic, zero grad off the loss):
    the registered rule's per-token loss, summed, then normalized."""
    zero = torch.zeros((), dtype=torch.float64)
    # Only gradient-bearing tokens enter the graph; the rest get an exact 0 gradient.
    active_N = terms.nonzero_adv_N
    lp_N = torch.where(active_N, logprobs_N.to(torch.float64), zero)
    mu_N = torch.where(active_N, sampler_logprobs_N.detach().to(torch.float64), zero)
    adv_N = torch.where(active_N, terms.advantages_N, zero)
    token_loss_N = get_loss(cfg.loss).token_loss(lp_N, mu_N, adv_N, terms, cfg)
    total = token_loss_N.sum()
    if cfg.normalization == "token_mean":
        n_loss = int(terms.loss_token_N.sum())
        total = total / max(n_loss, 1)
    return total


def normalization_declaration(mode: Normalization) -> dict[str, str]:
    """What `effective-config.json` and the reports declare about the loss normalization."""
    if mode not in _NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {_NORMALIZATIONS}, got {mode!r}")
    ours = (
        "the summed token losses of one forward_backward_custom call (one minibatch) divided by the number "
        "of loss tokens (mask 1) in that call, zero-advantage tokens included"
        if mode == "token_mean"
        else "the token losses of one forward_backward_custom call (one minibatch) summed over its loss tokens"
    )
    return {
        "mode": mode,
        "definition": ours,
        "applies_to": "both arms' trained loss, the activation-gate pilot, the bounded diagnostic and the feasibility pilot",
        "cookbook_ppo": (
            "tinker-cookbook rl/train.py trains with the service's built-in loss_fn ('ppo' or "
            "'importance_sampling'), whose per-token losses are summed over every loss token of the "
            "forward_backward call: no division by the token count"
        ),
        "difference": (
            "token_mean gradient = sum gradient / loss tokens of the minibatch; under AdamW a constant "
            "rescale changes updates only through eps, but minibatches with different token counts "
            "are weighted differently than under the sum"
            if mode == "token_mean"
            else "the same convention as the cookbook's ppo"
        ),
    }


def packed_loss_and_metrics(
    logprobs_N: torch.Tensor,
    sampler_logprobs_N: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_N: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    terms = token_terms(logprobs_N, sampler_logprobs_N, advantages_N, mask_N, cfg)
    return packed_loss(logprobs_N, sampler_logprobs_N, terms, cfg), loss_metrics(terms, cfg)


def _concat_logprobs(
    data: Sequence[tinker.Datum], logprobs_list: Sequence[torch.Tensor], lengths: list[int]
) -> torch.Tensor:
    if len(logprobs_list) != len(data):
        raise ValueError(f"got {len(logprobs_list)} logprob tensors for {len(data)} datums")
    for i, (lp, length) in enumerate(zip(logprobs_list, lengths)):
        if lp.ndim != 1 or lp.shape[0] != length:
            raise ValueError(
                f"datum {i}: logprobs tensor has shape {tuple(lp.shape)}, loss inputs have length {length}"
            )
    if not logprobs_list:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([lp.to(torch.float64) for lp in logprobs_list])


def datum_token_terms(
    data: Sequence[tinker.Datum], logprobs_list: Sequence[torch.Tensor], cfg: LossConfig
) -> TokenTerms:
    """Per-token terms for a list of datums and their current logprobs (instrumentation entry)."""
    sampler_N, adv_N, mask_N, lengths = unpack_datums(data)
    logprobs_N = _concat_logprobs(data, logprobs_list, lengths).detach()
    return token_terms(logprobs_N, sampler_N, adv_N, mask_N, cfg)


# What `forward_backward_custom` calls: (datums, their current logprobs) -> (scalar loss, metrics).
CustomLossFn = Callable[[list[tinker.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class PackedLoss:
    """``loss_fn(data, logprobs_list) -> (scalar loss, metrics)`` for ``forward_backward_custom``:
    the packed path at `loss_config`, whatever registered loss it names."""

    loss_config: LossConfig

    def __call__(
        self, data: Sequence[tinker.Datum], logprobs_list: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        sampler_N, adv_N, mask_N, lengths = unpack_datums(data)
        logprobs_N = _concat_logprobs(data, logprobs_list, lengths)
        loss, metrics = packed_loss_and_metrics(logprobs_N, sampler_N, adv_N, mask_N, self.loss_config)
        if not loss.requires_grad:
            # No gradient-bearing token (or no logprob requires grad): still give every tensor a grad.
            loss = loss + sum((lp * 0.0).sum() for lp in logprobs_list if lp.requires_grad)
        return loss, metrics


def make_loss_fn(cfg: LossConfig) -> PackedLoss:
    """The `forward_backward_custom` loss of one arm (`PackedLoss`)."""
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"make_loss_fn needs a LossConfig, got {type(cfg).__name__}")
    return PackedLoss(cfg)

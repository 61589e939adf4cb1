"""The loss registry: every loss a spec's arm may name is one entry (verl `core_algos` style: one
registry, one signature).

An entry holds the loss's packed per-token rule (called by `losses.packed_loss`), its
parameters, the loss-call metrics that describe its decisions, the activation-gate metrics it
provides, its independent numpy reference (`references.py`) and its golden cases. A plan naming
an unregistered loss is refused at load (`plans.run_config`), before any service call. Adding a
loss is `register_loss(LossEntry(...))` with its reference and golden file, nothing else
(`docs/plans.md`). This module imports no torch (plan loading stays cheap): the rules use the
tensors' own methods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from dppo_harness.constants import DPPO_DELTA, DPPO_RATIO_CAP, LOG_RATIO_CLAMP_MAX, PPO_EPS
from dppo_harness.loss import references

if TYPE_CHECKING:
    import torch

    from dppo_harness.loss.losses import LossConfig, TokenTerms

Normalization = Literal["sum", "token_mean"]

# The exchange's two loss names (the spec's `arms[*].loss`).
DPPO_LOSS = "dppo_divergence_mask"
GRPO_LOSS = "grpo_clip_eps0.2"

DPPO_METRIC_NAMES = (
    "dppo/removed",
    "dppo/removed_pos_adv",
    "dppo/removed_neg_adv",
    "dppo/masked_frac_loss_tokens",
    "dppo/masked_frac_nonzero_adv",
    "dppo/mask_zero_adv",
    "dppo/exceed_pos",
    "dppo/exceed_neg",
    "dppo/ratio_cap_hits",
)
PPO_METRIC_NAMES = ("ppo/clipped", "ppo/clip_frac_loss_tokens", "ppo/clip_frac_nonzero_adv")
# Activation-gate metrics the harness measures itself, whatever the losses.
HARNESS_GATE_METRICS = ("executed_updates_per_batch", "executed_base_model")


class UnknownLossError(ValueError):
    """A loss name that is not registered; the message lists the registered ones."""


# One signature for every rule: (lp_N with grad, sampler mu_N, advantages_N, the call's terms,
# its LossConfig) -> per-token loss_N. The inputs are zero off gradient-bearing tokens (loss
# tokens with A != 0); a rule must keep those tokens' loss at exactly 0.
TokenLoss = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "TokenTerms", "LossConfig"], "torch.Tensor"]


@dataclass(frozen=True)
class GoldenCases:
    """Where a loss's golden values live: a JSON file (relative to the project root) whose
    `cases[i]` hold padded inputs (`log_prob`, `rollout_log_prob`, `advantages`,
    `response_mask`, `shape`) and, under `key`, the expected `loss` and `grad_log_prob` at
    `normalization`. `reference_params` are the keyword arguments with which the loss's
    reference reproduces them (a variant of the rule, e.g. verl's clamps; empty: as trained)."""

    file: str
    key: str
    normalization: Normalization
    reference_params: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LossEntry:
    name: str  # as a spec's `arms[*].loss` writes it
    summary: str
    token_loss: TokenLoss
    params: Mapping[str, float]  # the rule's parameters (LossConfig thresholds it pins, or its own)
    # numpy padded reference: ref(lp_BT, mu_BT, adv_BT, mask_BT, normalization, **params) -> RefResult
    reference: Callable[..., references.RefResult]
    golden: GoldenCases
    metric_names: tuple[str, ...] = ()  # the loss-call metrics that describe this rule's decisions
    gate_metrics: Mapping[str, str] = field(default_factory=dict)  # gate metric -> loss-call statistic
    labels: tuple[str, ...] = ()  # how a spec's prose names this loss ("GRPO"): matched in the `baseline` text


LOSSES: dict[str, LossEntry] = {}


def register_loss(entry: LossEntry) -> LossEntry:
    """Add one loss to the registry (a name may be registered once)."""
    if entry.name in LOSSES:
        raise ValueError(f"loss {entry.name!r} is already registered")
    LOSSES[entry.name] = entry
    return entry


def unregister_loss(name: str) -> None:
    """Remove a registered loss (tests that register their own)."""
    LOSSES.pop(name, None)


def loss_names() -> tuple[str, ...]:
    return tuple(sorted(LOSSES))


def get_loss(name: str) -> LossEntry:
    if name not in LOSSES:
        raise UnknownLossError(f"{name!r} is not a registered loss (registered: {', '.join(loss_names())})")
    return LOSSES[name]


def gate_metric_sources() -> dict[str, str]:
    """Every activation-gate metric a registered loss provides -> the loss-call statistic."""
    out: dict[str, str] = {}
    for entry in LOSSES.values():
        out.update(entry.gate_metrics)
    return out


def _dppo_token_loss(
    lp_N: torch.Tensor, mu_N: torch.Tensor, adv_N: torch.Tensor, terms: TokenTerms, cfg: LossConfig
) -> torch.Tensor:
    """DPPO Binary-TV: -A * w * keep * lp with the detached capped weight w = min(exp(min(lp - mu,
    20)), C); no lower clamp on the log-ratio (pinned rule)."""
    log_ratio_N = (lp_N.detach() - mu_N).clamp(max=LOG_RATIO_CLAMP_MAX)
    weight_N = log_ratio_N.exp().clamp(max=cfg.ratio_cap)
    coef_N = (adv_N * weight_N).where(terms.dppo_keep_N & terms.nonzero_adv_N, 0.0)
    return -coef_N * lp_N


def _grpo_token_loss(
    lp_N: torch.Tensor, mu_N: torch.Tensor, adv_N: torch.Tensor, terms: TokenTerms, cfg: LossConfig
) -> torch.Tensor:
    """GRPO clipped ratio (Tinker's `ppo`): -min(r*A, clamp(r, 1-eps, 1+eps)*A), gradient through r."""
    ratio_N = (lp_N - mu_N).exp()
    clamped_N = ratio_N.clamp(1 - cfg.ppo_eps, 1 + cfg.ppo_eps)
    return -(ratio_N * adv_N).minimum(clamped_N * adv_N)


_GOLDEN_FILE = "tests/fixtures/dppo_golden_v1.json"

register_loss(
    LossEntry(
        name=DPPO_LOSS,
        summary="DPPO Binary-TV (arXiv 2602.04879, released-code variant): directional mask |p - q| > delta "
        "against the sampler probability, detached weight min(r, C)",
        token_loss=_dppo_token_loss,
        params={"dppo_delta": DPPO_DELTA, "ratio_cap": DPPO_RATIO_CAP},
        reference=references.ref_dppo,
        golden=GoldenCases(_GOLDEN_FILE, "dppo", "token_mean"),
        metric_names=DPPO_METRIC_NAMES,
        gate_metrics={
            "dppo_masked_token_fraction": "dppo/masked_frac_loss_tokens",
            "policy_drift_abs_p_q90": "drift/abs_p90",
        },
        labels=("DPPO",),
    )
)
register_loss(
    LossEntry(
        name=GRPO_LOSS,
        summary="GRPO clipped ratio, eps 0.2 (Tinker's built-in ppo formula, no dual clip), ratio against the sampler",
        token_loss=_grpo_token_loss,
        params={"ppo_eps": PPO_EPS},
        reference=references.ref_ppo,
        # The golden `grpo_no_dual_clip` entry is verl's vanilla loss: Tinker's ppo plus a +-20
        # log-ratio clamp and a c=1e4 dual clip, which the reference reproduces with these options.
        golden=GoldenCases(
            _GOLDEN_FILE,
            "grpo_no_dual_clip",
            "token_mean",
            {"log_ratio_clamp": LOG_RATIO_CLAMP_MAX, "dual_clip_c": 1e4},
        ),
        metric_names=PPO_METRIC_NAMES,
        gate_metrics={"grpo_clip_fraction": "ppo/clip_frac_loss_tokens"},
        labels=("GRPO",),
    )
)

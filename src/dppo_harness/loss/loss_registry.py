"""The loss registry: every loss a spec's arm may name is one entry (verl `core_algos` style: one
registry, one signature): its packed per-token rule (called by `losses.packed_loss`), its
parameters, the decisions it trains with (whose `terms.LossStats` are then its own), the gate
metrics it provides, its independent numpy reference (`references.py`) and its golden cases
(`python -m dppo_harness.loss.golden`). A plan naming an unregistered loss is refused at load. No
torch import (plan loading stays cheap): the rules use the tensors' own methods.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dppo_harness.constants import DPPO_RATIO_CAP, LOG_RATIO_CLAMP_MAX, PPO_EPS
from dppo_harness.loss import references
from dppo_harness.loss.terms import LossStats, TokenTerms
from dppo_harness.project import project_root

if TYPE_CHECKING:
    import torch

Normalization = Literal["sum", "token_mean"]

# The exchange's two loss names (the spec's `arms[*].loss`).
DPPO_LOSS = "dppo_divergence_mask"
GRPO_LOSS = "grpo_clip_eps0.2"

# The DPPO threshold has one home: the plan that pins the rule (its `fixed_settings.treatment.delta`).
# Every loss config, the golden cases (`python -m dppo_harness.loss.golden`) and the self-test read it
# from the registered entry. Read as JSON: the plans package imports this registry.
DELTA_PLAN = "plans/exp_e6b0965af3-diagnostic-r1.json"


class PinnedDeltaError(ValueError):
    """The plan that pins delta is unreadable or states no usable delta."""


def read_pinned_delta(path: Path) -> float:
    """`fixed_settings.treatment.delta` of the plan at `path`: a number in (0, 1), else one line naming
    the file and what it holds (no default: every loss, golden case and self-test row depends on it)."""
    try:
        value = json.loads(path.read_text())["fixed_settings"]["treatment"]["delta"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PinnedDeltaError(
            f"{path}: no readable fixed_settings.treatment.delta ({type(exc).__name__}: {exc})"
        ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise PinnedDeltaError(f"{path}: fixed_settings.treatment.delta must be a number in (0, 1), got {value!r}")
    return float(value)


DPPO_DELTA = read_pinned_delta(project_root() / DELTA_PLAN)

# Activation-gate metrics the harness measures itself, whatever the losses.
HARNESS_GATE_METRICS = ("executed_updates_per_batch", "executed_base_model")


class UnknownLossError(ValueError):
    """A loss name that is not registered; the message lists the registered ones."""


# One signature for every rule: (lp_N with grad, sampler mu_N, advantages_N, the call's terms and
# their thresholds) -> per-token loss_N. The inputs are zero off gradient-bearing tokens (loss
# tokens with A != 0); a rule must keep those tokens' loss at exactly 0.
TokenLoss = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", TokenTerms], "torch.Tensor"]
# The families of per-token decisions `TokenTerms` holds, by the prefix of their statistics' names.
Decisions = Literal["dppo", "ppo", ""]


@dataclass(frozen=True)
class GoldenCases:
    """A loss's golden values: a JSON file (relative to the project root) whose `cases[i]` hold
    padded inputs and, under `key`, the expected `loss` and `grad_log_prob` at `normalization`;
    `reference_params`: the options with which the reference reproduces them (a variant of the
    rule, e.g. verl's clamps; empty: as trained)."""

    file: str
    key: str
    normalization: Normalization
    reference_params: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LossEntry:
    name: str  # as a spec's `arms[*].loss` writes it
    token_loss: TokenLoss
    params: Mapping[str, float]  # the rule's parameters (LossConfig thresholds it pins, or its own)
    # numpy padded reference: ref(lp_BT, mu_BT, adv_BT, mask_BT, normalization, **params) -> RefResult
    reference: Callable[..., references.RefResult]
    golden: GoldenCases
    # The decisions the rule trains with: their statistics are the loss's own; every loss call
    # also counts the other family on its tensors, as a counterfactual ("": neither).
    decisions: Decisions = ""
    gate_metrics: Mapping[str, str] = field(default_factory=dict)  # gate metric -> loss-call statistic

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The returned loss-call metrics that describe this rule's own decisions."""
        prefix = f"{self.decisions}/"
        return tuple(n for n in LossStats.names(returned=True) if self.decisions and n.startswith(prefix))


LOSSES: dict[str, LossEntry] = {}


def register_loss(entry: LossEntry) -> LossEntry:
    """Add one loss to the registry (a name may be registered once)."""
    if entry.name in LOSSES:
        raise ValueError(f"loss {entry.name!r} is already registered")
    LOSSES[entry.name] = entry
    return entry


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


@dataclass(frozen=True)
class ImplementedPath:
    """A correctness-preflight path this harness implements: a spec naming another id (or another
    kind) is refused at load rather than run with a check it did not ask for."""

    id: str
    kind: str
    what: str  # what the harness checks under this id, for the refusal line and the docs


PATH_ID = "grpo_dppo_custom_loss"  # the block's path when no spec names one (the CLI without --spec)
IMPLEMENTED_PATHS = {
    PATH_ID: ImplementedPath(
        PATH_ID, "loss", "both registered losses through forward_backward_custom against the pinned golden values"
    )
}


def implemented_list() -> str:
    return ", ".join(f"{p.id} (kind {p.kind}: {p.what})" for p in IMPLEMENTED_PATHS.values())


def _dppo_token_loss(lp_N: torch.Tensor, mu_N: torch.Tensor, adv_N: torch.Tensor, terms: TokenTerms) -> torch.Tensor:
    """DPPO Binary-TV (arXiv 2602.04879, released-code variant): -A * w * keep * lp with the detached capped weight w = min(exp(min(lp - mu,
    20)), C); no lower clamp on the log-ratio (pinned rule)."""
    log_ratio_N = (lp_N.detach() - mu_N).clamp(max=LOG_RATIO_CLAMP_MAX)
    weight_N = log_ratio_N.exp().clamp(max=terms.ratio_cap)
    coef_N = (adv_N * weight_N).where(terms.dppo_keep_N & terms.nonzero_adv_N, 0.0)
    return -coef_N * lp_N


def _grpo_token_loss(lp_N: torch.Tensor, mu_N: torch.Tensor, adv_N: torch.Tensor, terms: TokenTerms) -> torch.Tensor:
    """GRPO clipped ratio (Tinker's `ppo`): -min(r*A, clamp(r, 1-eps, 1+eps)*A), gradient through r."""
    ratio_N = (lp_N - mu_N).exp()
    clamped_N = ratio_N.clamp(1 - terms.ppo_eps, 1 + terms.ppo_eps)
    return -(ratio_N * adv_N).minimum(clamped_N * adv_N)


_GOLDEN_FILE = "tests/fixtures/dppo_golden_v1.json"

register_loss(
    LossEntry(
        name=DPPO_LOSS,
        token_loss=_dppo_token_loss,
        params={"dppo_delta": DPPO_DELTA, "ratio_cap": DPPO_RATIO_CAP},
        reference=references.ref_dppo,
        golden=GoldenCases(_GOLDEN_FILE, "dppo", "token_mean"),
        decisions="dppo",
        gate_metrics={
            "dppo_masked_token_fraction": "dppo/masked_frac_loss_tokens",
            "policy_drift_abs_p_q90": "drift/abs_p90",
        },
    )
)
register_loss(
    LossEntry(
        name=GRPO_LOSS,
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
        decisions="ppo",
        gate_metrics={"grpo_clip_fraction": "ppo/clip_frac_loss_tokens"},
    )
)

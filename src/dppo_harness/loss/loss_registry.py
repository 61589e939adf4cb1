"""The loss registry: every loss a spec's arm may name is one entry (verl `core_algos` style: one
registry, one signature): its packed per-token rule (called by `losses.packed_loss`), its
parameters, the decisions it trains with (a `terms.Decision`, whose statistics are then its own),
the gate metrics it provides with their definitions, its independent numpy reference
(`references.py`) and its golden cases (`python -m dppo_harness.loss.golden`). A plan naming an
unregistered loss is refused at load. No torch import (plan loading stays cheap): the rules use
the tensors' own methods.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dppo_harness.constants import DPPO_RATIO_CAP, LOG_RATIO_CLAMP_MAX, PPO_EPS
from dppo_harness.loss import references
from dppo_harness.loss.terms import DPPO_MASK, PPO_CLIP, Decision, TokenTerms
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

# Activation-gate metrics the harness measures itself, whatever the losses, and their definitions.
HARNESS_GATE_METRICS = {
    "executed_updates_per_batch": "optim_step calls that returned, counted per rollout batch; the "
    "value is that count when it is the same for every batch, else the list (which fails)",
    "executed_base_model": "the model that computes: get_info().model_data.model_name of the pilot's training "
    "client (the embedded server names its stand-in there)",
}


class UnknownLossError(ValueError):
    """A loss name that is not registered; the message lists the registered ones."""


# One signature for every rule: (lp_N with grad, sampler mu_N, advantages_N, the call's terms and
# their thresholds) -> per-token loss_N. The inputs are zero off gradient-bearing tokens (loss
# tokens with A != 0); a rule must keep those tokens' loss at exactly 0.
TokenLoss = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", TokenTerms], "torch.Tensor"]


@dataclass(frozen=True)
class GateMetric:
    """An activation-gate metric a loss provides: a loss-call statistic of the last update of each
    pilot step, and its definition in the gate report (`{stat}`, `{last}`: the pilot's last update,
    "4th", and the loss call's thresholds by their `LossConfig` names are filled in)."""

    stat: str
    definition: str = (
        "{stat} of the loss call of the last minibatch update of each pilot step, unweighted mean over pilot steps"
    )


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
    # also counts the other families on its tensors, as counterfactuals (None: it trains with none).
    decisions: Decision | None = None
    gate_metrics: Mapping[str, GateMetric] = field(default_factory=dict)


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


def gate_metric_sources() -> dict[str, GateMetric]:
    """Every activation-gate metric a registered loss provides."""
    out: dict[str, GateMetric] = {}
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
        decisions=DPPO_MASK,
        gate_metrics={
            "dppo_masked_token_fraction": GateMetric(
                DPPO_MASK.fraction(),
                "{stat} (A != 0 tokens removed by the mask / all loss tokens) of the loss call of the last ({last}) "
                "minibatch update of each pilot step, unweighted mean over pilot steps",
            ),
            "policy_drift_abs_p_q90": GateMetric(
                "drift/abs_p90",
                "{stat} (q90 of |p_current - p_sampler| over loss tokens) of the loss call of the last ({last}) "
                "minibatch update of each pilot step, unweighted mean over pilot steps",
            ),
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
        decisions=PPO_CLIP,
        gate_metrics={
            "grpo_clip_fraction": GateMetric(
                PPO_CLIP.fraction(),
                "{stat}: eps={ppo_eps:g} clip removing the gradient, counted counterfactually on the same tensors "
                "as the DPPO metric (last update), mean over pilot steps",
            )
        },
    )
)

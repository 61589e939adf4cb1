"""The arms of an experiment spec and what its decision compares: each arm's role, loss and
optimizer, and each decision criterion resolved to two arms.

The baseline is the arm the plan's resolution file names; every other arm is a treatment. Each
criterion's +1/-1 weights name arms, or the roles `treatment`/`baseline` when a role names one arm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.models import ExperimentSpec, OptimizerConfig

Role = Literal["baseline", "treatment"]
# What the frozen evaluator scores per item (evaluation.METRIC): the only criterion metric.
SCORED_METRICS = ("accuracy",)
# Each scored metric's range: a criterion's bounds must be it (a narrower one refuses real
# observations; a wider one inflates the interval until no verdict is reachable).
METRIC_RANGES: dict[str, tuple[float, float]] = {"accuracy": (0.0, 1.0)}
DECISION_METHODS = ("paired_hoeffding",)


@dataclass(frozen=True)
class ArmConfig:
    name: str
    loss: str  # a registered loss name
    role: Role
    seed: int
    lr: float
    updates_per_batch: int
    optimizer: str  # the optimizer family the restoration preflight names
    optimizer_config: OptimizerConfig

    @property
    def adam(self) -> dict[str, float]:
        """AdamParams of this arm's updates (the spec declares no weight decay or clipping: 0)."""
        c = self.optimizer_config
        return {
            "learning_rate": self.lr,
            "beta1": c.beta1,
            "beta2": c.beta2,
            "eps": c.eps,
            "weight_decay": c.weight_decay or 0.0,
            "grad_clip_norm": c.grad_clip_norm or 0.0,
        }

    def adam_config_requested(self) -> dict[str, float]:
        """The spec's optimizer_config keys (what an optimizer check compares)."""
        return {k: v for k, v in self.optimizer_config.model_dump().items() if v is not None}


@dataclass(frozen=True)
class CriterionConfig:
    id: str
    metric: str
    treatment: str  # arm with weight +1
    baseline: str  # arm with weight -1
    margin: float
    bounds: tuple[float, float]
    weights: Mapping[str, float]  # as the spec writes them (role or arm names)


def _fail(at: str, msg: str) -> PlanError:
    return PlanError(f"{at}: {msg}")


def resolve_arms(spec: ExperimentSpec, base: str) -> tuple[ArmConfig, ...]:
    """Each arm with its role (`base` is the baseline arm's name) and the optimizer the restoration
    preflight names for it, the baseline first and the treatments in spec order."""
    names = [a.name for a in spec.arms]
    opt: dict[str, tuple[str, OptimizerConfig]] = {}
    for g in spec.restoration_preflight.groups:
        for r in g.arms:
            if r.name in opt:
                raise _fail("restoration_preflight.groups", f"arm {r.name!r} is listed twice")
            opt[r.name] = (r.optimizer, r.optimizer_config)
    extra = sorted(set(opt) - set(names))
    if extra:
        raise _fail("restoration_preflight.groups", f"names arms that are not in arms: {extra}")
    out = []
    for i, a in enumerate(spec.arms):
        if a.name not in opt:
            raise _fail("restoration_preflight.groups", f"no optimizer_config for arm {a.name!r}")
        family, cfg = opt[a.name]
        if cfg.learning_rate != a.lr:
            raise _fail(
                f"arms[{i}].lr",
                f"{a.lr} != restoration_preflight optimizer_config.learning_rate {cfg.learning_rate} of arm {a.name!r}",
            )
        out.append(
            ArmConfig(
                a.name,
                a.loss,
                "baseline" if a.name == base else "treatment",
                a.seed,
                a.lr,
                a.updates_per_batch,
                family,
                cfg,
            )
        )
    if len(out) < 2:
        raise _fail("arms", "a paired comparison needs a baseline and at least one treatment arm")
    return tuple(sorted(out, key=lambda x: x.role))  # stable: baseline first, treatments in spec order


def resolve_criteria(spec: ExperimentSpec, arms: tuple[ArmConfig, ...]) -> tuple[CriterionConfig, ...]:
    """Each decision criterion with its +1 and -1 weights resolved to arms (`arms`: baseline first),
    its metric scored, its bounds the metric's range; the decision rule's method, seeds and alpha
    are ones the harness runs."""
    rule = spec.decision_rule
    if rule.method not in DECISION_METHODS:
        raise _fail(
            "decision_rule.method", f"{rule.method!r} is not implemented (implemented: {list(DECISION_METHODS)})"
        )
    seeds = sorted({a.seed for a in arms})
    if not set(seeds) <= set(rule.seeds):
        raise _fail("decision_rule.seeds", f"{rule.seeds} does not schedule the arms' seed {seeds}")
    unrun = sorted(set(rule.seeds) - set(seeds))
    if unrun:
        raise _fail(
            "decision_rule.seeds",
            f"{rule.seeds} schedules seed {unrun}, which no arm runs (the arms run "
            f"{seeds}); every scheduled seed needs every arm",
        )
    if not 0 < rule.alpha < 1:
        raise _fail("decision_rule.alpha", f"{rule.alpha} must be in (0, 1)")
    treatments = [a.name for a in arms if a.role == "treatment"]
    names = {a.name for a in arms}

    def arm_of(key: str, at: str) -> str:
        if key in names:
            return key
        if key == "baseline":
            return arms[0].name
        if key == "treatment":
            if len(treatments) != 1:
                raise _fail(
                    at,
                    f"names the role 'treatment', but the spec has {len(treatments)} treatment arms "
                    f"({treatments}); name the arm instead",
                )
            return treatments[0]
        raise _fail(at, f"{key!r} is neither an arm ({sorted(names)}) nor a role (treatment, baseline)")

    out = []
    for i, c in enumerate(rule.criteria):
        at = f"decision_rule.criteria[{i}].weights"
        if sorted(c.weights.values()) != [-1, 1]:
            raise _fail(at, f"{c.weights}: only a paired difference (+1 one arm, -1 another) is implemented")
        if c.metric not in SCORED_METRICS:
            raise _fail(
                f"decision_rule.criteria[{i}].metric",
                f"{c.metric!r} is not scored by the evaluator (scores: {list(SCORED_METRICS)})",
            )
        pos = arm_of(next(k for k, w in c.weights.items() if w == 1), at)
        neg = arm_of(next(k for k, w in c.weights.items() if w == -1), at)
        if pos == neg:
            raise _fail(at, f"both weights resolve to arm {pos!r}")
        lo, hi = c.bounds
        if not lo < hi:
            raise _fail(f"decision_rule.criteria[{i}].bounds", f"{c.bounds}: lower bound must be below upper")
        if (lo, hi) != METRIC_RANGES[c.metric]:
            raise _fail(
                f"decision_rule.criteria[{i}].bounds",
                f"{c.bounds} is not the range of {c.metric} {list(METRIC_RANGES[c.metric])}",
            )
        if not abs(c.margin) < hi - lo:
            raise _fail(
                f"decision_rule.criteria[{i}].margin",
                f"{c.margin} is outside the difference's range ({lo - hi}, {hi - lo}) of {c.metric}",
            )
        out.append(CriterionConfig(c.id, c.metric, pos, neg, c.margin, (lo, hi), dict(c.weights)))
    if len({c.id for c in out}) != len(out):
        raise _fail("decision_rule.criteria", "criterion ids must be unique")
    return tuple(out)

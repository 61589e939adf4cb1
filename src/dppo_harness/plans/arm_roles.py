"""The arms of an experiment spec and what its decision compares: each arm's role, loss and
optimizer, and each decision criterion resolved to two arms.

The baseline comes from the spec's `baseline` text (an arm name, else a registered loss's label
such as "GRPO"); every other arm is a treatment. The hypothesis and the estimand, where they say
"X minus Y" or "... than Y", must agree with it, and so must each criterion's +1/-1 weights (arm
names, or the roles `treatment`/`baseline` when a role names one arm).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from dppo_harness.loss import loss_registry as losses
from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.models import ExperimentSpec, OptimizerConfig
from dppo_harness.plans.prose import word_re

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


def _losses_named(text: str) -> list[tuple[int, str, str]]:
    """(position, registered loss, label) of every registered loss `text` names, in order."""
    hits = []
    for entry in losses.LOSSES.values():
        for label in (*entry.labels, entry.name):
            for m in word_re(label).finditer(text):
                hits.append((m.start(), entry.name, label))
    return sorted(hits)


def _arm_named(spec: ExperimentSpec, token: str) -> str | None:
    """The arm a word of the spec's prose refers to: an arm name, or a registered loss's label or
    name when one arm trains that loss; None when it refers to no arm."""
    for a in spec.arms:
        if a.name == token:
            return a.name
    for _, loss, _label in _losses_named(token):
        with_loss = [a.name for a in spec.arms if a.loss == loss]
        if len(with_loss) == 1:
            return with_loss[0]
    return None


_MINUS = re.compile(r"(?<![\w-])([\w.-]+)\s+minus\s+(?:the\s+)?([\w.-]+)")
_THAN = re.compile(r"\bthan\s+(?:the\s+)?([\w.-]+)")


def stated_differences(spec: ExperimentSpec) -> list[tuple[str, str, str, str]]:
    """(field, sentence part, arm with +1, arm with -1) of every "X minus Y" and "... than Y" the
    hypothesis and the estimand state, where both sides name arms (the +1 arm is "" for "than")."""
    out = []
    for at, text in (("hypothesis", spec.hypothesis), ("decision_rule.estimand", spec.decision_rule.estimand)):
        for m in _MINUS.finditer(text):
            pos, neg = _arm_named(spec, m.group(1)), _arm_named(spec, m.group(2))
            if pos and neg and pos != neg:
                out.append((at, m.group(0), pos, neg))
        for m in _THAN.finditer(text):
            neg = _arm_named(spec, m.group(1))
            if neg:
                out.append((at, m.group(0), "", neg))
    return out


def baseline_arm(spec: ExperimentSpec) -> tuple[str, str]:
    """(baseline arm name, how it was told) from the spec's `baseline` text: the one arm it names,
    else the one arm whose registered loss it names (by label or loss name; a text naming several
    losses is refused). The hypothesis and the estimand, where they say what is compared against
    what, must agree."""
    text = spec.baseline
    named = [a.name for a in spec.arms if word_re(a.name).search(text)]
    if len(named) > 1:
        raise _fail("baseline", f"names several arms ({named}); it must name one")
    if len(named) == 1:
        base, how = named[0], f"the baseline text names arm {named[0]!r}"
    else:
        hits = _losses_named(text)
        if not hits:
            raise _fail(
                "baseline",
                f"names no arm ({[a.name for a in spec.arms]}) and no registered loss "
                f"({', '.join(losses.loss_names())}, or their labels), so the baseline arm is unknown",
            )
        named_losses = list(dict.fromkeys(loss for _, loss, _ in hits))
        if len(named_losses) > 1:
            labels = list(dict.fromkeys(label for _, _, label in hits))
            raise _fail(
                "baseline",
                f"names several losses ({', '.join(labels)}), so which arm is the baseline is "
                f"ambiguous; name the baseline arm ({[a.name for a in spec.arms]}) in the text",
            )
        _, loss, label = hits[0]
        with_loss = [a.name for a in spec.arms if a.loss == loss]
        if len(with_loss) != 1:
            raise _fail(
                "baseline",
                f"names the loss {loss!r}, which {len(with_loss)} arms train ({with_loss}); "
                "name the baseline arm in the baseline text",
            )
        base, how = (
            with_loss[0],
            (
                f"the baseline text names {label!r} (registered loss {loss!r}) first, the loss "
                f"of arm {with_loss[0]!r} only"
            ),
        )
    for at, phrase, pos, neg in stated_differences(spec):
        if neg != base or pos == base:
            raise _fail(
                at,
                f"{phrase!r} compares against arm {neg!r}, but {how}, so arm {base!r} is the "
                "baseline; the decision would measure the opposite difference",
            )
    return base, how


def resolve_arms(spec: ExperimentSpec) -> tuple[tuple[ArmConfig, ...], str]:
    """(arms, how the baseline was told): each arm with its role and the optimizer the restoration
    preflight names for it, the baseline first and the treatments in spec order."""
    base, how = baseline_arm(spec)
    opt: dict[str, tuple[str, OptimizerConfig]] = {}
    for g in spec.restoration_preflight.groups:
        for r in g.arms:
            if r.name in opt:
                raise _fail("restoration_preflight.groups", f"arm {r.name!r} is listed twice")
            opt[r.name] = (r.optimizer, r.optimizer_config)
    names = [a.name for a in spec.arms]
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
    return tuple(sorted(out, key=lambda x: x.role)), how  # stable: baseline first, treatments in spec order


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
    differences = stated_differences(spec)

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
        for at_s, phrase, stated_pos, stated_neg in differences:
            if (stated_pos or pos, stated_neg) == (neg, pos):
                raise _fail(at, f"measures {pos} minus {neg}, but {at_s} states {phrase!r}")
        out.append(CriterionConfig(c.id, c.metric, pos, neg, c.margin, (lo, hi), dict(c.weights)))
    if len({c.id for c in out}) != len(out):
        raise _fail("decision_rule.criteria", "criterion ids must be unique")
    return tuple(out)

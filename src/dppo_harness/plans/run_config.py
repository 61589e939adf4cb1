"""The typed run configuration of an experiment spec, built once at plan load.

`build_run_config(spec)` turns a validated `ExperimentSpec` into the `RunConfig` every stage
reads: arms with their roles, losses and optimizer settings; the sampling schedule, whose values
the spec states only in its `method` prose (each one carrying its sentence, `prose.Stated`); the
sizes; the gate checks; the decision criteria resolved to arms. It refuses, with one line naming
the field, a spec that the harness cannot run as written:

- prose and structured fields disagree (batch_size != groups_per_batch x group_size, steps !=
  rollout steps x updates_per_batch, LoRA rank, lr, seed or test items stated differently);
- an arm names an unregistered loss (`loss_registry.LOSSES`), the dataset is not registered
  (`dataset.DATASETS`), a gate check's metric is provided by no registered loss;
- roles cannot be told: the baseline comes from the spec's `baseline` text (an arm name, else a
  registered loss's label such as "GRPO"), every other arm is a treatment; each criterion's
  +1/-1 weights name arms or the roles `treatment`/`baseline` (a role must name one arm).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import JsonValue

from dppo_harness.data import dataset
from dppo_harness.json_types import JsonObject
from dppo_harness.loss import loss_registry as losses
from dppo_harness.plans.loss_params import check_loss_statements
from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.models import Budget, ExperimentSpec, GateCheck, OptimizerConfig
from dppo_harness.plans.prose import REQUIRED, Settlements, Stated, parse_method, require, stated_values, word_re

Role = Literal["baseline", "treatment"]
# What the frozen evaluator scores per item (evaluation.METRIC): the only criterion metric.
SCORED_METRICS = ("accuracy",)
# Each scored metric's range: a criterion's bounds must be it (a narrower one refuses real
# observations; a wider one inflates the interval until no verdict is reachable).
METRIC_RANGES: dict[str, tuple[float, float]] = {"accuracy": (0.0, 1.0)}
DECISION_METHODS = ("paired_hoeffding",)
# The spec declares no loss normalization; both arms use the diagnostic plan's token mean.
NORMALIZATION: losses.Normalization = "token_mean"
# The gate's pilot length when its reason text states none (the saved spec says "A 5-step pilot").
DEFAULT_PILOT_STEPS = 5


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


@dataclass(frozen=True)
class RunConfig:
    base_model: str
    lora_rank: int
    dataset: str  # a registered dataset name
    train_items: int  # dataset.n_examples: train prompts the run may use
    max_seq_len: int  # prompt + sampled tokens, at most
    arms: tuple[ArmConfig, ...]  # the baseline first, then the treatments in spec order
    baseline_source: str  # how the baseline arm was told from the spec's text
    rollout_steps: int  # rollout batches per arm
    optimizer_steps: int  # spec.steps
    updates_per_batch: int
    batch_size: int
    groups_per_batch: Stated
    group_size: Stated
    temperature: Stated
    max_tokens: Stated
    minibatches_per_batch: Stated
    eval_items: int
    gate_pilot_steps: Stated  # the activation gate's pilot length (its `reason` text states it)
    decision_method: str
    alpha: float
    criteria: tuple[CriterionConfig, ...]
    gate_checks: tuple[GateCheck, ...]
    budget: Budget
    normalization: losses.Normalization = NORMALIZATION
    prose: Mapping[str, Stated] = field(default_factory=dict)  # every statement parsed from `method`

    def arm(self, name: str) -> ArmConfig:
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(f"no arm named {name!r} (arms: {[a.name for a in self.arms]})")

    @property
    def baseline(self) -> ArmConfig:
        return self.arms[0]

    @property
    def treatments(self) -> tuple[ArmConfig, ...]:
        return self.arms[1:]

    @property
    def seed(self) -> int:
        return self.arms[0].seed

    def schedule_values(self) -> dict[str, Stated]:
        return {
            "groups_per_batch": self.groups_per_batch,
            "group_size": self.group_size,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "minibatches_per_batch": self.minibatches_per_batch,
            "gate_pilot_steps": self.gate_pilot_steps,
        }

    def as_json(self) -> JsonObject:
        """The effective config's view: plain values, and each prose value with its sentence."""
        return {
            "base_model": self.base_model,
            "lora_rank": self.lora_rank,
            "dataset": self.dataset,
            "train_items": self.train_items,
            "max_seq_len": self.max_seq_len,
            "arms": [
                {
                    "name": a.name,
                    "loss": a.loss,
                    "role": a.role,
                    "seed": a.seed,
                    "lr": a.lr,
                    "updates_per_batch": a.updates_per_batch,
                    "optimizer": a.optimizer,
                    "adam": dict(a.adam.items()),
                }
                for a in self.arms
            ],
            "baseline_source": self.baseline_source,
            "rollout_steps": self.rollout_steps,
            "optimizer_steps": self.optimizer_steps,
            "updates_per_batch": self.updates_per_batch,
            "batch_size": self.batch_size,
            **{k: v.value for k, v in self.schedule_values().items()},
            "eval_items": self.eval_items,
            "normalization": self.normalization,
            "decision": {
                "method": self.decision_method,
                "alpha": self.alpha,
                "criteria": [
                    {
                        "id": c.id,
                        "metric": c.metric,
                        "treatment": c.treatment,
                        "baseline": c.baseline,
                        "margin": c.margin,
                        "bounds": list(c.bounds),
                    }
                    for c in self.criteria
                ],
            },
            "gate_checks": [c.model_dump(exclude_none=True) for c in self.gate_checks],
            "stated_in_prose": {k: v.as_json() for k, v in self.schedule_values().items()},
            **(
                {"declared_interpretations": self.declared_interpretations()} if self.declared_interpretations() else {}
            ),
        }

    def declared_interpretations(self) -> list[JsonValue]:
        """The values a resolution file settled ({key, value, sentence, why, file})."""
        values = {**self.prose, "gate_pilot_steps": self.gate_pilot_steps}
        return [
            {"key": k, "value": v.value, "sentence": v.source, "why": v.why, "file": v.field}
            for k, v in values.items()
            if v.why
        ]


def _fail(at: str, msg: str) -> PlanError:
    return PlanError(f"{at}: {msg}")


def _quote(s: Stated) -> str:
    return f"{s.field}: {s.source!r}"


def build_run_config(spec: ExperimentSpec, settlements: Settlements | None = None) -> RunConfig:
    """The RunConfig of a validated spec, or PlanError (one line, field path first). `settlements`
    (the spec's resolution file) settles what the prose leaves open."""
    settlements = settlements or Settlements()
    arm_names = [a.name for a in spec.arms]
    stated = parse_method(spec.method, arm_names=arm_names, settlements=settlements)
    sched = {k: require(stated, k, file=settlements.file) for k in REQUIRED}
    gpb, gs, max_tokens = (int(sched[k].value) for k in ("groups_per_batch", "group_size", "max_tokens"))
    upb, seed = _check_arms(spec)
    if "updates_per_batch" in stated and stated["updates_per_batch"].value != upb:
        s = stated["updates_per_batch"]
        raise _fail(
            "arms",
            f"updates_per_batch {upb} != the {s.value} optimizer steps per batch the method states ({_quote(s)})",
        )

    # steps, batch and the minibatch split: prose against the structured fields
    if spec.steps % upb:
        raise _fail("steps", f"{spec.steps} optimizer steps is not a multiple of updates_per_batch {upb}")
    rollout_steps = spec.steps // upb
    if "rollout_steps" in stated and stated["rollout_steps"].value != rollout_steps:
        s = stated["rollout_steps"]
        raise _fail("steps", f"{spec.steps} != {s.value} rollout steps x updates_per_batch {upb} ({_quote(s)})")
    if "optim_steps" in stated and stated["optim_steps"].value != spec.steps:
        s = stated["optim_steps"]
        raise _fail("steps", f"{spec.steps} != the {s.value} optimizer steps the method states ({_quote(s)})")
    if gpb * gs != spec.batch_size:
        raise _fail(
            "batch_size",
            f"{spec.batch_size} != groups_per_batch {gpb} x group_size {gs} ({_quote(sched['groups_per_batch'])})",
        )
    minibatches = stated.get("minibatches") or Stated(
        upb,
        "arms[*].updates_per_batch",
        "one complete-group minibatch per update (the method states no split)",
        default=True,
    )
    if minibatches.value != upb:
        raise _fail(
            "arms",
            f"updates_per_batch {upb} != the {minibatches.value} minibatches the rollout batch is "
            f"split into ({_quote(minibatches)})",
        )
    if gpb % upb:
        raise _fail("method", f"groups_per_batch {gpb} cannot form {upb} complete-group minibatches")
    for key, structured, at in (
        ("lora_rank", spec.lora_rank, "lora_rank"),
        ("lr", spec.optimizer.lr, "optimizer.lr"),
        ("seed", seed, "arms[*].seed"),
        ("eval_items", spec.eval.n_examples, "eval.n_examples"),
    ):
        said = stated.get(key)
        if said is not None and said.value != structured:
            raise _fail(at, f"{structured} but the method states {said.value} ({_quote(said)})")
    if max_tokens >= spec.max_seq_len:
        raise _fail(
            "max_seq_len",
            f"{spec.max_seq_len} leaves no room for a prompt before max_tokens={max_tokens} "
            f"({_quote(sched['max_tokens'])})",
        )

    data = _check_dataset(spec, rollout_steps, gpb)
    arms = _arms(spec)
    criteria = _criteria(spec, arms)
    _check_gate_metrics(spec)
    _check_gate_plan(spec, upb)
    _check_updates_stated_elsewhere(spec, upb)
    check_loss_statements(spec)
    pilot = parse_method(
        spec.activation_gate.reason,
        "activation_gate.reason",
        keys=("pilot_steps",),
        arm_names=arm_names,
        settlements=settlements,
    ).get("pilot_steps") or Stated(
        DEFAULT_PILOT_STEPS, "harness default", "the activation gate's reason states no 'N-step pilot'", default=True
    )
    return RunConfig(
        base_model=spec.base_model,
        lora_rank=spec.lora_rank,
        dataset=data.name,
        train_items=spec.dataset.n_examples,
        max_seq_len=spec.max_seq_len,
        arms=arms[0],
        baseline_source=arms[1],
        rollout_steps=rollout_steps,
        optimizer_steps=spec.steps,
        updates_per_batch=upb,
        batch_size=spec.batch_size,
        groups_per_batch=sched["groups_per_batch"],
        group_size=sched["group_size"],
        temperature=sched["temperature"],
        max_tokens=sched["max_tokens"],
        minibatches_per_batch=minibatches,
        eval_items=spec.eval.n_examples,
        gate_pilot_steps=pilot,
        decision_method=spec.decision_rule.method,
        alpha=spec.decision_rule.alpha,
        criteria=criteria,
        gate_checks=tuple(spec.activation_gate.checks),
        budget=spec.budget,
        prose=stated,
    )


def _check_updates_stated_elsewhere(spec: ExperimentSpec, upb: int) -> None:
    """The hypothesis, the baseline text and the gate's reason state the updates per batch too
    ("with 2 updates per batch"); each statement must be what the arms run."""
    for at, text in (
        ("hypothesis", spec.hypothesis),
        ("baseline", spec.baseline),
        ("activation_gate.reason", spec.activation_gate.reason),
    ):
        for value, sentence in stated_values(text, "updates_per_batch", at):
            if value != upb:
                raise _fail(
                    at,
                    f"states {value} optimizer steps per rollout batch ({sentence!r}), but the arms run "
                    f"updates_per_batch {upb}",
                )


def _check_arms(spec: ExperimentSpec) -> tuple[int, int]:
    """(updates_per_batch, seed) the arms share; unique names and registered losses."""
    names = [a.name for a in spec.arms]
    if len(set(names)) != len(names):
        raise _fail("arms", f"arm names must be unique, got {names}")
    for i, a in enumerate(spec.arms):
        try:
            losses.get_loss(a.loss)
        except losses.UnknownLossError as exc:
            raise _fail(f"arms[{i}].loss", str(exc)) from None
    for key in ("seed", "updates_per_batch"):
        values = sorted({getattr(a, key) for a in spec.arms})
        if len(values) != 1:
            raise _fail(
                "arms",
                f"{key} differs between arms ({values}): paired arms share prompts, sampling seeds "
                "and the minibatch schedule",
            )
    return spec.arms[0].updates_per_batch, spec.arms[0].seed


def _check_dataset(spec: ExperimentSpec, rollout_steps: int, groups_per_batch: int) -> dataset.DatasetEntry:
    """The registered dataset the spec names (the one dataset seam), large enough for the run."""
    try:
        data = dataset.entry(spec.dataset.name)
    except dataset.UnknownDatasetError as exc:
        raise _fail("dataset.name", str(exc)) from None
    if spec.dataset.hf_path != data.hf_path:
        raise _fail(
            "dataset.hf_path",
            f"{spec.dataset.hf_path!r} is not the source of the registered {data.name} ({data.hf_path!r})",
        )
    need = rollout_steps * groups_per_batch
    if need > spec.dataset.n_examples:
        raise _fail(
            "dataset.n_examples",
            f"{spec.dataset.n_examples} train prompts, but {rollout_steps} rollout "
            f"steps x {groups_per_batch} groups use {need}",
        )
    for split, n, at in (
        ("train", spec.dataset.n_examples, "dataset.n_examples"),
        ("test", spec.eval.n_examples, "eval.n_examples"),
    ):
        if n > data.split_sizes[split]:
            raise _fail(at, f"{n} exceeds the {data.split_sizes[split]} items of {data.name} {split}")
    return data


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


def _arms(spec: ExperimentSpec) -> tuple[tuple[ArmConfig, ...], str]:
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


def _criteria(spec: ExperimentSpec, arms_how: tuple[tuple[ArmConfig, ...], str]) -> tuple[CriterionConfig, ...]:
    arms = arms_how[0]
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


def _check_gate_metrics(spec: ExperimentSpec) -> None:
    provided = {**losses.gate_metric_sources(), **dict.fromkeys(losses.HARNESS_GATE_METRICS, "harness")}
    for i, c in enumerate(spec.activation_gate.checks):
        if c.metric not in provided:
            raise _fail(
                f"activation_gate.checks[{i}].metric",
                f"{c.metric!r} is provided by no registered loss (provided: {', '.join(sorted(provided))})",
            )


def _check_gate_plan(spec: ExperimentSpec, updates_per_batch: int) -> None:
    """Gate checks of executed values must admit what the plan executes, or the paid pilot fails."""
    for i, c in enumerate(spec.activation_gate.checks):
        at = f"activation_gate.checks[{i}]"
        if c.metric == "executed_updates_per_batch" and not (
            (c.min is None or c.min <= updates_per_batch) and (c.max is None or updates_per_batch <= c.max)
        ):
            raise _fail(
                at,
                f"executed_updates_per_batch in [{c.min}, {c.max}] cannot pass: the arms run "
                f"updates_per_batch {updates_per_batch}",
            )
        if c.metric == "executed_base_model" and c.one_of is not None and spec.base_model not in c.one_of:
            raise _fail(
                at, f"executed_base_model one_of {c.one_of} cannot pass: the plan's base_model is {spec.base_model!r}"
            )

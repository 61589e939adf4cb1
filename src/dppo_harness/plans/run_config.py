"""The `RunConfig` every stage reads, built once at plan load from a validated spec and its
resolution file, or a one-line refusal naming the field of a spec the harness cannot run as
written. The baseline is the arm the resolution file names, every other arm a treatment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from dppo_harness.data import dataset
from dppo_harness.json_types import JsonObject
from dppo_harness.loss import loss_registry as losses
from dppo_harness.loss.loss_registry import IMPLEMENTED_PATHS, implemented_list
from dppo_harness.plans.models import ExperimentSpec, GateCheck, OptimizerConfig, _fail
from dppo_harness.plans.resolution import KEYS, Stated

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
        role: Role = "baseline" if a.name == base else "treatment"
        out.append(ArmConfig(a.name, a.loss, role, a.seed, a.lr, a.updates_per_batch, family, cfg))
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
        out.append(CriterionConfig(c.id, c.metric, pos, neg, c.margin, (lo, hi)))
    if len({c.id for c in out}) != len(out):
        raise _fail("decision_rule.criteria", "criterion ids must be unique")
    return tuple(out)


# The spec declares no loss normalization; both arms use the diagnostic plan's token mean.
NORMALIZATION: losses.Normalization = "token_mean"
# The gate's pilot length when the resolution file states none (the saved spec says "A 5-step pilot").
DEFAULT_PILOT_STEPS = 5


@dataclass(frozen=True)
class RunConfig:
    base_model: str
    lora_rank: int
    dataset: str  # a registered dataset name
    train_items: int  # dataset.n_examples: train prompts the run may use
    max_seq_len: int  # prompt + sampled tokens, at most
    arms: tuple[ArmConfig, ...]  # the baseline first, then the treatments in spec order
    baseline_source: str  # where the baseline arm was named
    rollout_steps: int  # rollout batches per arm
    optimizer_steps: int  # spec.steps
    updates_per_batch: int  # also the complete-group minibatches a rollout batch splits into
    batch_size: int
    groups_per_batch: int
    group_size: int
    temperature: float
    max_tokens: int
    eval_items: int
    gate_pilot_steps: int  # the activation gate's pilot length (its `reason` text states it)
    decision_method: str
    alpha: float
    criteria: tuple[CriterionConfig, ...]
    gate_checks: tuple[GateCheck, ...]
    stated: Mapping[str, Stated]  # where each schedule value above comes from, in the order of resolution.KEYS
    normalization: losses.Normalization = NORMALIZATION

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

    def as_json(self) -> JsonObject:
        """The effective config's view: plain values, and each value the spec states only in prose
        with the sentence it quotes."""
        return {
            "base_model": self.base_model,
            "lora_rank": self.lora_rank,
            "dataset": self.dataset,
            "train_items": self.train_items,
            "max_seq_len": self.max_seq_len,
            "arms": [{**{k: getattr(a, k) for k in _ARM_KEYS}, "adam": dict(a.adam.items())} for a in self.arms],
            "baseline_source": self.baseline_source,
            "rollout_steps": self.rollout_steps,
            "optimizer_steps": self.optimizer_steps,
            "updates_per_batch": self.updates_per_batch,
            "batch_size": self.batch_size,
            **{k: v.value for k, v in self.stated.items()},
            "eval_items": self.eval_items,
            "normalization": self.normalization,
            "decision": {
                "method": self.decision_method,
                "alpha": self.alpha,
                "criteria": [
                    {**{k: getattr(c, k) for k in _CRITERION_KEYS}, "bounds": list(c.bounds)} for c in self.criteria
                ],
            },
            "gate_checks": [c.model_dump(exclude_none=True) for c in self.gate_checks],
            "stated_in_prose": {k: v.as_json() for k, v in self.stated.items()},
        }


# The record of an arm and of a criterion in `RunConfig.as_json`, in this order.
_ARM_KEYS = ("name", "loss", "role", "seed", "lr", "updates_per_batch", "optimizer")
_CRITERION_KEYS = ("id", "metric", "treatment", "baseline", "margin")


def _quote(s: Stated) -> str:
    return f"{s.field}: {s.source!r}"


def build_run_config(
    spec: ExperimentSpec, values: Mapping[str, Stated], baseline: str, baseline_source: str
) -> RunConfig:
    """The RunConfig of a validated spec, or PlanError (one line, field path first). `values` are
    the schedule values the resolution file states (`resolution.quoted_values`), `baseline` the arm
    it names."""
    upb = _check_arms(spec)
    gpb = int(values["groups_per_batch"].value)
    if spec.steps % upb:
        raise _fail("steps", f"{spec.steps} optimizer steps is not a multiple of updates_per_batch {upb}")
    rollout_steps = spec.steps // upb
    minibatches = _minibatch_split(spec, values, upb)
    if int(values["max_tokens"].value) >= spec.max_seq_len:  # max_seq_len bounds prompt + sampled tokens
        raise _fail(
            "max_seq_len",
            f"{spec.max_seq_len} leaves no room for a prompt before max_tokens={int(values['max_tokens'].value)} "
            f"({_quote(values['max_tokens'])})",
        )
    data = _check_dataset(spec, rollout_steps, gpb)
    arms = resolve_arms(spec, baseline)
    criteria = resolve_criteria(spec, arms)
    _check_gate(spec, upb)
    check_correctness_paths(spec)
    pilot = values.get("gate_pilot_steps") or Stated(
        DEFAULT_PILOT_STEPS, "harness default", "the resolution file states no gate_pilot_steps", default=True
    )
    stated = {**values, "minibatches_per_batch": minibatches, "gate_pilot_steps": pilot}
    return RunConfig(
        base_model=spec.base_model,
        lora_rank=spec.lora_rank,
        dataset=data.name,
        train_items=spec.dataset.n_examples,
        max_seq_len=spec.max_seq_len,
        arms=arms,
        baseline_source=baseline_source,
        rollout_steps=rollout_steps,
        optimizer_steps=spec.steps,
        updates_per_batch=upb,
        batch_size=spec.batch_size,
        groups_per_batch=gpb,
        group_size=int(values["group_size"].value),
        temperature=float(values["temperature"].value),
        max_tokens=int(values["max_tokens"].value),
        eval_items=spec.eval.n_examples,
        gate_pilot_steps=int(pilot.value),
        decision_method=spec.decision_rule.method,
        alpha=spec.decision_rule.alpha,
        criteria=criteria,
        gate_checks=tuple(spec.activation_gate.checks),
        stated={k: stated[k] for k in KEYS},
    )


def _minibatch_split(spec: ExperimentSpec, values: Mapping[str, Stated], upb: int) -> Stated:
    """The rollout batch's split into minibatches: batch_size is groups_per_batch x group_size, and
    the batch splits into `upb` complete-group minibatches, one per update."""
    gpb, gs = int(values["groups_per_batch"].value), int(values["group_size"].value)
    if gpb * gs != spec.batch_size:
        raise _fail(
            "batch_size",
            f"{spec.batch_size} != groups_per_batch {gpb} x group_size {gs} ({_quote(values['groups_per_batch'])})",
        )
    minibatches = values.get("minibatches_per_batch") or Stated(
        upb,
        "arms[*].updates_per_batch",
        "one complete-group minibatch per update (the resolution file states no split)",
        default=True,
    )
    if minibatches.value != upb:
        raise _fail(
            "arms",
            f"updates_per_batch {upb} != the {minibatches.value} minibatches the rollout batch is "
            f"split into ({_quote(minibatches)})",
        )
    if gpb % upb:
        raise _fail("batch_size", f"groups_per_batch {gpb} cannot form {upb} complete-group minibatches")
    return minibatches


def check_correctness_paths(spec: ExperimentSpec) -> None:
    """Each correctness path the spec names is one the harness implements, with the kind the spec
    gives it, named once; at least one when the preflight is required."""
    block, implemented = spec.correctness_preflight, f"(implemented: {implemented_list()})"
    if block.required and not block.paths:
        raise _fail(
            "correctness_preflight.paths", f"the spec requires a correctness preflight but names no path {implemented}"
        )
    ids = [p.id for p in block.paths]
    for i, path in enumerate(block.paths):
        at = f"correctness_preflight.paths[{i}]"
        if (known := IMPLEMENTED_PATHS.get(path.id)) is None:
            raise _fail(f"{at}.id", f"{path.id!r} is not a correctness path this harness implements {implemented}")
        if path.kind != known.kind:
            raise _fail(f"{at}.kind", f"{path.kind!r}, but the harness's path {path.id!r} is of kind {known.kind!r}")
        if path.id in ids[:i]:
            raise _fail(f"{at}.id", f"{path.id!r} is named twice")


def _check_arms(spec: ExperimentSpec) -> int:
    """The updates_per_batch the arms share (their seed too); unique names and registered losses."""
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
    return spec.arms[0].updates_per_batch


def _check_dataset(spec: ExperimentSpec, rollout_steps: int, groups_per_batch: int) -> dataset.DatasetEntry:
    """The registered dataset the spec names, large enough for the run."""
    data = registered_dataset(spec.dataset.name, "dataset.name")
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


def registered_dataset(name: str, at: str) -> dataset.DatasetEntry:
    """The dataset registered under `name` (the one dataset seam), or PlanError at field `at`."""
    try:
        return dataset.entry(name)
    except dataset.UnknownDatasetError as exc:
        raise _fail(at, str(exc)) from None


def _check_gate(spec: ExperimentSpec, updates_per_batch: int) -> None:
    """Each gate check's metric is provided, and a check of an executed value admits what the plan
    executes, or the paid pilot fails."""
    provided = {**losses.gate_metric_sources(), **dict.fromkeys(losses.HARNESS_GATE_METRICS, "harness")}
    for i, c in enumerate(spec.activation_gate.checks):
        at = f"activation_gate.checks[{i}]"
        if c.metric not in provided:
            raise _fail(
                f"{at}.metric",
                f"{c.metric!r} is provided by no registered loss (provided: {', '.join(sorted(provided))})",
            )
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

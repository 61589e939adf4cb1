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
  +1/-1 weights name arms or the roles `treatment`/`baseline` (a role must name one arm). The
  arms and criteria are resolved by `arm_roles`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import JsonValue

from dppo_harness.data import dataset
from dppo_harness.json_types import JsonObject
from dppo_harness.loss import loss_registry as losses
from dppo_harness.plans.arm_roles import ArmConfig, CriterionConfig, resolve_arms, resolve_criteria
from dppo_harness.plans.loss_params import check_loss_statements
from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.models import Budget, ExperimentSpec, GateCheck
from dppo_harness.plans.prose import REQUIRED, Settlements, Stated, parse_method, require, stated_values

# The spec declares no loss normalization; both arms use the diagnostic plan's token mean.
NORMALIZATION: losses.Normalization = "token_mean"
# The gate's pilot length when its reason text states none (the saved spec says "A 5-step pilot").
DEFAULT_PILOT_STEPS = 5


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
    groups_per_batch = int(sched["groups_per_batch"].value)
    upb, seed = _check_arms(spec)
    rollout_steps = _rollout_steps(spec, stated, upb)
    minibatches = _minibatch_split(spec, stated, sched, upb)
    _check_stated_settings(spec, stated, seed)
    _check_room_for_prompt(spec, sched["max_tokens"])
    data = _check_dataset(spec, rollout_steps, groups_per_batch)
    arms, baseline_source = resolve_arms(spec)
    criteria = resolve_criteria(spec, arms)
    _check_gate_metrics(spec)
    _check_gate_plan(spec, upb)
    _check_updates_stated_elsewhere(spec, upb)
    check_loss_statements(spec)
    pilot = _gate_pilot_steps(spec, arm_names, settlements)
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


def _rollout_steps(spec: ExperimentSpec, stated: Mapping[str, Stated], upb: int) -> int:
    """Rollout batches per arm: spec.steps optimizer steps over `upb` updates per batch, and each
    count the method states (updates per batch, rollout steps, optimizer steps) agrees."""
    if "updates_per_batch" in stated and stated["updates_per_batch"].value != upb:
        s = stated["updates_per_batch"]
        raise _fail(
            "arms",
            f"updates_per_batch {upb} != the {s.value} optimizer steps per batch the method states ({_quote(s)})",
        )
    if spec.steps % upb:
        raise _fail("steps", f"{spec.steps} optimizer steps is not a multiple of updates_per_batch {upb}")
    rollout_steps = spec.steps // upb
    if "rollout_steps" in stated and stated["rollout_steps"].value != rollout_steps:
        s = stated["rollout_steps"]
        raise _fail("steps", f"{spec.steps} != {s.value} rollout steps x updates_per_batch {upb} ({_quote(s)})")
    if "optim_steps" in stated and stated["optim_steps"].value != spec.steps:
        s = stated["optim_steps"]
        raise _fail("steps", f"{spec.steps} != the {s.value} optimizer steps the method states ({_quote(s)})")
    return rollout_steps


def _minibatch_split(
    spec: ExperimentSpec, stated: Mapping[str, Stated], sched: Mapping[str, Stated], upb: int
) -> Stated:
    """The rollout batch's split into minibatches: batch_size is groups_per_batch x group_size, and
    the batch splits into `upb` complete-group minibatches, one per update."""
    gpb, gs = int(sched["groups_per_batch"].value), int(sched["group_size"].value)
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
    return minibatches


def _check_stated_settings(spec: ExperimentSpec, stated: Mapping[str, Stated], seed: int) -> None:
    """The LoRA rank, lr, seed and test items the method states are the structured fields' values."""
    for key, structured, at in (
        ("lora_rank", spec.lora_rank, "lora_rank"),
        ("lr", spec.optimizer.lr, "optimizer.lr"),
        ("seed", seed, "arms[*].seed"),
        ("eval_items", spec.eval.n_examples, "eval.n_examples"),
    ):
        said = stated.get(key)
        if said is not None and said.value != structured:
            raise _fail(at, f"{structured} but the method states {said.value} ({_quote(said)})")


def _check_room_for_prompt(spec: ExperimentSpec, max_tokens: Stated) -> None:
    """max_seq_len bounds prompt + sampled tokens, so it must exceed max_tokens."""
    if int(max_tokens.value) >= spec.max_seq_len:
        raise _fail(
            "max_seq_len",
            f"{spec.max_seq_len} leaves no room for a prompt before max_tokens={int(max_tokens.value)} "
            f"({_quote(max_tokens)})",
        )


def _gate_pilot_steps(spec: ExperimentSpec, arm_names: list[str], settlements: Settlements) -> Stated:
    """The activation gate's pilot length as its reason text states it ("N-step pilot"), else the
    harness default."""
    return parse_method(
        spec.activation_gate.reason,
        "activation_gate.reason",
        keys=("pilot_steps",),
        arm_names=arm_names,
        settlements=settlements,
    ).get("pilot_steps") or Stated(
        DEFAULT_PILOT_STEPS, "harness default", "the activation gate's reason states no 'N-step pilot'", default=True
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

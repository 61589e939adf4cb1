"""The typed run configuration of an experiment spec, built once at plan load.

`build_run_config(spec, values, baseline)` turns a validated `ExperimentSpec` into the `RunConfig`
every stage reads: arms with their roles, losses and optimizer settings; the sampling schedule,
which the spec states only in its `method` prose and the resolution file states beside it, each
value with the sentence it quotes (`resolution.Stated`); the sizes; the gate checks; the decision
criteria resolved to arms. It refuses, with one line naming the field, a spec that the harness
cannot run as written:

- batch_size != groups_per_batch x group_size, steps not a multiple of updates_per_batch, a
  batch that cannot form one complete-group minibatch per update, max_tokens that leaves no room
  for a prompt in max_seq_len;
- an arm names an unregistered loss (`loss_registry.LOSSES`), the dataset is not registered
  (`dataset.DATASETS`), a gate check's metric is provided by no registered loss, a correctness
  path is not one the harness implements;
- roles cannot be told: the baseline is the arm the resolution file names, every other arm is a
  treatment; each criterion's +1/-1 weights name arms or the roles `treatment`/`baseline` (a role
  must name one arm). The arms and criteria are resolved by `arm_roles`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dppo_harness.data import dataset
from dppo_harness.json_types import JsonObject
from dppo_harness.loss import loss_registry as losses
from dppo_harness.loss.loss_registry import IMPLEMENTED_PATHS, implemented_list
from dppo_harness.plans.arm_roles import ArmConfig, CriterionConfig, resolve_arms, resolve_criteria
from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.models import Budget, ExperimentSpec, GateCheck
from dppo_harness.plans.resolution import Stated

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
        """The effective config's view: plain values, and each value the spec states only in prose
        with the sentence it quotes."""
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
        }


def _fail(at: str, msg: str) -> PlanError:
    return PlanError(f"{at}: {msg}")


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
    _check_room_for_prompt(spec, values["max_tokens"])
    data = _check_dataset(spec, rollout_steps, gpb)
    arms = resolve_arms(spec, baseline)
    criteria = resolve_criteria(spec, arms)
    _check_gate_metrics(spec)
    _check_gate_plan(spec, upb)
    check_correctness_paths(spec)
    pilot = values.get("gate_pilot_steps") or Stated(
        DEFAULT_PILOT_STEPS, "harness default", "the resolution file states no gate_pilot_steps", default=True
    )
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
        groups_per_batch=values["groups_per_batch"],
        group_size=values["group_size"],
        temperature=values["temperature"],
        max_tokens=values["max_tokens"],
        minibatches_per_batch=minibatches,
        eval_items=spec.eval.n_examples,
        gate_pilot_steps=pilot,
        decision_method=spec.decision_rule.method,
        alpha=spec.decision_rule.alpha,
        criteria=criteria,
        gate_checks=tuple(spec.activation_gate.checks),
        budget=spec.budget,
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


def _check_room_for_prompt(spec: ExperimentSpec, max_tokens: Stated) -> None:
    """max_seq_len bounds prompt + sampled tokens, so it must exceed max_tokens."""
    if int(max_tokens.value) >= spec.max_seq_len:
        raise _fail(
            "max_seq_len",
            f"{spec.max_seq_len} leaves no room for a prompt before max_tokens={int(max_tokens.value)} "
            f"({_quote(max_tokens)})",
        )


def check_correctness_paths(spec: ExperimentSpec) -> tuple[str, ...]:
    """The spec's correctness path ids, each one the harness implements with the kind the spec
    gives it, each named once, at least one when the preflight is required; else PlanError."""
    block = spec.correctness_preflight
    if block.required and not block.paths:
        raise PlanError(
            f"correctness_preflight.paths: the spec requires a correctness preflight but names no path "
            f"(implemented: {implemented_list()})"
        )
    seen: set[str] = set()
    for i, path in enumerate(block.paths):
        at = f"correctness_preflight.paths[{i}]"
        known = IMPLEMENTED_PATHS.get(path.id)
        if known is None:
            raise PlanError(
                f"{at}.id: {path.id!r} is not a correctness path this harness implements "
                f"(implemented: {implemented_list()})"
            )
        if path.kind != known.kind:
            raise PlanError(f"{at}.kind: {path.kind!r}, but the harness's path {path.id!r} is of kind {known.kind!r}")
        if path.id in seen:
            raise PlanError(f"{at}.id: {path.id!r} is named twice")
        seen.add(path.id)
    return tuple(p.id for p in block.paths)


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

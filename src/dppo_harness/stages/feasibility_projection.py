"""Feasibility's projection (pure arithmetic): the executed schedule of a plan, the timing pilot's
measured figures, and the whole plan projected from them against the budget.

The projection applies the measured per-unit times to the plan's schedule (no scaling by model
size, no assumed concurrency: sampling time per group is what the pilot measured with its groups
in flight together), adds a recovery reserve, and compares with the plan's budget. `PilotFigures`
is what later stages read back of the measured figures (the comparison's wall guard).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pydantic import JsonValue

from dppo_harness.json_types import JsonObject
from dppo_harness.loss.loss_registry import DPPO_LOSS

if TYPE_CHECKING:
    from dppo_harness.plans import Plan

DEFAULT_RESERVE_FRACTION = 0.25


class FeasibilityError(RuntimeError):
    """The pilot could not run or the plan lacks what the projection needs."""


@dataclass(frozen=True)
class PilotSchedule:
    """The schedule a plan executes, in the units the projection counts (rollout batches, updates, items)."""

    plan_kind: str
    trained_arms: int
    batches_per_arm: int  # rollout batches sampled per arm
    groups_per_batch: int
    group_size: int
    updates_per_batch: int  # optimizer updates on each rollout batch
    sequences_per_update: int
    max_tokens: int
    eval_items: int  # greedy items over all arms and checkpoints
    temperature: float
    dataset: str = "gsm8k"  # a registered dataset (dataset.DATASETS)
    arm_losses: tuple[str, ...] = ("dppo_divergence_mask",)  # every trained arm's registered loss, in plan order
    seed: int = 0

    @property
    def arm_steps(self) -> int:
        return self.trained_arms * self.batches_per_arm


def schedule_from_plan(plan: Plan) -> PilotSchedule:
    """The executed schedule of an experiment spec (its typed run config; a rehearsal at its
    declared size) or of a bounded-diagnostic plan."""
    if plan.kind in ("experiment_spec", "rehearsal"):
        run = plan.run
        if run is None:
            raise FeasibilityError(f"plan {plan.name}: a {plan.kind} plan without its typed run config")
        return PilotSchedule(
            plan_kind=plan.kind,
            trained_arms=len(run.arms),
            batches_per_arm=run.rollout_steps,
            groups_per_batch=int(run.groups_per_batch.value),
            group_size=int(run.group_size.value),
            updates_per_batch=run.updates_per_batch,
            sequences_per_update=run.batch_size // run.updates_per_batch,
            max_tokens=int(run.max_tokens.value),
            eval_items=len(run.arms) * run.eval_items,
            temperature=float(run.temperature.value),
            dataset=run.dataset,
            arm_losses=tuple(a.loss for a in run.arms),
            seed=run.seed,
        )
    if plan.kind == "bounded_diagnostic":
        d = plan.diagnostic
        sch, fs = d.schedule, d.fixed_settings
        return PilotSchedule(
            plan_kind=plan.kind,
            trained_arms=1,
            batches_per_arm=sch.sampling_batches,
            groups_per_batch=sch.groups_per_batch,
            group_size=sch.group_size,
            updates_per_batch=sch.max_optimizer_updates,
            sequences_per_update=sch.groups_per_minibatch * sch.group_size,
            max_tokens=fs.sampling.max_tokens,
            eval_items=0,
            temperature=float(fs.sampling.temperature),
            dataset=fs.sampling.dataset,
            arm_losses=(DPPO_LOSS,),
            seed=fs.seed,
        )
    raise FeasibilityError(f"unknown plan kind {plan.kind!r}")


@dataclass(frozen=True)
class PilotTimings:
    setup_seconds: float
    sampling_seconds: float  # first submit -> last result, all pilot groups in flight together
    sampled_groups: int
    sampled_sequences: int
    update_seconds: tuple[float, ...]  # each: forward_backward_custom + optim_step
    sequences_per_update: int
    eval_seconds: float
    eval_items: int

    def validate(self) -> None:
        for name in ("setup_seconds", "sampling_seconds", "eval_seconds"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise FeasibilityError(f"pilot {name} must be a finite non-negative number, got {v!r}")
        if self.sampled_groups < 1:
            raise FeasibilityError("pilot sampled no groups")
        if not self.update_seconds or any(not (math.isfinite(s) and s > 0) for s in self.update_seconds):
            raise FeasibilityError(f"pilot update timings must be positive: {self.update_seconds}")

    @property
    def seconds_per_group(self) -> float:
        return self.sampling_seconds / self.sampled_groups

    @property
    def seconds_per_update(self) -> float:
        return statistics.fmean(self.update_seconds)

    @property
    def seconds_per_eval_item(self) -> float | None:
        return self.eval_seconds / self.eval_items if self.eval_items else None

    @property
    def training_seconds(self) -> float:
        return self.sampling_seconds + sum(self.update_seconds)


@dataclass(frozen=True)
class Projection:
    setup_seconds: float
    arm_step_seconds: float
    training_seconds: float
    evaluation_seconds: float
    recovery_seconds: float
    total_seconds: float
    budget_seconds: float  # remaining wall budget the total is compared with
    gpu_count: int | None
    gpu_hours: float | None
    gpu_hours_budget: float
    fits: bool
    problems: tuple[str, ...]

    def as_dict(self) -> JsonObject:
        d = asdict(self)
        d["problems"] = list(self.problems)
        return d


def project(
    schedule: PilotSchedule,
    timings: PilotTimings,
    budget: Mapping[str, float],
    *,
    gpu_count: int | None,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    elapsed_seconds: float = 0.0,
) -> Projection:
    """Whole-plan wall time (and GPU-hours when the GPU count is known) against the budget.

    arm-step = seconds_per_group x groups_per_batch + updates_per_batch x seconds_per_update;
    total = (setup + arm_steps x arm-step + eval_items x seconds_per_item) x (1 + reserve).
    `elapsed_seconds` (already spent on this run) is taken off the wall budget first.
    """
    timings.validate()
    if not (0.0 <= reserve_fraction < 10.0):
        raise FeasibilityError(f"reserve_fraction must be in [0, 10), got {reserve_fraction}")
    problems: list[str] = []
    arm_step = (
        timings.seconds_per_group * schedule.groups_per_batch + schedule.updates_per_batch * timings.seconds_per_update
    )
    training = schedule.arm_steps * arm_step
    if schedule.eval_items:
        per_item = timings.seconds_per_eval_item
        if per_item is None:
            raise FeasibilityError("the plan evaluates items but the pilot timed no evaluation")
        evaluation = schedule.eval_items * per_item
    else:
        evaluation = 0.0
    work = timings.setup_seconds + training + evaluation
    recovery = reserve_fraction * work
    total = work + recovery
    budget_s = float(budget["max_wall_minutes"]) * 60.0 - float(elapsed_seconds)
    fits = total <= budget_s
    if not fits:
        problems.append(
            f"projected wall time {total:.0f}s (setup {timings.setup_seconds:.0f}s + training "
            f"{training:.0f}s + evaluation {evaluation:.0f}s + reserve {recovery:.0f}s) exceeds the "
            f"remaining wall budget {budget_s:.0f}s ({budget['max_wall_minutes']} min"
            + (f" minus {elapsed_seconds:.0f}s spent" if elapsed_seconds else "")
            + ")"
        )
    gpu_budget = float(budget["gpu_hours"])
    if gpu_count is None:
        gpu_hours = None
        problems.append("GPU-hours not projected: no allocation evidence for the GPU count")
    else:
        gpu_hours = total / 3600.0 * gpu_count
        if gpu_hours > gpu_budget:
            fits = False
            problems.append(f"projected {gpu_hours:.2f} GPU-hours exceeds the budget {gpu_budget}")
    return Projection(
        setup_seconds=timings.setup_seconds,
        arm_step_seconds=arm_step,
        training_seconds=training,
        evaluation_seconds=evaluation,
        recovery_seconds=recovery,
        total_seconds=total,
        budget_seconds=budget_s,
        gpu_count=gpu_count,
        gpu_hours=gpu_hours,
        gpu_hours_budget=gpu_budget,
        fits=fits,
        problems=tuple(problems),
    )


def feasibility_block(
    *,
    schedule: PilotSchedule,
    timings: PilotTimings,
    projection: Projection,
    pilot_config: Mapping[str, JsonValue],
    effective_config: Mapping[str, JsonValue],
    primary_endpoint: str,
    source: str,
    allocation_source: str | None,
) -> JsonObject:
    """The result's `feasibility` block, in its fixed shape (config, measurements per phase, recovery).

    training.units is arm-step equivalents timed: the pilot's measured training seconds divided by
    the projected seconds of one arm-step, so seconds / units x planned_units is the projection.
    """
    gpu, alloc = projection.gpu_count, allocation_source if projection.gpu_count is not None else None
    eval_block: JsonObject = {
        "seconds": timings.eval_seconds,
        "units": timings.eval_items,
        "planned_units": schedule.eval_items,
        "samples": timings.eval_items,
        "gpu_count": gpu,
        "allocation_source": alloc,
    }
    return {
        "config": dict(pilot_config),
        "effective_config": dict(effective_config),
        "primary_endpoint": primary_endpoint,
        "source": source,
        "measurements": {
            "setup": {
                "seconds": timings.setup_seconds,
                "units": 1,
                "planned_units": 1,
                "samples": 0,
                "gpu_count": gpu,
                "allocation_source": alloc,
            },
            "training": {
                "seconds": timings.training_seconds,
                "units": timings.training_seconds / projection.arm_step_seconds,
                "planned_units": schedule.arm_steps,
                "samples": timings.sampled_sequences + timings.sequences_per_update * len(timings.update_seconds),
                "gpu_count": gpu,
                "allocation_source": alloc,
            },
            "evaluation": eval_block,
        },
        "generation": None,
        "recovery": {"seconds": projection.recovery_seconds, "gpu_count": gpu, "allocation_source": alloc},
    }


def feasibility_check(projection: Projection, known_gpu_hours: float | None) -> JsonObject:
    """The spec's `feasibility_check` shape, filled from the projection (projected, not observed)."""
    return {
        "status": "fits" if projection.fits else "exceeds_budget",
        "problems": list(projection.problems),
        "wall_seconds": projection.total_seconds,
        "gpu_hours": projection.gpu_hours,
        "known_gpu_hours": known_gpu_hours,
        "phases": {
            "setup": projection.setup_seconds,
            "training": projection.training_seconds,
            "evaluation": projection.evaluation_seconds,
            "recovery": projection.recovery_seconds,
        },
    }


def stage_projections(schedule: PilotSchedule, timings: PilotTimings, *, gate_steps: int = 5) -> dict[str, float]:
    """Projected seconds of later stages (before the reserve), for the budget ledger.

    "plan": the whole selected plan. "gate" (experiment spec only, whose minibatch size the pilot
    timed): the spec's 5-step treatment-arm pilot, sampling + updates_per_batch updates per step.
    """
    group_s, update_s = timings.seconds_per_group, timings.seconds_per_update
    step_s = group_s * schedule.groups_per_batch + schedule.updates_per_batch * update_s
    out = {
        "plan": timings.setup_seconds
        + schedule.arm_steps * step_s
        + schedule.eval_items * (timings.seconds_per_eval_item or 0.0)
    }
    if schedule.plan_kind in ("experiment_spec", "rehearsal"):
        out["gate"] = timings.setup_seconds + gate_steps * step_s
    return out


@dataclass(frozen=True)
class ArmPilot:
    """One arm's update as the timing pilot runs it: its registered loss and its own optimizer config."""

    name: str
    loss: str
    optimizer: dict[str, float]


def arm_pilots(plan: Plan) -> tuple[ArmPilot, ...]:
    """Every arm the plan trains, each with its own loss and optimizer config (a diagnostic: its one arm)."""
    if plan.kind == "bounded_diagnostic":
        o = plan.diagnostic.fixed_settings.optimizer
        return (
            ArmPilot(
                "diagnostic",
                DPPO_LOSS,
                {
                    k: getattr(o, k)
                    for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
                },
            ),
        )
    if plan.run is None:
        raise FeasibilityError(f"plan {plan.name}: a {plan.kind} plan without its typed run config")
    return tuple(ArmPilot(a.name, a.loss, dict(a.adam_config_requested())) for a in plan.run.arms)


@dataclass(frozen=True)
class PilotFigures:
    """What later stages read back of the feasibility block (`feasibility_block`): seconds per
    arm-step and per evaluation item, each None when the block has no usable timing of it."""

    arm_step_seconds: float | None
    eval_item_seconds: float | None

    @classmethod
    def from_block(cls, block: Mapping[str, JsonValue] | None) -> PilotFigures:
        """The per-unit figures of a result's `feasibility` block (seconds / units of `training` and
        `evaluation`); a missing block, phase or non-finite number gives None for that figure."""
        measurements = (block or {}).get("measurements")
        phases = measurements if isinstance(measurements, dict) else {}

        def per_unit(name: str) -> float | None:
            phase = phases.get(name)
            if not isinstance(phase, dict):
                return None
            secs, units = phase.get("seconds"), phase.get("units")
            if isinstance(secs, (int, float)) and isinstance(units, (int, float)) and units > 0 and math.isfinite(secs):
                return float(secs) / float(units)
            return None

        return cls(per_unit("training"), per_unit("evaluation"))

"""Feasibility's projection (pure arithmetic): the timing pilot's measured figures applied to the
plan's own schedule (its `RunConfig`) against the budget.

No scaling by model size, no assumed concurrency: sampling time per group is what the pilot
measured with its groups in flight together. A recovery reserve is added. `PilotFigures` is what
later stages read back of the measured figures (the comparison's wall guard).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pydantic import JsonValue

from dppo_harness.json_types import JsonObject

if TYPE_CHECKING:
    from dppo_harness.plans import RunConfig

RESERVE_FRACTION = 0.25
PILOT_FILE = "feasibility-pilot.json"


class FeasibilityError(RuntimeError):
    """The pilot could not run or the plan lacks what the projection needs."""


def arm_steps(run: RunConfig) -> int:
    """Rollout batches over all arms: the units the training projection counts."""
    return len(run.arms) * run.rollout_steps


def planned_eval_items(run: RunConfig) -> int:
    """Greedy items over all arms."""
    return len(run.arms) * run.eval_items


def sequences_per_update(run: RunConfig) -> int:
    return run.batch_size // run.updates_per_batch


def schedule_json(plan_kind: str, run: RunConfig) -> JsonObject:
    """The schedule the projection counted, in its units (the pilot file's `schedule`)."""
    return {
        "plan_kind": plan_kind,
        "trained_arms": len(run.arms),
        "batches_per_arm": run.rollout_steps,
        "groups_per_batch": int(run.groups_per_batch.value),
        "group_size": int(run.group_size.value),
        "updates_per_batch": run.updates_per_batch,
        "sequences_per_update": sequences_per_update(run),
        "max_tokens": int(run.max_tokens.value),
        "eval_items": planned_eval_items(run),
        "temperature": float(run.temperature.value),
        "dataset": run.dataset,
        "arm_losses": [a.loss for a in run.arms],
        "seed": run.seed,
    }


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

    def arm_step_seconds(self, run: RunConfig) -> float:
        """One rollout batch of `run`: its groups sampled, then its updates."""
        per_group = self.sampling_seconds / self.sampled_groups
        return per_group * int(run.groups_per_batch.value) + run.updates_per_batch * statistics.fmean(
            self.update_seconds
        )

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
    run: RunConfig,
    timings: PilotTimings,
    budget: Mapping[str, float],
    *,
    gpu_count: int | None,
) -> Projection:
    """Whole-plan wall time (and GPU-hours when the GPU count is known) against the budget.

    total = (setup + arm_steps x arm-step + eval_items x seconds_per_item) x (1 + reserve). Time
    already spent in the session is the budget ledger's (`evidence.budget_allows`), not this one's.
    """
    timings.validate()
    problems: list[str] = []
    arm_step = timings.arm_step_seconds(run)
    training = arm_steps(run) * arm_step
    evaluation = 0.0
    if planned_eval_items(run):
        if timings.seconds_per_eval_item is None:
            raise FeasibilityError("the plan evaluates items but the pilot timed no evaluation")
        evaluation = planned_eval_items(run) * timings.seconds_per_eval_item
    work = timings.setup_seconds + training + evaluation
    recovery = RESERVE_FRACTION * work
    total = work + recovery
    budget_s = float(budget["max_wall_minutes"]) * 60.0
    fits = total <= budget_s
    if not fits:
        problems.append(
            f"projected wall time {total:.0f}s (setup {timings.setup_seconds:.0f}s + training "
            f"{training:.0f}s + evaluation {evaluation:.0f}s + reserve {recovery:.0f}s) exceeds the "
            f"remaining wall budget {budget_s:.0f}s ({budget['max_wall_minutes']} min)"
        )
    gpu_budget = float(budget["gpu_hours"])
    gpu_hours = None if gpu_count is None else total / 3600.0 * gpu_count
    if gpu_hours is None:
        problems.append("GPU-hours not projected: no allocation evidence for the GPU count")
    elif gpu_hours > gpu_budget:
        fits = False
        problems.append(f"projected {gpu_hours:.2f} GPU-hours exceeds the budget {gpu_budget}")
    parts = (timings.setup_seconds, arm_step, training, evaluation, recovery, total, budget_s)
    return Projection(*parts, gpu_count, gpu_hours, gpu_budget, fits, tuple(problems))


def feasibility_block(
    run: RunConfig,
    timings: PilotTimings,
    projection: Projection,
    *,
    pilot_config: Mapping[str, JsonValue],
    effective_config: Mapping[str, JsonValue],
    primary_endpoint: str,
    allocation_source: str | None,
) -> JsonObject:
    """The result's `feasibility` block, in its fixed shape (config, measurements per phase, recovery).

    training.units is arm-step equivalents timed: the pilot's measured training seconds divided by
    the projected seconds of one arm-step, so seconds / units x planned_units is the projection.
    """
    gpu = projection.gpu_count
    where = {"gpu_count": gpu, "allocation_source": allocation_source if gpu is not None else None}
    trained = timings.sampled_sequences + timings.sequences_per_update * len(timings.update_seconds)
    return {
        "config": dict(pilot_config),
        "effective_config": dict(effective_config),
        "primary_endpoint": primary_endpoint,
        "source": PILOT_FILE,
        "measurements": {
            "setup": {"seconds": timings.setup_seconds, "units": 1, "planned_units": 1, "samples": 0, **where},
            "training": {
                "seconds": timings.training_seconds,
                "units": timings.training_seconds / projection.arm_step_seconds,
                "planned_units": arm_steps(run),
                "samples": trained,
                **where,
            },
            "evaluation": {
                "seconds": timings.eval_seconds,
                "units": timings.eval_items,
                "planned_units": planned_eval_items(run),
                "samples": timings.eval_items,
                **where,
            },
        },
        "generation": None,
        "recovery": {"seconds": projection.recovery_seconds, **where},
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


def stage_projections(run: RunConfig, timings: PilotTimings) -> dict[str, float]:
    """Projected seconds of later stages (before the reserve), for the budget ledger: "plan" (the
    whole plan) and "gate" (the gate's pilot: its steps of sampling + updates_per_batch updates)."""
    step_s = timings.arm_step_seconds(run)
    return {
        "plan": timings.setup_seconds
        + arm_steps(run) * step_s
        + planned_eval_items(run) * (timings.seconds_per_eval_item or 0.0),
        "gate": timings.setup_seconds + int(run.gate_pilot_steps.value) * step_s,
    }


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

"""The wall-clock guard of the training loop (pure): a step starts only when its projected time
plus what must still run after training fits in the plan's wall budget; the projection comes
from the longest measured step, else from the feasibility pilot's figures."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pydantic import JsonValue

from dppo_harness.json_types import JsonObject

FINALIZE_RESERVE_S = 30.0  # final sampler weights + state per arm, evidence files


def per_unit_seconds(block: Mapping[str, JsonValue] | None, phase_name: str) -> float | None:
    """Seconds per unit of one phase of a result's `feasibility` block (`training`: an arm-step,
    `evaluation`: an item); None when the block, the phase or a finite positive figure is missing."""
    phases = (block or {}).get("measurements")
    phase = phases.get(phase_name) if isinstance(phases, dict) else None
    if not isinstance(phase, dict):
        return None
    secs, units = phase.get("seconds"), phase.get("units")
    if isinstance(secs, (int, float)) and isinstance(units, (int, float)) and units > 0 and math.isfinite(secs):
        return float(secs) / float(units)
    return None


@dataclass
class WallGuard:
    """Before each step: the projected step time (the longest step measured in this session, else
    `first_step_estimate_s`) plus `reserve_s` (finalizing and evaluating) must fit in `remaining()`
    (the budget ledger's seconds left); with neither, the step runs unless the budget is spent."""

    remaining: Callable[[], float | None]
    reserve_s: float = FINALIZE_RESERVE_S
    first_step_estimate_s: float | None = None
    basis: str = ""
    clock: Callable[[], float] = time.perf_counter  # times each step
    step_seconds: list[float] = field(default_factory=list)
    last_check: JsonObject | None = None  # the last check before a step, as the end state writes it

    def check(self, step: int) -> str | None:
        """None if step `step` (0-based) may start, else the one-line stop reason."""
        left = self.remaining()
        measured = max(self.step_seconds) if self.step_seconds else None
        est = measured if measured is not None else self.first_step_estimate_s
        self.last_check = {
            "step": step,
            "seconds_left": left,
            "projected_step_seconds": est,
            "projection_source": "longest measured step"
            if measured is not None
            else ("estimate: " + self.basis)
            if est is not None
            else "none yet",
            "reserve_seconds": self.reserve_s,
        }
        if left is None:
            return None
        need = (est or 0.0) + self.reserve_s
        if left <= 0 or (est is not None and need > left):
            return (
                f"wall clock: step {step + 1} projected {est or 0.0:.0f} s + {self.reserve_s:.0f} s to finish "
                f"and evaluate > {max(left, 0.0):.0f} s left of the plan's wall budget; stopped before it"
            )
        return None

    def as_dict(self) -> JsonObject:
        return {
            "reserve_seconds": self.reserve_s,
            "first_step_estimate_seconds": self.first_step_estimate_s,
            "basis": self.basis,
            "step_seconds": list(self.step_seconds),
            "last_check": self.last_check.copy() if self.last_check is not None else {},
        }


def wall_guard_from_feasibility(
    remaining: Callable[[], float | None], feasibility: Mapping[str, JsonValue] | None, *, arms: int, eval_items: int
) -> WallGuard:
    """A WallGuard whose first-step estimate and evaluation reserve come from the feasibility
    pilot's measured figures (an arm-step's seconds x arms, never assuming overlap is free; seconds
    per evaluation item x items x (arms + base model)); without them, only the finalize reserve."""
    arm_step, per_item = per_unit_seconds(feasibility, "training"), per_unit_seconds(feasibility, "evaluation")
    reserve = FINALIZE_RESERVE_S + (per_item * eval_items * (arms + 1) if per_item is not None else 0.0)
    basis = (
        "feasibility pilot: "
        + (f"{arm_step:.1f} s per arm-step x {arms} arms" if arm_step else "no arm-step timing")
        + (
            f"; evaluation {per_item:.2f} s per item x {eval_items} items x {arms + 1} checkpoints"
            if per_item is not None
            else "; no evaluation timing (reserve: finalize only)"
        )
    )
    return WallGuard(
        remaining, reserve_s=reserve, first_step_estimate_s=arm_step * arms if arm_step else None, basis=basis
    )

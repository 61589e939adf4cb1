"""What the comparison adds to the plan's `RunConfig`: the order the arms take each step
(`ArmOrder`, `comparison_schedule`), the sampling seed of each rollout step (the same for both arms), and the errors
that name a field the comparison cannot be configured or resumed with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from pydantic import JsonValue

if TYPE_CHECKING:
    from dppo_harness.plans import RunConfig


# How the arms take each step: one after the other on one thread (`comparison_schedule` says why).
ArmOrder = Literal["interleaved"]


class ComparisonError(RuntimeError):
    """The comparison cannot be configured or resumed as asked (the message names the field)."""


class OptimizerMismatch(ComparisonError):
    """A restore's optimizer check found the server's optimizer differs from the request: the run
    stops. Carries the arm's provenance entry with that check (its reference names the journaled
    run state), for the evidence."""

    def __init__(self, message: str, arm: str, provenance: Mapping[str, JsonValue]):
        super().__init__(message)
        self.arm, self.provenance = arm, dict(provenance)


def comparison_schedule(option: str | None, backend_kind: str | None) -> tuple[ArmOrder, str]:
    """(arm order, why): arm after arm on any service. That is the schedule the feasibility pilot
    times (its projection adds the arms' steps), and on Spindle two arms' concurrent forward_backward
    requests on the one shared trainer are packed into one batch (a failed batch fails both;
    numerics vary with packing: docs/multi-lora.md), which would tie one arm's step to the other's;
    on the embedded server 2 CPU cores gain nothing from overlap. The option offers no other choice."""
    return "interleaved", (
        "--comparison-schedule"
        if option
        else "default on the embedded server (arm after arm, as the feasibility pilot timed)"
        if backend_kind == "local"
        else "default on a real service (arm after arm, as the feasibility pilot timed; concurrent arms' "
        "forward_backward requests are packed into one batch on a shared trainer)"
    )


def step_seed(run: RunConfig, step: int) -> int:
    """Sampling seed base of a rollout step: the same for both arms, distinct across steps."""
    return run.seed + step * run.groups_per_batch

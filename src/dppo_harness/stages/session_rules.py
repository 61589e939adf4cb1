"""Rules the stage fixtures apply around the stages' entry points: which arms the restoration
preflight trains, whether the feasibility pilot runs, how long the session waits for capacity on
the embedded server, and what a capacity stop before any training records. Pure helpers, so the
pytest fixtures stay wiring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from dppo_harness.plans import Plan
from dppo_harness.service.wait.policy import CAPACITY_SCALE_VAR

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.service.wait.policy import CapacityBlock

# The embedded server has no shared capacity to wait for: its capacity windows are this fraction
# of the defaults, under the same rules.
LOCAL_CAPACITY_SCALE = 0.01

NOTHING_TRAINED = "nothing: the run stopped on service capacity before any training"


def trained_arms(plan: Plan) -> tuple[str, ...] | None:
    """The arms the restoration preflight trains: under a bounded diagnostic plan only its
    treatment arm; else every arm (None)."""
    return (plan.diagnostic.fixed_settings.treatment.arm,) if plan.kind == "bounded_diagnostic" else None


def runs_feasibility_pilot(plan: Plan) -> bool:
    """Under a bounded diagnostic plan no extra pilot samples or trains (its budget is fixed): its
    feasibility block comes from the diagnostic's own measured setup."""
    return plan.kind != "bounded_diagnostic"


def capacity_scale(backend_kind: str, env: Mapping[str, str]) -> float | None:
    """The scale of the session's capacity windows: LOCAL_CAPACITY_SCALE on the embedded server
    unless CAPACITY_SCALE_VAR sets one; None (the policy's own default) on a service."""
    return LOCAL_CAPACITY_SCALE if backend_kind == "local" and not env.get(CAPACITY_SCALE_VAR) else None


def record_capacity_stop_before_training(bundle: EvidenceBundle, block: CapacityBlock) -> None:
    """A capacity stop before any arm trained: the result fails inconclusive with the capacity
    block and, unless a stage already said which hypothesis it tested, says nothing was tested."""
    fields = block.result_fields()
    if bundle.result["original_hypothesis_tested"] is None:
        fields.update(original_hypothesis_tested=False, tested_instead=NOTHING_TRAINED)
    bundle.update_result(**fields)

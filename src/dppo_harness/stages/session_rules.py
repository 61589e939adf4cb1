"""Rules the stage fixtures apply around the stages' entry points: whether the feasibility pilot
runs, and what a capacity stop before any training records. Pure helpers, so the pytest fixtures
stay wiring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dppo_harness.plans import Plan

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.service.wait.policy import CapacityBlock

NOTHING_TRAINED = "nothing: the run stopped on service capacity before any training"


def runs_feasibility_pilot(plan: Plan) -> bool:
    """Under a bounded diagnostic plan no extra pilot samples or trains (its budget is fixed): its
    feasibility block comes from the diagnostic's own measured setup."""
    return plan.kind != "bounded_diagnostic"


def record_capacity_stop_before_training(bundle: EvidenceBundle, block: CapacityBlock) -> None:
    """A capacity stop before any arm trained: the result fails inconclusive with the capacity
    block and, unless a stage already said which hypothesis it tested, says nothing was tested."""
    fields = block.result_fields()
    if bundle.result["original_hypothesis_tested"] is None:
        fields.update(original_hypothesis_tested=False, tested_instead=NOTHING_TRAINED)
    bundle.update_result(**fields)

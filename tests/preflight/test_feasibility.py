"""Stage `preflight`: timing pilot on the session's backend and the projection of the selected
plan against its budget. A plan that cannot fit fails here, which blocks the later stages."""

from __future__ import annotations

from dppo_harness.stages import feasibility as feasibility_module
from dppo_harness.stages.write import PILOT_FILE


def test_plan_fits_its_budget(feasibility):
    assert feasibility.passed, feasibility.failure_message()


def test_feasibility_block_written_in_the_brief_shape(feasibility, evidence_bundle, plan):
    written = evidence_bundle.result["feasibility"]
    assert written == feasibility.block
    m = written["measurements"]
    assert m["setup"]["seconds"] > 0 and m["training"]["seconds"] > 0
    # The projected schedule is the plan's own on every backend: the stages run it as written (a
    # smaller run on the embedded server is a declared rehearsal plan, never a silent reduction).
    assert m["training"]["planned_units"] == feasibility_module.arm_steps(plan.run)
    assert m["evaluation"]["planned_units"] == feasibility_module.planned_eval_items(plan.run)
    assert written["source"] == PILOT_FILE
    assert evidence_bundle.entry(PILOT_FILE) is not None

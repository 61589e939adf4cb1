"""The stage fixtures' rules: whether the feasibility pilot runs, and what a capacity stop before
training writes."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dppo_harness import plans
from dppo_harness.service.wait.policy import CapacityBlock
from dppo_harness.stages import feasibility, write

PLANS = Path(__file__).resolve().parents[2] / "plans"


def test_a_diagnostic_plan_runs_no_feasibility_pilot() -> None:
    assert not feasibility.runs_feasibility_pilot(plans.load_plan(PLANS / "exp_e6b0965af3-diagnostic-r1.json"))
    assert feasibility.runs_feasibility_pilot(plans.load_plan(PLANS / "exp_e6b0965af3.json"))


def _bundle(tested: bool | None) -> Any:
    bundle = SimpleNamespace(result={"original_hypothesis_tested": tested}, written={})
    bundle.update_result = lambda **fields: bundle.written.update(fields)
    return bundle


def test_a_capacity_stop_before_training_fails_inconclusive_and_says_nothing_was_tested() -> None:
    block = CapacityBlock("at capacity", comparison_steps_completed=0, released_clients=True)
    bundle = _bundle(None)
    write.write_capacity_stop(bundle, block)
    assert bundle.written == {
        "status": "failed",
        "verdict": "inconclusive",
        "outcome_reason": "incomplete_execution",
        "capacity_block": block.as_dict(),
        "original_hypothesis_tested": False,
        "tested_instead": "nothing: the run stopped on service capacity before any training",
    }
    said = _bundle(False)  # a stage already said what it tested: kept
    write.write_capacity_stop(said, block)
    assert "tested_instead" not in said.written and said.written["capacity_block"] == block.as_dict()

"""Issue 11 point 6: the run budget (the plan's 720 s, from the session start) is checked before
each service stage's first test; a spent budget blocks the stage with the ledger entry persisted."""

from pathlib import Path

from dppo_harness import pytest_plugin as pp
from dppo_harness.evidence import EvidenceBundle


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _bundle(tmp_path: Path, clock):
    b = EvidenceBundle.create(tmp_path, "b", env={}, clock=clock)
    b.set_budget(720.0, 2.0)
    return b


def test_stage_blocked_once_the_session_budget_is_spent(tmp_path):
    clock = _Clock()
    b = _bundle(tmp_path, clock)
    state = pp._StageState(bundle=b)
    clock.t = 100.0
    pp._check_budget_on_entry(state, "preflight")
    assert "preflight" not in state.first_failure
    clock.t = 721.0  # setup and earlier stages used up the 12 minutes
    pp._check_budget_on_entry(state, "diagnostic")
    assert state.first_failure["diagnostic"].startswith("blocked_by_budget")
    ledger = b.ledger()
    assert ledger["stages"][-1]["status"] == "blocked_by_budget" and ledger["budget"]["max_wall_seconds"] == 720.0
    assert b.result["metrics"]["budget/blocked/diagnostic"] == 1.0


def test_unit_stage_and_repeat_entries_are_not_checked(tmp_path):
    clock = _Clock()
    b = _bundle(tmp_path, clock)
    clock.t = 1000.0
    state = pp._StageState(bundle=b)
    pp._check_budget_on_entry(state, "unit")
    assert state.first_failure == {}
    pp._check_budget_on_entry(state, "gate")
    pp._check_budget_on_entry(state, "gate")
    assert [s["stage"] for s in b.ledger()["stages"]] == ["gate"]

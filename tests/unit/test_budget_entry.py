"""Issue 11 point 6: the run budget (the plan's 720 s, from the session start) is checked before
each service stage's first test; a spent budget blocks the stage with the ledger entry persisted."""

import json
from pathlib import Path

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.pytest_plugin import hooks as plugin_session


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
    state = plugin_session.StageState(bundle=b)
    clock.t = 100.0
    plugin_session.check_budget_on_entry(state, "preflight")
    assert "preflight" not in state.first_failure
    clock.t = 721.0  # setup and earlier stages used up the 12 minutes
    plugin_session.check_budget_on_entry(state, "diagnostic")
    assert state.first_failure["diagnostic"].startswith("blocked_by_budget")
    ledger = b.ledger()
    assert ledger["stages"][-1]["status"] == "blocked_by_budget" and ledger["budget"]["max_wall_seconds"] == 720.0
    assert b.result["metrics"]["budget/blocked/diagnostic"] == 1.0


def test_unit_stage_and_repeat_entries_are_not_checked(tmp_path):
    clock = _Clock()
    b = _bundle(tmp_path, clock)
    clock.t = 1000.0
    state = plugin_session.StageState(bundle=b)
    plugin_session.check_budget_on_entry(state, "unit")
    assert state.first_failure == {}
    plugin_session.check_budget_on_entry(state, "gate")
    plugin_session.check_budget_on_entry(state, "gate")
    assert [s["stage"] for s in b.ledger()["stages"]] == ["gate"]


class _Client:
    def __init__(self):
        self.closed = 0

    def release(self, timeout_s):
        self.closed += 1
        return []  # nothing created: nothing to unload


def test_session_client_release_is_recorded_even_when_the_fixture_releases_it(tmp_path):
    """Issue 11 point 8: client-releases.json lists every client, with its release time."""
    from dppo_harness.service.observed import ClientRegistry

    clock = _Clock()
    b = _bundle(tmp_path, clock)
    reg = ClientRegistry()
    c1, c2 = _Client(), _Client()
    reg.register(c1, stage="preflight-probes", label="probes")
    reg.register(c2, stage="session", label="session client")
    state = plugin_session.StageState(bundle=b, registry=reg)
    reg.release_stage("preflight-probes")
    reg.release_remaining()  # the fixture teardown
    plugin_session.write_session_records(state)  # pytest_sessionfinish: nothing pending any more
    rel = json.loads(b.file_path("client-releases.json").read_text())
    assert [(r["label"], r["released"]) for r in rel["releases"]] == [("probes", True), ("session client", True)]
    assert rel["all_released"] and all(r["released_at"] for r in rel["releases"]) and c2.closed == 1

"""A comparison that survives a real service (pure, fake arms): the wall-clock guard stops before a
step that would pass the plan's budget, a restore whose optimizer check mismatches stops the run,
and the arms run one after the other unless asked (the schedule the feasibility pilot timed)."""

from __future__ import annotations

import pytest
from comparison_fakes import PLAN, row, run_fake
from tinker import types

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.evidence.journal import Journal, read_entries
from dppo_harness.service.rest import RawResponse
from dppo_harness.stages.comparison import run as comparison_run
from dppo_harness.stages.comparison.config import ComparisonError, OptimizerMismatch, comparison_schedule
from dppo_harness.stages.comparison.state import ArmState, RunState
from dppo_harness.stages.comparison.wall_guard import FINALIZE_RESERVE_S, WallGuard, wall_guard_from_feasibility
from dppo_harness.train import restore as train_restore

RUN = PLAN.run


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _train(tmp_path, monkeypatch, steps, guard, clock, arm_step_s=10.0):
    def timed_step(client, arm, run, step, *a, **k):
        clock.t += arm_step_s
        return row(arm.name, step, seconds=arm_step_s)

    out, _bundle, _clients = run_fake(tmp_path, monkeypatch, steps, arm_step=timed_step, guard=guard)
    return out


def test_the_wall_guard_stops_before_the_step_that_would_pass_the_budget(tmp_path, monkeypatch):
    clock = _Clock()
    budget = 64.0  # 2 arms x 10 s per step, 5 s reserve: step 3 needs 20 + 5 s with 24 s left
    guard = WallGuard(lambda: budget - clock.t, reserve_s=5.0, clock=clock)
    out = _train(tmp_path, monkeypatch, 5, guard, clock)
    assert out.steps_completed == 2 and clock.t == 40.0 <= budget
    assert out.stopped.startswith("wall clock: step 3 projected 20 s + 5 s") and "24 s left" in out.stopped
    assert guard.step_seconds == [20.0, 20.0] and guard.as_dict()["last_check"]["step"] == 2
    assert out.final["status"] == "failed" and "wall clock" in out.final["summary"]


def test_the_first_step_is_projected_from_the_feasibility_pilot(tmp_path, monkeypatch):
    feas = {"measurements": {"training": {"seconds": 30.0, "units": 2.0}, "evaluation": {"seconds": 4.0, "units": 8}}}
    clock = _Clock()
    guard = wall_guard_from_feasibility(lambda: 40.0 - clock.t, feas, arms=2, eval_items=10)
    assert guard.first_step_estimate_s == 30.0  # 15 s per arm-step x 2 arms, no overlap assumed
    assert guard.reserve_s == pytest.approx(FINALIZE_RESERVE_S + 0.5 * 10 * 3)
    guard.clock = clock
    out = _train(tmp_path, monkeypatch, 3, guard, clock)
    assert out.steps_completed == 0 and out.stopped.startswith("wall clock: step 1")
    plain = wall_guard_from_feasibility(lambda: 1e9, None, arms=2, eval_items=10)
    assert plain.first_step_estimate_s is None and plain.reserve_s == FINALIZE_RESERVE_S


def test_without_a_budget_or_projection_the_guard_lets_steps_run(tmp_path, monkeypatch):
    clock = _Clock()
    out = _train(tmp_path, monkeypatch, 3, WallGuard(lambda: None, clock=clock), clock)
    assert out.steps_completed == 3 and out.stopped is None and out.final["status"] == "succeeded"
    spent = WallGuard(lambda: -1.0, clock=clock)
    assert spent.check(0).startswith("wall clock: step 1")  # the budget is already spent


def _raw_info(optimizer_type):
    """get_info's JSON as the server sent it, naming the optimizer family `optimizer_type`."""
    return {
        "model_data": {"model_name": "Qwen/Qwen3.5-2B"},
        "model_id": "m",
        "optimizer_config": {"type": optimizer_type},
    }


class _Restored:
    """A restored client whose SDK get_info answers `info` (tinker 0.25's GetInfoResponse drops
    optimizer_config: only the session's raw read sees a server-sent optimizer)."""

    model_id = "m"

    def __init__(self, info):
        self.info = info if isinstance(info, types.GetInfoResponse) else types.GetInfoResponse.model_validate(info)

    def get_info(self):
        return self.info


class _Session:
    """A service client whose raw reads (`ObservedServiceClient.rest`) answer get_info with `raw`."""

    def __init__(self, raw):
        self.rest = self
        self.raw = raw

    def get_info(self, model_id):
        assert model_id == "m"
        return RawResponse(200, self.raw, None)


def _restore(tmp_path, monkeypatch, info, path="tinker://m/weights/step2"):
    monkeypatch.setattr(
        train_restore,
        "create_from_state_with_response",
        lambda sc, p, name=None: (_Restored(info), types.LoadWeightsResponse(path=p)),
    )
    state = RunState("r", "p", "e", "c", "tinker://init/weights/initial", {a.name: ArmState(a.name) for a in RUN.arms})
    prior = {"restore_count": 1, "optimizer_checks": [{"after_restore": 0}, {"after_restore": 1}]}
    state.setup_provenance = {a.name: prior for a in RUN.arms}
    session = None if isinstance(info, types.GetInfoResponse) else _Session(info)
    journal = Journal(EvidenceBundle.create(tmp_path, "r", env={}))
    return state, lambda: comparison_run.restore_arm(session, state, RUN, "dppo_seed0", path, journal)


def test_a_restore_whose_optimizer_mismatches_stops_the_run(tmp_path, monkeypatch):
    state, restore = _restore(tmp_path, monkeypatch, _raw_info("dimuon"))
    with pytest.raises(OptimizerMismatch, match="optimizer mismatch after restore 2") as info:
        restore()
    assert "server 'dimuon'" in str(info.value)
    (check,) = state.arms["dppo_seed0"].optimizer_checks  # recorded before the stop
    assert check["mismatches"] and not check["matches"]
    assert info.value.arm == "dppo_seed0" and info.value.provenance["restore_count"] == 2
    # the check names the run state journaled with the load's response, before the check was made
    (entry,) = read_entries(tmp_path / "r" / "journal.jsonl")
    assert check["evidence_ref"] == entry.ref == "journal.jsonl#1" and entry.label == "dppo_seed0-restore1"
    (load,) = entry.data["arms"]["dppo_seed0"]["optimizer_checks"]
    assert load["loaded_checkpoint_uri"] == "tinker://m/weights/step2" and "mismatches" not in load
    assert [c["after_restore"] for c in info.value.provenance["optimizer_checks"]] == [0, 1, 2]


def test_a_matching_restore_continues(tmp_path, monkeypatch):
    state, restore = _restore(tmp_path, monkeypatch, _raw_info("adamw"))
    _client, prov = restore()
    (check,) = state.arms["dppo_seed0"].optimizer_checks
    assert prov["restore_count"] == 2 and check["matches"] and check["actual_optimizer"] == "adamw"


def test_a_restore_seen_only_through_the_sdk_get_info_stays_declared(tmp_path, monkeypatch):
    """tinker 0.25's GetInfoResponse drops optimizer_config: even a server that sent a different
    family cannot be seen through it, so the check stays declared (no family), and does not stop."""
    sdk_info = types.GetInfoResponse.model_validate(_raw_info("dimuon"))
    state, restore = _restore(tmp_path, monkeypatch, sdk_info)
    _client, prov = restore()
    (check,) = state.arms["dppo_seed0"].optimizer_checks
    assert check["matches"] and not check["verified"]
    assert check["actual_optimizer"] is None and check["actual_optimizer_source"] == "declared"
    assert prov["restore_count"] == 2


@pytest.mark.parametrize(
    "loaded, line",
    [
        (None, "dppo_seed0: the load of tinker://x is not observed: its response has no path"),
        ("tinker://y", "dppo_seed0: the load of tinker://x loaded 'tinker://y'"),
    ],
)
def test_a_restore_that_did_not_load_the_path_asked_for_stops_the_run(monkeypatch, loaded, line):
    monkeypatch.setattr(
        train_restore,
        "create_from_state_with_response",
        lambda sc, p, name=None: (_Restored(_raw_info("adamw")), types.LoadWeightsResponse(path=loaded)),
    )
    state = RunState("r", "p", "e", "c", "i", {a.name: ArmState(a.name) for a in RUN.arms})
    with pytest.raises(ComparisonError, match=line):
        comparison_run.restore_arm(None, state, RUN, "dppo_seed0", "tinker://x", None)
    assert state.arms["dppo_seed0"].restore_count == 0 and not state.arms["dppo_seed0"].optimizer_checks


@pytest.mark.parametrize(
    "option, backend, want",
    [
        # arm after arm: the schedule the feasibility pilot timed, and on a shared
        # trainer concurrent arms' forward_backward requests are packed into one batch
        (None, {"kind": "tinker"}, ("interleaved", "default on a real service")),
        (None, None, ("interleaved", "default on a real service")),
        (None, {"kind": "local"}, ("interleaved", "default on the embedded server")),
        ("interleaved", {"kind": "tinker"}, ("interleaved", "--comparison-schedule")),
    ],
)
def test_arms_run_one_after_the_other(option, backend, want):
    schedule, source = comparison_schedule(option, (backend or {}).get("kind"))
    assert (schedule, source.split(" (")[0]) == want


def test_the_schedule_option_defaults_to_the_service_default(pytestconfig):
    from dppo_harness.pytest_plugin.hooks import HarnessOptions

    assert HarnessOptions.__dataclass_fields__["comparison_schedule"].default is None
    assert pytestconfig.getoption("--comparison-schedule") is None


def test_each_rollout_step_says_it_started_so_no_step_is_silent(tmp_path, monkeypatch):
    """A line when a step starts (the comparison's watchdog repeats it while the step runs); its
    words never read as an arm's finished-step line (`<arm> step K/N`)."""
    lines = []
    run_fake(
        tmp_path, monkeypatch, 2, arm_step=lambda c, arm, r, step, *a, **k: row(arm.name, step), progress=lines.append
    )
    starts = [ln for ln in lines if "training rollout step" in ln]
    assert [ln.split(" (")[0] for ln in starts] == [
        "[comparison] training rollout step 1 of 2",
        "[comparison] training rollout step 2 of 2",
    ]
    assert not any(" step 1/" in ln for ln in starts)
    assert [ln.split(":")[0] for ln in lines if "/2:" in ln] == [
        f"[comparison] {a.name} step {n}/2" for n in (1, 2) for a in RUN.arms
    ]

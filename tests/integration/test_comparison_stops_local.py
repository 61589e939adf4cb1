"""The paired comparison on the embedded server stops with its evidence instead of running on:
the wall-clock guard stops before a step that would not end inside the plan's budget, and a
restore whose optimizer check mismatches stops the run. Both end as `incomplete_execution` with
the reason, the schedule used and its source recorded, and nothing evaluated. Small size (2
rollout steps x 2 groups, 32 tokens, the untrained preset) so the runs stay short."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import tinker
from sdk_session import end_session
from server_in_process import InProcessServer

from dppo_harness import constants
from dppo_harness.evidence import EvidenceBundle, verify_bundle
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.plans import load_plan
from dppo_harness.service.observed import create_from_state_with_response
from dppo_harness.stages.comparison import run as comparison_run
from dppo_harness.stages.comparison.run import StopRequested, run_comparison
from dppo_harness.stages.comparison.wall_guard import FINALIZE_RESERVE_S, WallGuard
from dppo_harness.stages.write import write_comparison

pytestmark = pytest.mark.timeout(900)
os.environ.setdefault("TINKER_TELEMETRY", "0")
PLAN = load_plan(Path(__file__).parents[2] / "tests" / "fixtures" / "plans" / "comparison-ci-small.json")
ARM_NAMES = [a.name for a in PLAN.run.arms]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # In this process: every stop here is the harness's own (wall guard, optimizer mismatch, a hang
    # raised by the test); none is about the server's process.
    run_dir = tmp_path_factory.mktemp("stops-server")
    srv = InProcessServer(Engine(run_dir, model_name="tiny-qwen3-random")).start()
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=constants.LOCAL_API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=32, seed=0)
        yield sc, tc.save_state("stops-initial").result().path
    finally:
        try:
            end_session(sc)
        finally:
            srv.stop()


def _run(engine, tmp_path, name, **kw):
    sc, init = engine
    clients = {a: create_from_state_with_response(sc, init)[0] for a in ARM_NAMES}
    restoration = SimpleNamespace(
        clients=clients,
        initial_checkpoint=init,
        provenance={"arms": {a: {"restore_count": 1, "optimizer_checks": []} for a in clients}},
    )
    bundle = EvidenceBundle.create(tmp_path / name)
    run = run_comparison(sc, PLAN, bundle, restoration, backend="local", state_root=tmp_path / "state", tag=name, **kw)
    write_comparison(bundle, run)  # what the stage fixture does: a stopped run's files and its final
    return run, bundle


def _training_block(bundle, resumed=0):
    return json.loads(bundle.file_path(f"comparison-state-r{resumed}-end.json").read_text())["training"]


def _assert_stopped_with_evidence(run, bundle, steps_done):
    assert run.steps_completed == steps_done and run.evaluated == ()  # nothing evaluated
    assert run.final["status"] == "failed" and run.final["verdict"] == "inconclusive"
    assert run.final["outcome_reason"] == "incomplete_execution"
    assert f"stopped after {steps_done} of 2 rollout steps" in run.final["summary"]
    assert bundle.result["status"] == "failed" and verify_bundle(bundle.dir) == []


def test_the_wall_guard_stops_before_a_step_that_would_pass_the_budget(engine, tmp_path):
    """Step 1 runs (no projection yet); before step 2 only 1 s of the budget is left, less than
    the measured step plus the finishing reserve: stopped there, with the guard's figures."""
    left = iter([1e6, 1.0])
    guard = WallGuard(lambda: next(left))
    run, bundle = _run(engine, tmp_path, "wall", schedule_source="--comparison-schedule", guard=guard)
    assert (
        run.stopped.startswith("wall clock: step 2 projected") and "1 s left of the plan's wall budget" in run.stopped
    )
    _assert_stopped_with_evidence(run, bundle, 1)
    block = _training_block(bundle)
    assert block["stopped"] == run.stopped and block["steps_completed"] == 1
    assert (block["schedule"], block["schedule_source"]) == ("interleaved", "--comparison-schedule")
    wall = block["wall_guard"]
    assert len(wall["step_seconds"]) == 1 and wall["step_seconds"][0] > 0
    assert wall["last_check"] == {
        "step": 1,
        "seconds_left": 1.0,
        "projected_step_seconds": wall["step_seconds"][0],
        "projection_source": "longest measured step",
        "reserve_seconds": FINALIZE_RESERVE_S,
    }
    manifest = json.loads(bundle.file_path("comparison-run-0.json").read_text())
    assert (manifest["schedule"], manifest["schedule_source"]) == ("interleaved", "--comparison-schedule")
    assert {r["arm"] for r in run.rows} == set(ARM_NAMES) and len(run.rows) == 2


def test_a_resume_whose_restored_optimizer_mismatches_stops_the_run(engine, tmp_path, monkeypatch):
    """Stopped after step 1, then resumed; the server reports a different optimizer for the first
    restored arm: the run stops before training further, the failed check in its provenance."""

    def stop_after_1(step_done):
        if step_done == 1:
            raise StopRequested("stopped after step 1")

    first, _ = _run(engine, tmp_path, "first", schedule="interleaved", stop_after=stop_after_1)
    assert first.steps_completed == 1

    real = comparison_run.server_info

    def another_optimizer(sc, client):  # get_info as sent, naming an optimizer 0.25's type would drop
        return {**real(sc, client), "optimizer_config": {"type": "dimuon"}}

    monkeypatch.setattr(comparison_run, "server_info", another_optimizer)
    run, bundle = _run(engine, tmp_path, "resumed", schedule="interleaved", resume_run_id=first.run_id)
    assert run.stopped.startswith("OptimizerMismatch: ") and "optimizer mismatch after restore 2" in run.stopped
    assert "server 'dimuon'" in run.stopped
    _assert_stopped_with_evidence(run, bundle, 1)
    assert not [r for r in run.rows if r["step"] == 1]  # step 2 never ran
    (arm,) = bundle.result["initialization_provenance"]["arms"].values()  # the arm whose check failed, posted
    assert arm["restore_count"] == 2 and arm["optimizer_checks"][-1]["mismatches"]
    assert _training_block(bundle, resumed=1)["stopped"] == run.stopped


def test_a_service_stop_mid_run_still_registers_the_training_so_far(engine, tmp_path):
    """A hang stop (a BaseException, so stage bookkeeping cannot swallow it) after step 1: the
    steps and the end state are registered, and the run ends failed with the stop's line."""
    from dppo_harness.service.wait.policy import ServiceHang

    hang = ServiceHang("forward_backward", ARM_NAMES[0], 900.0, "active")

    def stop_after(step):
        if step == 1:
            raise hang

    run, bundle = _run(engine, tmp_path, "hang", schedule="interleaved", schedule_source="test", stop_after=stop_after)
    assert run.stopped == f"no_answer: {hang.line}"
    _assert_stopped_with_evidence(run, bundle, 1)
    block = _training_block(bundle)
    assert block["stopped"] == run.stopped and block["steps_completed"] == 1
    steps = bundle.file_path("comparison-steps.jsonl").read_text().splitlines()
    assert len(steps) == 2  # both arms' step 1

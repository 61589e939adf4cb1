"""Resume of the paired comparison on the embedded server: a rehearsal stopped after step 1
(at the step boundary, as a kill leaves it: the last saved state of each arm on disk, nothing
else), continued with `resume_run_id`, gives the same per-step metrics as an uninterrupted run;
a changed plan is refused. A capacity refusal in the middle of an arm-step (after its first
minibatch update) is retried from the arm's state at the step's start, so the run equals an
undisturbed one; retrying the step as it stands (the behaviour before) applies an extra update.
Small size (2 rollout steps x 2 groups x 8, max_tokens 32, 2 test items: a step done before the
stop and one after it) so the runs stay short. Every ServiceClient the file creates is registered and must be released."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from comparison_rows import comparable, row_differences
from server_in_process import ServerInProcess

from dppo_harness.evidence import EvidenceBundle, verify_bundle
from dppo_harness.plans import load_plan
from dppo_harness.service.observed import ClientRegistry, create_from_state_with_response, make_service_client
from dppo_harness.service.wait.policy import WaitPolicy
from dppo_harness.stages.comparison import run as comparison_run
from dppo_harness.stages.comparison.config import ComparisonError
from dppo_harness.stages.comparison.state import state_path
from dppo_harness.stages.write import write_comparison

os.environ.setdefault("TINKER_TELEMETRY", "0")
PLAN = load_plan(Path(__file__).parents[2] / "tests" / "fixtures" / "plans" / "comparison-ci-small.json")


def _live_session_holders():
    """The SDK's session holders whose heartbeat still runs (each one a session not released).
    Reads SDK internals (tinker 0.25.0 InternalClientHolder), for this check only."""
    import gc

    from tinker.lib.internal_client_holder import InternalClientHolder

    gc.collect()
    return [
        h
        for h in gc.get_objects()
        if isinstance(h, InternalClientHolder)
        and getattr(h, "_session_heartbeat_task", None) is not None
        and not h._session_heartbeat_task.done()
    ]


@pytest.fixture(scope="module")
def registry():
    """Every ServiceClient of this file; all must be released when the file ends, and no SDK
    session (heartbeat) of this file may outlive it."""
    before = {id(h) for h in _live_session_holders()}
    reg = ClientRegistry()
    yield reg
    reg.release_all()
    records = reg.records()
    assert records and all(r["released"] for r in records), f"clients not released: {records}"
    deadline = time.monotonic() + 10  # the release ends a heartbeat on the SDK's loop, soon after
    while time.monotonic() < deadline and [h for h in _live_session_holders() if id(h) not in before]:
        time.sleep(0.2)
    left = [h._session_id for h in _live_session_holders() if id(h) not in before]
    assert not left, f"SDK sessions still heart-beating after the file: {left}"


def _server_and_initial_state(srv, registry, stage):
    sc = make_service_client("local", srv.base_url, registry=registry, stage=stage)
    tc = sc.create_lora_training_client(base_model=PLAN.run.base_model, rank=32, seed=0)
    return sc, tc.save_state("resume-initial").result().path


@pytest.fixture(scope="module")
def engine(shared_server, registry):
    try:
        yield _server_and_initial_state(shared_server, registry, "resume")
        assert all(r["released"] for r in registry.release_stage("resume"))
    finally:
        registry.release_stage("resume")


# The 6th optim_step on this server (numbered when they execute, interleaved schedule, 2 arms x
# 2 updates per step) is the GRPO arm's second update of step 1 in its first run; the 16th is the
# same update of the second run (the first sends 10: 8 + the refused one + the redone first).
CAPACITY_FAIL = "optim_step:6,16"


@pytest.fixture(scope="module")
def faulty_engine(tmp_path_factory, registry):
    # In this process: the test reads the refusal's retry and the server's saved states, not its process.
    srv = ServerInProcess(tmp_path_factory.mktemp("capacity-server"), "--fault-capacity-fail", CAPACITY_FAIL).start()
    try:
        yield (*_server_and_initial_state(srv, registry, "capacity"), srv)
        assert all(r["released"] for r in registry.release_stage("capacity"))
    finally:
        registry.release_stage("capacity")
        srv.stop()


def _restoration(sc, init):
    """What the preflight hands the comparison: both arms loaded from the initial checkpoint."""
    clients = {a.name: create_from_state_with_response(sc, init)[0] for a in PLAN.run.arms}
    arms = {a: {"restore_count": 1, "optimizer_checks": []} for a in clients}
    return SimpleNamespace(clients=clients, initial_checkpoint=init, provenance={"arms": arms})


def _run(engine, tmp_path, name, **kw):
    sc, init = engine[:2]
    bundle = EvidenceBundle.create(tmp_path / name)
    run = comparison_run.run_comparison(
        sc, PLAN, bundle, _restoration(sc, init), backend="local", state_root=tmp_path / "state", tag=name, **kw
    )
    write_comparison(bundle, run)  # as the stage fixture does
    return run, bundle


# Token-derived fields exactly, logprob-derived floats within C.RESUME_FLOAT_ATOL (two
# uninterrupted runs on the embedded server show ~1e-7 differences).
_row_differences = row_differences


@pytest.fixture(scope="module")
def uninterrupted(engine, tmp_path_factory):
    """The rehearsal run without a stop or a fault: the reference of both tests (the faulty server
    starts from the same seeded initial state, so it computes the same rows)."""
    full, _ = _run(engine, tmp_path_factory.mktemp("uninterrupted"), "full")
    assert full.stopped is None and full.steps_completed == 2
    return full


def _kill_after(n):
    def stop(step_done):
        if step_done == n:
            raise comparison_run.StopRequested(f"killed after step {n}")

    return stop


@pytest.fixture(scope="module")
def killed(engine, tmp_path_factory):
    """The rehearsal stopped after step 1, once for the file: (its folder, result, bundle, and its
    saved state as the stop left it)."""
    d = tmp_path_factory.mktemp("killed")
    first, bundle = _run(engine, d, "killed", stop_after=_kill_after(1))
    return d, first, bundle, state_path(d / "state", first.run_id).read_text()


def test_resumed_rehearsal_matches_an_uninterrupted_run(engine, uninterrupted, killed):
    full = uninterrupted
    tmp_path, first, first_bundle, _ = killed
    assert first.stopped == "killed after step 1" and first.steps_completed == 1
    assert first.final["outcome_reason"] == "incomplete_execution"
    saved = json.loads(state_path(tmp_path / "state", first.run_id).read_text())
    assert all(a["steps_done"] == 1 and a["state_path"] for a in saved["arms"].values())

    resumed, bundle = _run(engine, tmp_path, "resumed", resume_run_id=first.run_id)
    assert resumed.stopped is None and resumed.steps_completed == 2 and resumed.run_id == first.run_id
    key = lambda r: (r["arm"], r["step"])  # noqa: E731
    want = sorted((comparable(r) for r in full.rows), key=key)
    got = sorted((comparable(r) for r in resumed.rows), key=key)
    assert [key(r) for r in got] == [key(r) for r in want]
    problems = [p for g, w in zip(got, want) for p in _row_differences(g, w)]
    assert not problems, "resumed run differs from the uninterrupted run:\n" + "\n".join(problems)
    # Each restore is one more restore_count and optimizer check, per arm, naming what it loaded.
    prov = bundle.result["initialization_provenance"]["arms"]
    assert all(
        p["restore_count"] == 2 and [c["after_restore"] for c in p["optimizer_checks"]] == [2] for p in prov.values()
    )
    assert {a: p["loaded_checkpoint_uri"] for a, p in prov.items()} == {
        a: s["state_path"] for a, s in saved["arms"].items()
    }
    assert resumed.decision["verdict"] == "inconclusive" and resumed.decision["rehearsal"]
    # Each scored model's predictions are journaled as scored (a kill while evaluating keeps them),
    # with the bytes the writer registers at the end.
    scored = [e for e in bundle.journal.entries("record", "comparison") if e.label.startswith("evaluated ")]
    assert [e.label for e in scored] == [f"evaluated {r.arm}" for r in resumed.evaluated]
    assert [e.blob for e in scored] == [r.predictions_jsonl() for r in resumed.evaluated]
    # Both bundles verify: every evidence_ref written on resume names a registered file.
    assert verify_bundle(first_bundle.dir) == [] and verify_bundle(bundle.dir) == []
    resume = bundle.result["initialization_provenance"]["resume"]
    assert (resume["comparison_run"], resume["from_step"], resume["resumed_times"]) == (first.run_id, 1, 1)
    assert resume["continues_session"]["run_id"] == first_bundle.run_id


def test_resume_is_refused_when_the_plan_changed(engine, killed, tmp_path):
    _, first, _, saved = killed  # its saved state, copied here, under another plan's sha256
    state = json.loads(saved)
    state["plan_sha256"] = "0" * 64
    state_file = state_path(tmp_path / "state", first.run_id)
    state_file.parent.mkdir(parents=True)
    state_file.write_text(json.dumps(state))
    with pytest.raises(ComparisonError, match="plan sha256 changed"):
        _run(engine, tmp_path, "resumed", resume_run_id=first.run_id)
    with pytest.raises(ComparisonError, match="no saved comparison state"):
        _run(engine, tmp_path, "resumed2", resume_run_id="no-such-run")


def _rows(result):
    return sorted((comparable(r) for r in result.rows), key=lambda r: (r["arm"], r["step"]))


def _optimizer_steps(srv, state_uri):
    """What the server's saved state says: optimizer steps applied to that arm's weights."""
    name = state_uri.rsplit("/", 1)[1]
    (meta,) = Path(srv.run_dir).glob(f"checkpoints/*/weights/{name}/meta.json")
    return json.loads(meta.read_text())["optimizer_steps"]


def _final_steps(srv, result, tmp_path):
    state = json.loads(state_path(tmp_path / "state", result.run_id).read_text())
    return {a: _optimizer_steps(srv, s["final_state"]) for a, s in state["arms"].items()}, state


def test_capacity_refusal_mid_step_is_retried_from_the_step_start(faulty_engine, uninterrupted, tmp_path, monkeypatch):
    srv = faulty_engine[2]
    # Back off 0.1 s; the window (which opens when the refused attempt began) outlasts any step here.
    policy = WaitPolicy(backoff_s=(0.1,), capacity_patience_s=600.0, capacity_patience_after_steps_s=600.0)
    clean_steps = {"grpo_seed0": 4, "dppo_seed0": 4}  # 2 steps x 2 updates, from the initial state
    assert all(not r["retries"] for r in uninterrupted.rows)

    refused, bundle = _run(faulty_engine, tmp_path, "refused", capacity_policy=policy)
    assert srv.stats()["faults"]["injected"]["optim_step:capacity_exhausted"] == 1
    assert refused.stopped is None and refused.steps_completed == 2
    steps, state = _final_steps(srv, refused, tmp_path)
    assert steps == clean_steps  # no update applied twice
    (retry,) = state["arms"]["grpo_seed0"]["step_retries"]
    assert retry["step"] == 1 and retry["updates_sent_before_failure"] == 2  # the refused one was the 2nd
    assert "trainer capacity exhausted" in retry["error"] and retry["restored_from"].endswith("-step1-r0")
    assert not state["arms"]["dppo_seed0"]["step_retries"]
    # The restore is in the evidence: one more restore and optimizer check for that arm only.
    prov = bundle.result["initialization_provenance"]["arms"]
    assert prov["grpo_seed0"]["restore_count"] == 2 and "dppo_seed0" not in prov  # the preflight's load + this
    assert [c["after_restore"] for c in prov["grpo_seed0"]["optimizer_checks"]] == [2]
    assert [r["retries"] for r in refused.rows if r["arm"] == "grpo_seed0"] == [0, 1]
    got, want = _rows(refused), _rows(uninterrupted)
    problems = [p for g, w in zip(got, want, strict=True) for p in _row_differences(g, w)]
    assert not problems, "run with a mid-step refusal differs from the undisturbed run:\n" + "\n".join(problems)

    # Before the fix the step was rerun on the arm as it stood: one update more than the plan.
    monkeypatch.setattr(comparison_run.Arms, "restore_mid_step", lambda self, name, path, failure: None)  # as it stands
    old, _ = _run(faulty_engine, tmp_path, "old", capacity_policy=policy)
    assert srv.stats()["faults"]["injected"]["optim_step:capacity_exhausted"] == 2
    old_steps, _ = _final_steps(srv, old, tmp_path)
    assert old_steps == {"grpo_seed0": 5, "dppo_seed0": 4}

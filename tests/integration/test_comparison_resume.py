"""Resume of the paired comparison on the embedded server: a rehearsal stopped after step 2
(at the step boundary, as a kill leaves it: the last saved state of each arm on disk, nothing
else), continued with `resume_run_id`, gives the same per-step metrics as an uninterrupted run;
a changed plan is refused. Small size (3 rollout steps x 2 groups x 8, max_tokens 64, 5 test
items) so the three runs fit the unit stage."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import tinker

from dppo_harness import comparison as C
from dppo_harness import constants
from dppo_harness.comparison_run import run_comparison
from dppo_harness.evidence import EvidenceBundle
from dppo_harness.local_server.process import LocalServerProcess
from dppo_harness.plans import load_plan
from dppo_harness.restoration import create_from_state_observed

os.environ.setdefault("TINKER_TELEMETRY", "0")
REHEARSAL = load_plan(Path(__file__).parents[2] / "plans" / "rehearsal" / "comparison-local.json")
SMALL_SPEC = C.resized_spec(REHEARSAL.spec, rollout_steps=3, groups_per_batch=2, max_tokens=64, eval_items=5)
PLAN = dataclasses.replace(REHEARSAL, raw={**REHEARSAL.raw, "spec": SMALL_SPEC})  # same sha256: a test-size copy


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    srv = LocalServerProcess(run_dir=tmp_path_factory.mktemp("resume-server")).start()
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=constants.LOCAL_API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=SMALL_SPEC["base_model"], rank=32, seed=0).result()
        yield sc, tc.save_state("resume-initial").result().path
    finally:
        sc.close("success").result(timeout=60)
        srv.stop()


def _restoration(sc, init):
    """What the preflight hands the comparison: both arms loaded from the initial checkpoint."""
    clients = {a["name"]: create_from_state_observed(sc, init)[0] for a in SMALL_SPEC["arms"]}
    arms = {a: {"restore_count": 1, "optimizer_checks": []} for a in clients}
    return SimpleNamespace(clients=clients, initial_checkpoint=init, provenance={"arms": arms})


def _run(engine, tmp_path, name, **kw):
    sc, init = engine
    bundle = EvidenceBundle.create(tmp_path / name)
    return run_comparison(sc, PLAN, bundle, _restoration(sc, init), backend="local",
                          state_root=tmp_path / "state", tag=name, **kw), bundle


# What the sampled tokens decide must match exactly; logprob-derived floats only to the embedded
# server's run-to-run float noise (its batched CPU kernels are not bitwise reproducible between two
# runs, resumed or not: two uninterrupted runs show the same ~1e-7 differences).
EXACT = ("reward_mean", "format_rate", "correct_rate", "response_tokens", "loss_tokens", "updates")
FLOAT_ATOL = 2e-3


def _row_differences(got, want):
    where = f"{got['arm']} step {got['step']}"
    out = [f"{where}: {k} {got[k]!r} != {want[k]!r}" for k in EXACT if got[k] != want[k]]
    out += [f"{where}: {k} {got[k]!r} vs {want[k]!r}" for k in set(want) - set(EXACT) - {"arm", "step"}
            if abs(float(got[k]) - float(want[k])) > FLOAT_ATOL]
    return out


def _kill_after(n):
    def stop(step_done):
        if step_done == n:
            raise C.StopRequested(f"killed after step {n}")
    return stop


def test_resumed_rehearsal_matches_an_uninterrupted_run(engine, tmp_path):
    full, _ = _run(engine, tmp_path, "full")
    assert full.stopped is None and full.steps_completed == 3

    first, _first_bundle = _run(engine, tmp_path, "killed", stop_after=_kill_after(2))
    assert first.stopped == "killed after step 2" and first.steps_completed == 2
    assert first.final["outcome_reason"] == "incomplete_execution"
    saved = json.loads(C.state_path(tmp_path / "state", first.run_id).read_text())
    assert all(a["steps_done"] == 2 and a["state_path"] for a in saved["arms"].values())

    resumed, bundle = _run(engine, tmp_path, "resumed", resume_run_id=first.run_id)
    assert resumed.stopped is None and resumed.steps_completed == 3 and resumed.run_id == first.run_id
    key = lambda r: (r["arm"], r["step"])  # noqa: E731
    want = sorted((C.comparable(r) for r in full.rows), key=key)
    got = sorted((C.comparable(r) for r in resumed.rows), key=key)
    assert [key(r) for r in got] == [key(r) for r in want]
    problems = [p for g, w in zip(got, want) for p in _row_differences(g, w)]
    assert not problems, "resumed run differs from the uninterrupted run:\n" + "\n".join(problems)
    # Each restore is one more restore_count and optimizer check, per arm.
    prov = bundle.result["initialization_provenance"]["arms"]
    assert all(p["restore_count"] == 2 and [c["after_restore"] for c in p["optimizer_checks"]] == [2] for p in prov.values())
    assert resumed.decision["verdict"] == "inconclusive" and resumed.decision["rehearsal"]


def test_resume_is_refused_when_the_plan_changed(engine, tmp_path):
    first, _ = _run(engine, tmp_path, "killed", stop_after=_kill_after(1))
    state_file = C.state_path(tmp_path / "state", first.run_id)
    state = json.loads(state_file.read_text())
    state["plan_sha256"] = "0" * 64
    state_file.write_text(json.dumps(state))
    with pytest.raises(C.ComparisonError, match="plan sha256 changed"):
        _run(engine, tmp_path, "resumed", resume_run_id=first.run_id)
    with pytest.raises(C.ComparisonError, match="no saved comparison state"):
        _run(engine, tmp_path, "resumed2", resume_run_id="no-such-run")

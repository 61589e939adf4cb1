"""A capacity retry of an arm-step never applies an update twice (`run_comparison` on fake arms):
an attempt refused after it sent an update is restored from the step's start before the retry;
one refused before any update is retried as is; without a state at the step's start it stops."""

from __future__ import annotations

import json

import pytest
from comparison_fakes import PLAN, FakeClient, run_fake, updating_step

from dppo_harness.stages.comparison import run as comparison_run

BASELINE, TREATMENT = (a.name for a in PLAN.run.arms)


def _restores(monkeypatch, clients):
    """restore_arm replaced: a new FakeClient at what the client had applied when `path` was saved."""
    restored = []

    def restore_arm(_sc, state, _run, name, path, _ref):
        restored.append((name, path))
        state.arms[name].restore_count += 1
        return FakeClient(name, applied=clients[name].saved[path]), {"restore_count": 2}

    monkeypatch.setattr(comparison_run, "restore_arm", restore_arm)
    return restored


def test_a_refusal_after_an_update_restores_the_step_start_before_the_retry(tmp_path, monkeypatch):
    """The GRPO arm's step 2 is refused after its first update: the arm is restored from its state
    saved after step 1 and ends with exactly 3 x 2 updates, the refusal kept in step_retries."""
    clients = {BASELINE: FakeClient(BASELINE, refuse_at=4), TREATMENT: FakeClient(TREATMENT)}
    restored = _restores(monkeypatch, clients)
    out, bundle, _ = run_fake(tmp_path, monkeypatch, 3, clients=clients)
    assert out.steps_completed == 3 and out.stopped is None
    (where,) = restored
    assert where[0] == BASELINE and where[1].endswith("step1-r0")
    final = {r["arm"]: r["applied"] for r in out.rows if r["step"] == 2}
    assert final == {BASELINE: 6, TREATMENT: 6}  # exactly 3 steps x 2 updates each
    assert [r["retries"] for r in out.rows if r["arm"] == BASELINE] == [0, 1, 0]
    (retry,) = json.loads(bundle.file_path("comparison-state-r0-end.json").read_text())["arms"][BASELINE][
        "step_retries"
    ]
    assert retry["step"] == 1 and retry["updates_sent_before_failure"] == 2 and retry["restored_from"] == where[1]
    assert "capacity exhausted" in retry["error"]


def test_retrying_as_it_stands_would_apply_an_extra_update():
    """The fault the restore prevents: the same refusal, retried on the arm as it stands."""
    arm = FakeClient(BASELINE, applied=2, refuse_at=2)
    arm.update()
    with pytest.raises(RuntimeError):
        arm.update()
    arm.update()
    arm.update()
    assert arm.applied == 5  # one update more than the 2 + 2 the plan applies


def test_a_refusal_before_any_update_is_retried_without_a_restore(tmp_path, monkeypatch):
    def no_restore(*_):
        raise AssertionError("nothing was applied; no restore needed")

    monkeypatch.setattr(comparison_run, "restore_arm", no_restore)
    refused = []

    def sample_refused_once(client, arm, run, step, *a, attempt=0, progress=None, **k):
        if step == 0 and attempt == 0 and arm.name == BASELINE:
            refused.append(step)
            raise RuntimeError("trainer capacity exhausted")
        return updating_step(client, arm, run, step, *a, attempt=attempt, progress=progress, **k)

    out, _bundle, clients = run_fake(tmp_path, monkeypatch, 2, arm_step=sample_refused_once)
    assert refused == [0] and out.stopped is None
    assert [r["retries"] for r in out.rows if r["arm"] == BASELINE] == [1, 0]
    assert clients[BASELINE].applied == 4


def test_without_a_state_at_the_step_start_the_retry_is_refused(tmp_path, monkeypatch):
    """save_every 2: nothing was saved after step 1, so a step-2 refusal after an update cannot be
    undone; the run stops with the reason instead of applying updates twice."""
    _restores(monkeypatch, {})
    clients = {BASELINE: FakeClient(BASELINE, refuse_at=4), TREATMENT: FakeClient(TREATMENT)}
    out, _bundle, _ = run_fake(tmp_path, monkeypatch, 3, clients=clients, save_every=2)
    assert out.steps_completed == 1 and "would apply updates twice" in out.stopped
    assert out.final["status"] == "failed" and out.final["outcome_reason"] == "incomplete_execution"

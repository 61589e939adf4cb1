"""GuardedArmStep: a retried arm-step never applies an update twice (pure, with a fake arm)."""

from pathlib import Path

import pytest

from dppo_harness.loss import loss_registry
from dppo_harness.plans import load_plan
from dppo_harness.stages.comparison import arms as comparison_arms
from dppo_harness.stages.comparison.config import ArmSpec, ComparisonConfig, ComparisonError, comparison_config
from dppo_harness.stages.comparison.state import ArmState, RunState

SPEC = load_plan(Path(__file__).parents[2] / "plans" / "rehearsal" / "comparison-local.json")


class FakeArm:
    """Counts applied updates; `refuse_at` makes the n-th update call raise after nothing applied."""

    def __init__(self, applied=0, refuse_at=None):
        self.applied, self.calls, self.refuse_at = applied, 0, refuse_at

    def update(self):
        self.calls += 1
        if self.calls == self.refuse_at:
            raise RuntimeError("trainer capacity exhausted: no trainer available")
        self.applied += 1


def _runner(arm):
    spec = ArmSpec("grpo_seed0", loss_registry.GRPO_LOSS, "baseline", 0, 1e-2, 2)
    return comparison_arms.ArmRunner(spec, arm, loss_fn=None, recorder=None)


def _step(runner, attempt, progress):
    for _ in range(runner.spec.updates_per_batch):
        progress.updates_submitted += 1
        runner.client.update()
    return {"applied": runner.client.applied, "attempt": attempt}


def _retry(guard, tries=3):
    for _ in range(tries):
        try:
            return guard()
        except RuntimeError:
            continue
    raise AssertionError("never succeeded")


def test_refusal_after_an_update_restores_the_step_start_before_the_retry():
    saved = {"tinker://m/weights/step1": 2}  # the state at the step's start: 2 updates applied
    restores = []

    def restore(runner, path, failure):
        restores.append((path, dict(failure)))
        return _runner(FakeArm(applied=saved[path]))

    guard = comparison_arms.GuardedArmStep(
        _runner(FakeArm(applied=2, refuse_at=2)), 1, "tinker://m/weights/step1", restore, _step
    )
    row = _retry(guard)
    assert row == {"applied": 4, "attempt": 1}  # exactly updates_per_batch on top of the step start
    assert [p for p, _ in restores] == ["tinker://m/weights/step1"]
    (failure,) = guard.failures
    assert failure["updates_sent_before_failure"] == 2 and failure["restored_from"] == "tinker://m/weights/step1"
    assert "capacity exhausted" in failure["error"]


def test_retrying_as_it_stands_would_apply_an_extra_update():
    """The fault the guard prevents: the same refusal, retried on the arm as it stands."""
    arm = FakeArm(applied=2, refuse_at=2)
    guard = comparison_arms.GuardedArmStep(_runner(arm), 1, "tinker://m/weights/step1", lambda r, p, f: r, _step)
    guard.dirty = False
    with pytest.raises(RuntimeError):
        guard()
    assert arm.applied == 3
    guard.dirty = False  # what the old whole-step retry did
    assert guard()["applied"] == 5  # one update more than the plan


def test_refusal_before_any_update_is_retried_without_a_restore():
    def no_restore(*_):
        raise AssertionError("nothing was applied; no restore needed")

    def sample_refused_once(runner, attempt, progress):
        if attempt == 0:
            raise RuntimeError("trainer capacity exhausted")
        return _step(runner, attempt, progress)

    guard = comparison_arms.GuardedArmStep(_runner(FakeArm()), 0, None, no_restore, sample_refused_once)
    assert _retry(guard) == {"applied": 2, "attempt": 1}
    assert guard.failures[0]["updates_sent_before_failure"] == 0 and guard.failures[0]["restored_from"] is None


def test_without_a_state_at_the_step_start_the_retry_is_refused():
    guard = comparison_arms.GuardedArmStep(_runner(FakeArm(refuse_at=1)), 3, None, lambda r, p, f: r, _step)
    with pytest.raises(RuntimeError):
        guard()
    with pytest.raises(ComparisonError, match="would apply updates twice"):
        guard()


@pytest.mark.parametrize("schedule", ["interleaved", "concurrent"])
def test_train_arms_restores_the_refused_arm_from_its_step_start_state(monkeypatch, schedule):
    """The wiring in train_arms: both schedules, a refusal after the first update of the GRPO arm's
    step 1; that arm is restored from its state saved after step 1 and ends with 3 x 2 updates."""
    cfg = comparison_config(SPEC.run)
    cfg = ComparisonConfig(**{**cfg.__dict__, "steps": 3})
    fakes = {a.name: FakeArm(refuse_at=4 if a.role == "baseline" else None) for a in cfg.arms}
    saved: dict[str, int] = {}

    def fake_step(runner, step, cfg_, items, renderer, adam, tag, *, attempt=0, progress=None):
        for _ in range(runner.spec.updates_per_batch):
            progress.updates_submitted += 1
            runner.client.update()
        return {
            "arm": runner.spec.name,
            "step": step,
            "applied": runner.client.applied,
            "reward_mean": 0.0,
            "format_rate": 0.0,
            "dppo_masked_frac": 0.0,
            "ppo_clip_frac": 0.0,
            "drift_abs_p90": 0.0,
            "seconds": 0.0,
        }, []

    def save_state(runner, steps_done):
        path = f"tinker://{runner.spec.name}/weights/step{steps_done}"
        saved[path] = runner.client.applied
        return path

    restored = []

    def restore(runner, path, failure):
        restored.append((runner.spec.name, path))
        return comparison_arms.ArmRunner(runner.spec, FakeArm(applied=saved[path]), None, None)

    def call(fn):
        try:
            return fn()
        except RuntimeError:
            return fn()

    monkeypatch.setattr(comparison_arms, "run_arm_step", fake_step)
    state = RunState("r", "p", "e", "c", "tinker://init/weights/initial", {a.name: ArmState(a.name) for a in cfg.arms})
    runners = [comparison_arms.ArmRunner(a, fakes[a.name], None, None) for a in cfg.arms]
    out = comparison_arms.train_arms(
        runners,
        cfg,
        state,
        items_for_step=lambda s: [],
        renderer=None,
        tag="t",
        schedule=schedule,
        save_state=save_state,
        restore=restore,
        call=call,
    )
    assert out.steps_completed == 3 and out.stopped is None
    assert restored == [("grpo_seed0", "tinker://grpo_seed0/weights/step1")]
    final = {r["arm"]: r["applied"] for r in out.rows if r["step"] == 2}
    assert final == {"grpo_seed0": 6, "dppo_seed0": 6}  # exactly 3 steps x 2 updates each
    assert [r["retries"] for r in out.rows if r["arm"] == "grpo_seed0"] == [0, 1, 0]
    (retry,) = state.arms["grpo_seed0"].step_retries
    assert retry["step"] == 1 and retry["updates_sent_before_failure"] == 2
    assert all(s.state_step == 3 for s in state.arms.values())

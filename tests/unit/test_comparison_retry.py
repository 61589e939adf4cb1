"""GuardedArmStep: a retried arm-step never applies an update twice (pure, with a fake arm)."""

import pytest

from dppo_harness import comparison as C


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
    spec = C.ArmSpec("grpo_seed0", "grpo", "baseline", 0, 1e-2, 2)
    return C.ArmRunner(spec, arm, loss_fn=None, recorder=None)


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

    guard = C.GuardedArmStep(_runner(FakeArm(applied=2, refuse_at=2)), 1, "tinker://m/weights/step1", restore, _step)
    row = _retry(guard)
    assert row == {"applied": 4, "attempt": 1}  # exactly updates_per_batch on top of the step start
    assert [p for p, _ in restores] == ["tinker://m/weights/step1"]
    (failure,) = guard.failures
    assert failure["updates_sent_before_failure"] == 2 and failure["restored_from"] == "tinker://m/weights/step1"
    assert "capacity exhausted" in failure["error"]


def test_retrying_as_it_stands_would_apply_an_extra_update():
    """The fault the guard prevents: the same refusal, retried on the arm as it stands."""
    arm = FakeArm(applied=2, refuse_at=2)
    guard = C.GuardedArmStep(_runner(arm), 1, "tinker://m/weights/step1", lambda r, p, f: r, _step)
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

    guard = C.GuardedArmStep(_runner(FakeArm()), 0, None, no_restore, sample_refused_once)
    assert _retry(guard) == {"applied": 2, "attempt": 1}
    assert guard.failures[0]["updates_sent_before_failure"] == 0 and guard.failures[0]["restored_from"] is None


def test_without_a_state_at_the_step_start_the_retry_is_refused():
    guard = C.GuardedArmStep(_runner(FakeArm(refuse_at=1)), 3, None, lambda r, p, f: r, _step)
    with pytest.raises(RuntimeError):
        guard()
    with pytest.raises(C.ComparisonError, match="would apply updates twice"):
        guard()

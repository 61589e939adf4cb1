"""The comparison keeps the slots its end needs, computed from its arms (not a hand count for 2):
with 3 arms and a state saved at every step, the evaluation, report, a mid-step restore
and the session's closing records still fit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dppo_harness.evidence import EvidenceBundle, budget
from dppo_harness.evidence.files import MAX_FILES
from dppo_harness.evidence.verify import verify_bundle
from dppo_harness.stages.comparison import run as comparison_run


class _State(SimpleNamespace):
    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "resumed": self.resumed}


def _run(arms: int) -> SimpleNamespace:
    return SimpleNamespace(arms=tuple(SimpleNamespace(name=f"arm{i}") for i in range(arms)))


def test_three_arms_saving_every_step_leave_room_for_the_end_a_restore_and_the_close(tmp_path: Path) -> None:
    bundle = EvidenceBundle.create(tmp_path, "run")
    bundle.reserve_closing()
    for i in range(30):  # session start, preflight and gate files
        bundle.register_bytes(f"setup-{i:02d}.json", "manifest", b"{}%d" % i)
    run, state = _run(3), _State(run_id="run", resumed=0)
    restores = budget.MID_STEP_RESTORES_PER_ARM * 3
    registered = []
    for step in range(1, 51):
        kept = budget.comparison_reserve(len(run.arms), restores)
        name = comparison_run._register_saved_state(bundle, state, step, kept)
        if name is None:
            break
        registered.append(name)
    assert registered and len(registered) < 50  # the saves stop where the reserve begins
    skipped = bundle.ledger()["comparison_states_not_registered"]
    assert "kept for the evaluation, report and restores" in skipped[0]["reason"]
    for i in range(restores):  # each arm restores once mid-step
        bundle.register_json(f"comparison-state-r0-arm{i}-s9-a1.json", "manifest", {"restore": i})
    for i in range(budget.comparison_reserve(3)):  # steps, end state, evaluator, predictions, report...
        bundle.register_bytes(f"end-{i:02d}.json", "metrics", b"[%d]" % i)
    for name in budget.CLOSING_RECORDS:
        bundle.register_json(name, "log", {"closing": name})
    assert len(bundle.files()) == MAX_FILES
    bundle.finish(
        "failed",
        "inconclusive",
        "incomplete_execution",
        original_hypothesis_tested=False,
        tested_instead="budget test",
        summary="Closed.",
    )
    assert verify_bundle(bundle.dir) == []


def _arms(bundle: EvidenceBundle, arms: int, monkeypatch) -> comparison_run.Arms:
    monkeypatch.setattr(comparison_run, "make_loss", lambda arm, run: None)
    state = _State(run_id="run", resumed=0)
    return comparison_run.Arms(None, bundle, _run(arms), state, Path("unused"), 1, "t", lambda _m: None)


def test_a_mid_step_restore_uses_its_kept_slot_and_past_it_stops_in_one_line(tmp_path: Path, monkeypatch) -> None:
    import pytest

    from dppo_harness.stages.comparison.config import ComparisonError

    bundle = EvidenceBundle.create(tmp_path, "run")
    bundle.reserve_closing()
    arms = _arms(bundle, 3, monkeypatch)
    while bundle.free_slots() > budget.comparison_reserve(len(arms.run.arms), 3):  # saves took every slot they could
        bundle.register_bytes(f"saved-{len(bundle.files()):02d}.json", "manifest", b"%d" % len(bundle.files()))
    restored = []
    monkeypatch.setattr(
        comparison_run, "restore_arm", lambda *a, **k: (restored.append(a[3]) or object(), {"restore_count": 2})
    )
    failure = {"step": 8, "attempt": 1, "updates_sent_before_failure": 1, "error": "refused"}
    for attempt in range(1, 4):  # one kept slot per arm: three restores register their state
        arms.restore_mid_step("arm0", "tinker://x/state", dict(failure, attempt=attempt))
    assert len(restored) == 3 and bundle.free_slots() == budget.comparison_reserve(len(arms.run.arms), 0)
    with pytest.raises(ComparisonError, match="no evidence file slot left") as exc:
        arms.restore_mid_step("arm0", "tinker://x/state", dict(failure, attempt=4))
    assert "\n" not in str(exc.value) and len(restored) == 3  # refused before any restore was sent

"""A resume reuses a checkpoint only when its record is what was hashed when it was saved and what
the run states its sessions journaled say; otherwise it is refused in one line, before the rewind
picks anything to reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.evidence.journal import Journal
from dppo_harness.stages.comparison.config import ComparisonError
from dppo_harness.stages.comparison.resume import checkpoint_problems, load_owned_state, rewind_to_common_save
from dppo_harness.stages.comparison.state import ArmState, RunState, checkpoint_record_sha256, state_path

RUN = "20261203T000000Z-run001"


def _saved_run(tmp_path: Path, steps: int = 2) -> tuple[RunState, EvidenceBundle]:
    """A run whose first session saved both arms after each of `steps` steps, the last common save
    journaled in its bundle as the harness does (a "state" entry labelled s<step>, journal.jsonl#1)."""
    bundle = EvidenceBundle.create(tmp_path / "evidence", RUN, env={})
    st = RunState(
        RUN,
        "p" * 64,
        "e" * 64,
        "c" * 64,
        "tinker://init",
        {a: ArmState(a) for a in ("grpo", "dppo")},
        sessions=[{"run_id": RUN, "dir": str(bundle.dir)}],
    )
    for step in range(1, steps + 1):
        for a in st.arms.values():
            a.steps_done = step
            a.record_save(RUN, step, f"tinker://{a.name}/weights/step{step}-r0")
    Journal(bundle).append("comparison", "state", f"s{steps}", st.to_json())
    st.save(state_path(tmp_path / "state", RUN))
    return st, bundle


def _edit(tmp_path: Path, edit) -> RunState:
    path = state_path(tmp_path / "state", RUN)
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    return load_owned_state(tmp_path / "state", RUN)


def test_an_untouched_state_passes(tmp_path):
    _saved_run(tmp_path)
    assert checkpoint_problems(load_owned_state(tmp_path / "state", RUN)) == []


@pytest.mark.parametrize(
    "edit, says",
    [
        (
            lambda d: d["arms"]["dppo"]["saves"].update({"2": "tinker://other/weights/x"}),
            "arm dppo's checkpoint record at step 2 (tinker://other/weights/x) does not match the sha256 recorded",
        ),
        (
            lambda d: d["arms"]["dppo"].update(
                saves=d["arms"]["grpo"]["saves"], state_path=d["arms"]["grpo"]["state_path"]
            ),
            "arm dppo's checkpoint record at step 1 (tinker://grpo/weights/step1-r0) does not match",
        ),
        (lambda d: d["arms"]["grpo"]["save_hashes"].pop("2"), "arm grpo's checkpoint at step 2 has no hash recorded"),
        (
            lambda d: d["arms"]["grpo"].update(state_path="tinker://grpo/weights/elsewhere"),
            "arm grpo's current state tinker://grpo/weights/elsewhere is not one of its hashed saves",
        ),
    ],
    ids=["path-swapped", "other-arms-saves", "hash-removed", "current-not-saved"],
)
def test_a_tampered_checkpoint_record_is_refused(tmp_path, edit, says):
    _saved_run(tmp_path)
    problems = checkpoint_problems(_edit(tmp_path, edit))
    assert problems and problems[0].startswith(says), problems


def test_a_record_rehashed_by_hand_still_disagrees_with_the_journaled_state(tmp_path):
    """Whoever edits the state and its hash too is caught by the state the session journaled."""
    _saved_run(tmp_path)

    def swap(d):
        d["arms"]["dppo"]["saves"]["2"] = d["arms"]["dppo"]["state_path"] = "tinker://other/weights/x"
        d["arms"]["dppo"]["save_hashes"]["2"] = checkpoint_record_sha256(RUN, "dppo", 2, "tinker://other/weights/x")

    st = _edit(tmp_path, swap)
    (problem,) = checkpoint_problems(st)  # the record hashes as recorded: only the journaled state disagrees
    assert problem == (
        f"arm dppo's checkpoint at step 2 is tinker://other/weights/x in the state but "
        f"tinker://dppo/weights/step2-r0 in {RUN}/journal.jsonl#1"
    )


def test_an_altered_journal_refuses_the_resume_in_one_line(tmp_path):
    _, bundle = _saved_run(tmp_path)
    Journal(bundle).snapshot("comparison", "comparison step 2 saved")
    path = bundle.dir / "journal.jsonl"
    path.write_bytes(b"{}\n" + path.read_bytes().split(b"\n", 1)[1])  # the state entry replaced
    with pytest.raises(ComparisonError) as e:
        checkpoint_problems(load_owned_state(tmp_path / "state", RUN))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--resume {RUN} refused: {path}: line 1 is not journal entry 1")


def test_steps_saved_again_after_a_resume_are_not_held_to_the_earlier_copy(tmp_path):
    """A resume from step 1 trains step 2 again and saves it under a new path: the first session's
    copy (step 2, the old path) binds only up to step 1."""
    st, _ = _saved_run(tmp_path)
    st.arms["dppo"].saves.pop("2")
    st.arms["dppo"].save_hashes.pop("2")
    assert rewind_to_common_save(st, steps=3) == 1 and "2" not in st.arms["grpo"].saves  # later saves dropped
    st.resumes.append({"session": "s2", "continues_session": RUN, "from_step": 1})
    for a in st.arms.values():
        a.record_save(RUN, 2, f"tinker://{a.name}/weights/step2-r1")
    assert checkpoint_problems(st) == []
    st.resumes.clear()  # without the resume, the earlier copy binds step 2 as well
    assert len(checkpoint_problems(st)) == 2


def test_the_resume_is_refused_in_one_line_before_anything_is_reused(tmp_path):
    """Through the run's state opening, as `--resume` runs it: one line, before any rewind or reuse."""
    from types import SimpleNamespace

    from dppo_harness.stages.comparison import run as comparison_run

    _saved_run(tmp_path)
    _edit(tmp_path, lambda d: d["arms"]["grpo"]["saves"].update({"1": "tinker://x/weights/y"}))
    plan = SimpleNamespace(sha256="p" * 64, run=SimpleNamespace(rollout_steps=3))
    bundle = EvidenceBundle.create(tmp_path / "evidence", "20261203T010000Z-res001", env={})
    with pytest.raises(ComparisonError) as e:
        comparison_run._run_state(plan, bundle, "e" * 64, None, tmp_path / "state", RUN)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--resume {RUN} refused: arm grpo's checkpoint record at step 1")


@pytest.fixture(autouse=True)
def _same_code(monkeypatch):
    from dppo_harness.stages.comparison import run as comparison_run

    monkeypatch.setattr(comparison_run, "package_files_sha256", lambda _dir: "c" * 64)


def test_a_refused_state_write_is_the_evidences_one_line(tmp_path, monkeypatch):
    import errno
    import os

    from dppo_harness.evidence import UnwritableEvidenceError
    from dppo_harness.stages.comparison import state as state_module

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(state_module, "atomic_write", full)
    st = RunState(RUN, "p", "e", "c", "tinker://init", {"a": ArmState("a")})
    path = state_path(tmp_path, RUN)
    with pytest.raises(UnwritableEvidenceError) as e:
        st.save(path)
    assert str(e.value).startswith(f"evidence not written: {path}: the disk is full (ENOSPC); free space")

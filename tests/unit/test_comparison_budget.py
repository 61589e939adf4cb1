"""The comparison counts no file slots: its rows, run states and snapshots go to the journal as
they are committed, and its files are registered after its loop. A run saving at every step, in a
bundle with room for nothing but its end files and the close, still ends with both."""

from __future__ import annotations

from pathlib import Path

from comparison_fakes import run_fake

from dppo_harness.evidence import EvidenceBundle, budget
from dppo_harness.evidence.journal import Journal
from dppo_harness.evidence.verify import verify_bundle


def test_a_run_saving_every_step_journals_its_loop_and_registers_only_its_end_files(tmp_path: Path, monkeypatch):
    bundle = EvidenceBundle.create(tmp_path / "runs", "fake")
    bundle.reserve_closing()
    while bundle.free_slots() > 3:  # left: the run's manifest, its rows, its end state
        bundle.register_bytes(f"setup-{len(bundle.files()):02d}.json", "manifest", b"%d" % len(bundle.files()))
    out, bundle, _ = run_fake(tmp_path, monkeypatch, 3, bundle=bundle)
    assert out.stopped is None and out.steps_completed == 3
    end_files = [f["name"] for f in bundle.files()[-3:]]
    assert end_files == ["comparison-run-0.json", "comparison-steps.jsonl", "comparison-state-r0-end.json"]
    assert bundle.free_slots() == 0
    journal = Journal(bundle)
    assert [e.label for e in journal.entries("state")] == [f"s{k}" for k in range(1, 4)]
    assert [(r.data["arm"], r.data["step"]) for r in journal.entries("row")] == [
        (r["arm"], r["step"]) for r in out.rows
    ]
    snapshots = journal.entries("snapshot")
    assert [s.label for s in snapshots] == ["comparison setup", *(f"comparison step {k} saved" for k in range(1, 4))]
    for name in budget.CLOSING_RECORDS:
        bundle.register_json(name, "log", {"closing": name})
    assert verify_bundle(bundle.dir) == []

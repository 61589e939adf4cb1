"""The diagnostic's update records: each in the journal before its step, registered at the stage end
with their sha256 a few per file, split at the per-file limit, read by replay and verify."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from diagnostic_rehearsal import simulate_records

from dppo_harness.evidence import EvidenceBundle, LimitError, UnwritableEvidenceError
from dppo_harness.evidence import bundle as bundle_module
from dppo_harness.evidence.files import sha256_bytes
from dppo_harness.evidence.journal import JOURNAL_FILE
from dppo_harness.evidence.verify import verify_bundle
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument import replay
from dppo_harness.stages.diagnostic import write as update_archive
from dppo_harness.stages.diagnostic.write import journal_record, register_update_archives


@pytest.fixture(scope="module")
def records() -> list[ins.LossCallRecord]:
    return simulate_records(seed=3, n_updates=6, minibatches_per_epoch=3, sequences=6, drift_per_update=0.08)


def test_records_are_journaled_before_registration_and_archived_per_file(tmp_path: Path, records) -> None:
    bundle = EvidenceBundle.create(tmp_path, "run")
    for i, rec in enumerate(records):
        journal_record(bundle, rec)
        kept = bundle.journal.entries("record", "diagnostic")  # durable before the step
        assert [ins.records_from_npz(e.blob)[0].context["update_index"] for e in kept if e.blob] == [
            r.context["update_index"] for r in records[: i + 1]
        ]
    assert bundle.files() == []
    names = register_update_archives(bundle, records, per_file=4)
    assert (
        names == [e["name"] for e in bundle.files()] == ["diagnostic-updates-01-04.npz", "diagnostic-updates-05-06.npz"]
    )
    assert bundle.file_path(names[0]).read_bytes() == ins.records_to_npz(records[:4])
    for entry in bundle.files():
        assert entry["sha256"] == sha256_bytes(bundle.file_path(entry["name"]).read_bytes())
    assert verify_bundle(bundle.dir) == []
    report = replay.replay_bundle(bundle.dir)
    assert report.ok, report.problems
    assert len(report.checks) == 6


def test_an_archive_over_the_per_file_limit_is_split_and_a_record_too_large_refused(
    tmp_path: Path, records, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = len(ins.records_to_npz(records[:1]))
    monkeypatch.setattr(update_archive, "MAX_FILE_BYTES", int(one * 2.5))
    bundle = EvidenceBundle.create(tmp_path, "run")
    assert register_update_archives(bundle, records[:4], per_file=4) == [
        "diagnostic-updates-01-02.npz",
        "diagnostic-updates-03-04.npz",
    ]
    assert replay.replay_bundle(bundle.dir).ok
    monkeypatch.setattr(update_archive, "MAX_FILE_BYTES", one // 2)
    monkeypatch.setattr("dppo_harness.evidence.files.MAX_FILE_BYTES", one // 2)
    with pytest.raises(LimitError, match="per file"):
        register_update_archives(bundle, records[4:5], per_file=4)


def test_a_journal_append_the_disk_refuses_is_the_evidence_one_line_and_fails_the_run(
    tmp_path: Path, records, monkeypatch
) -> None:
    bundle = EvidenceBundle.create(tmp_path, "run", env={})

    def append_durably(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(bundle_module, "append_durably", append_durably)
    with pytest.raises(UnwritableEvidenceError, match=f"{JOURNAL_FILE}: the disk is full"):
        journal_record(bundle, records[0])
    assert json.loads((bundle.dir / "result.json").read_text())["status"] == "failed"

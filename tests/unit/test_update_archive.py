"""The diagnostic's update records in archive files: persisted before each step, registered with
their sha256 a few per file, split at the per-file limit, read by replay and verify."""

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
from dppo_harness.evidence.verify import verify_bundle
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument import replay
from dppo_harness.stages.diagnostic import write as update_archive
from dppo_harness.stages.diagnostic.write import STAGING_FILE, UpdateArchive


@pytest.fixture(scope="module")
def records() -> list[ins.LossCallRecord]:
    return simulate_records(seed=3, n_updates=6, minibatches_per_epoch=3, sequences=6, drift_per_update=0.08)


def test_records_are_staged_before_registration_and_archived_per_file(tmp_path: Path, records) -> None:
    bundle = EvidenceBundle.create(tmp_path, "run")
    archive = UpdateArchive(bundle, per_file=4)
    for i, rec in enumerate(records[:3]):
        archive.add(rec)
        staged = ins.records_from_npz((bundle.dir / STAGING_FILE).read_bytes())  # durable before the step
        assert [r.context["update_index"] for r in staged] == [r.context["update_index"] for r in records[: i + 1]]
        assert bundle.files() == []
    archive.add(records[3])
    assert [e["name"] for e in bundle.files()] == ["diagnostic-updates-01-04.npz"]
    assert not (bundle.dir / STAGING_FILE).exists()
    for rec in records[4:]:
        archive.add(rec)
    assert archive.flush() == ["diagnostic-updates-05-06.npz"]  # a stop mid-archive registers the rest
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
    archive = UpdateArchive(bundle, per_file=4)
    for rec in records[:4]:
        archive.add(rec)
    assert [e["name"] for e in bundle.files()] == ["diagnostic-updates-01-02.npz", "diagnostic-updates-03-04.npz"]
    assert replay.replay_bundle(bundle.dir).ok
    monkeypatch.setattr(update_archive, "MAX_FILE_BYTES", one // 2)
    monkeypatch.setattr("dppo_harness.evidence.files.MAX_FILE_BYTES", one // 2)
    with pytest.raises(LimitError, match="per file"):
        archive.add(records[4])
        archive.flush()


def test_a_staging_write_the_disk_refuses_is_the_evidence_one_line_and_fails_the_run(
    tmp_path: Path, records, monkeypatch
) -> None:
    bundle = EvidenceBundle.create(tmp_path, "run", env={})
    real = bundle_module.atomic_write

    def atomic_write(path: Path, data: bytes) -> None:
        if path.name == STAGING_FILE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(bundle_module, "atomic_write", atomic_write)
    with pytest.raises(UnwritableEvidenceError, match=f"{STAGING_FILE}: the disk is full"):
        UpdateArchive(bundle, per_file=4).add(records[0])
    assert json.loads((bundle.dir / "result.json").read_text())["status"] == "failed"

"""Every evidence write that the disk refuses (full, read-only, permission denied) is one line naming
the file and the reason, never a raw OSError; the run is then failed and closed where result.json can
still be written, and a bundle that cannot be closed is no longer the one LATEST names."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from small_disk import mounted_tmpfs

from dppo_harness.evidence import EvidenceBundle, UnwritableEvidenceError, verify_bundle
from dppo_harness.evidence import bundle as bundle_module
from dppo_harness.evidence.session import unclosed_line


def _refuse_under(monkeypatch, where: str, code: int) -> None:
    """The write seam refuses every path containing `where` with `code` (the others are written)."""
    real = bundle_module.atomic_write

    def atomic_write(path: Path, data: bytes) -> None:
        if where in str(path):
            raise OSError(code, os.strerror(code), str(path))
        real(path, data)

    monkeypatch.setattr(bundle_module, "atomic_write", atomic_write)


@pytest.mark.parametrize(
    "code, why",
    [
        (errno.ENOSPC, "the disk is full (ENOSPC)"),
        (errno.EROFS, "the file system is read-only (EROFS)"),
        (errno.EACCES, "permission denied (EACCES)"),
    ],
)
def test_a_refused_file_write_is_one_line_and_closes_the_run_failed(tmp_path, monkeypatch, code, why):
    b = EvidenceBundle.create(tmp_path, "full", env={})
    b.update_result(metrics={"kept": 1.0})
    _refuse_under(monkeypatch, "/files/", code)
    with pytest.raises(UnwritableEvidenceError) as e:
        b.register_bytes("update-01.npz", "tensors", b"x" * 1000)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"evidence not written: {b.file_path('update-01.npz')}: {why}")
    assert "--evidence-dir" in line
    r = json.loads((b.dir / "result.json").read_text())  # closed at once: result.json itself could be written
    assert (r["status"], r["verdict"], r["outcome_reason"]) == ("failed", "inconclusive", "incomplete_execution")
    assert "could not be written" in r["summary"] and r["metrics"]["kept"] == 1.0
    assert b.entry("update-01.npz") is None
    b.finish(
        "succeeded",
        "inconclusive",
        "incomplete_execution",
        "Stages run: diagnostic. All passed.",
        original_hypothesis_tested=False,
        tested_instead="nothing",
    )  # a later close cannot undo it
    r = json.loads((b.dir / "result.json").read_text())
    assert r["status"] == "failed" and "could not be written" in r["summary"]
    assert verify_bundle(b.dir) == [] and unclosed_line(b) is None


def test_a_bundle_whose_result_cannot_be_closed_is_not_named_by_latest(tmp_path, monkeypatch):
    b = EvidenceBundle.create(tmp_path, "stuck", env={})
    _refuse_under(monkeypatch, str(tmp_path), errno.ENOSPC)
    with pytest.raises(UnwritableEvidenceError, match="result.json: the disk is full"):
        b.finish(
            "succeeded",
            "inconclusive",
            "incomplete_execution",
            "Stages run: unit. All passed.",
            original_hypothesis_tested=False,
            tested_instead="nothing",
        )
    assert json.loads((b.dir / "result.json").read_text())["status"] == "running"
    line = unclosed_line(b)
    assert line is not None and "left incomplete" in line and "LATEST no longer names it" in line
    assert not (tmp_path / "LATEST").exists()


def test_creating_a_bundle_where_nothing_can_be_made_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UnwritableEvidenceError, match=r"^evidence not written: .*a-file/run: "):
        EvidenceBundle.create(tmp_path / "a-file", "run", env={})


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs: a real ENOSPC (root only; skipped where mounting is not allowed)."""
    with mounted_tmpfs(tmp_path / "tiny", "64k") as mnt:
        yield mnt


def test_a_real_full_disk_gives_one_line_and_a_failed_closed_result(tiny_disk):
    b = EvidenceBundle.create(tiny_disk, "real", env={})
    b.register_bytes("small.json", "manifest", b"{}\n")
    with pytest.raises(UnwritableEvidenceError, match=r"big\.bin: the disk is full \(ENOSPC\)"):
        b.register_bytes("big.bin", "tensors", os.urandom(256 * 1024))
    assert not [p for p in (tiny_disk / "real").rglob("*") if ".tmp-" in p.name]  # its space given back
    r = json.loads((tiny_disk / "real" / "result.json").read_text())
    assert r["status"] == "failed" and "ENOSPC" in r["summary"]
    assert (tiny_disk / "LATEST").read_text().strip() == "real" and verify_bundle(tiny_disk / "real") == []


def test_too_little_free_space_is_refused_up_front(tmp_path, monkeypatch):
    """Checked at configure time with the probe write: a disk with less room than a run's evidence
    can take is refused before anything runs, in one line."""
    import shutil
    from collections import namedtuple

    from dppo_harness.evidence import files

    assert files.unwritable_reason(tmp_path) is None
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage(2**30, 2**30 - 2**20, 2**20))
    assert files.unwritable_reason(tmp_path / "runs") == (
        f"only 1.0 MiB free in {tmp_path}; a run's evidence needs 50 MiB (its 40 MiB limit and one 10 MiB file "
        "being written)"
    )
    monkeypatch.setattr(files.shutil, "disk_usage", shutil.disk_usage)


def test_a_real_small_disk_is_refused_up_front(tiny_disk):
    from dppo_harness.evidence.files import unwritable_reason

    assert unwritable_reason(tiny_disk).startswith(f"only 0.1 MiB free in {tiny_disk}; a run's evidence needs 50 MiB")

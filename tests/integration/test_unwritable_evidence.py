"""An evidence directory nothing can be written in is refused before anything runs, in one line
(a read-only mount: /proc here, which even root cannot write; permission bits say nothing for root).
A disk that fills during the run gives one line too, and a closed, failed result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_env import harness_env
from small_disk import mounted_tmpfs

from dppo_harness.evidence.files import unwritable_reason

ROOT = Path(__file__).resolve().parents[2]
READ_ONLY = Path("/proc/dppo-harness-evidence")


def test_the_reason_names_the_directory_and_what_failed(tmp_path):
    assert unwritable_reason(tmp_path / "not" / "yet" / "made") is None  # its parent is writable
    (tmp_path / "a-file").write_text("x")
    assert unwritable_reason(tmp_path / "a-file" / "runs") == f"{tmp_path / 'a-file'} is not a directory"
    if Path("/proc").is_dir():
        assert unwritable_reason(READ_ONLY).startswith("cannot write in /proc: ")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs a read-only mount (/proc)")
def test_a_read_only_evidence_dir_is_refused_in_one_line_before_any_stage():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-m",
            "preflight",
            f"--evidence-dir={READ_ONLY}",
        ],
        cwd=ROOT,
        env=harness_env(PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"ERROR: --evidence-dir {READ_ONLY}: cannot write in /proc: "), line
    assert line.endswith("; nothing was run (give a writable directory with room)"), line
    assert "Traceback" not in out and " passed" not in out


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs: room enough for the up-front check, so the disk can fill during the run (root only)."""
    with mounted_tmpfs(tmp_path / "small", "64m") as mnt:
        yield mnt


@pytest.mark.timeout(600)
def test_a_disk_that_fills_during_the_run_is_one_line_and_a_closed_failed_result(small_disk):
    """The disk passes the up-front check, then fills (another writer) while the embedded server
    starts: the session's first records fit, its 2.5 MB code archive does not (a real ENOSPC). One
    line naming the file and the reason, no traceback, exit 1, the run failed and closed, and the
    bundle verifies."""
    harness = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "tests/preflight/test_backend_record.py",
            f"--evidence-dir={small_disk}",
        ],
        cwd=ROOT,
        env=harness_env(PYTHONPATH=str(ROOT / "src"), TINKER_BASE_URL=None),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    out = []
    try:
        for line in harness.stdout:
            out.append(line)
            if "[local server] ready at" in line and not (small_disk / "filler").exists():
                free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
                with open(small_disk / "filler", "wb") as f:  # leaves 512 KiB: a few records, no archive
                    f.write(b"\0" * (free - 512 * 1024))
        harness.wait(60)
    finally:
        harness.kill()
    text = "".join(out)
    assert (small_disk / "filler").exists(), text[-3000:]
    assert harness.returncode == pytest.ExitCode.TESTS_FAILED, text[-3000:]
    assert "Traceback" not in text and "OSError" not in text and "INTERNALERROR" not in text, text[-3000:]
    lines = {ln.strip() for ln in text.splitlines() if "evidence not written:" in ln}
    assert lines and all("code-archive.zip: the disk is full (ENOSPC); free space" in ln for ln in lines), text[-3000:]
    run = small_disk / (small_disk / "LATEST").read_text().strip()
    r = json.loads((run / "result.json").read_text())
    assert (r["status"], r["verdict"]) == ("failed", "inconclusive") and "could not be written" in r["summary"]
    v = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        env=harness_env(PYTHONPATH=str(ROOT / "src")),
    )
    assert v.returncode == 0 and "(status failed)" in v.stdout, v.stdout + v.stderr


def test_a_disk_without_room_for_a_run_is_refused_before_any_stage(tmp_path):
    """A 1 MiB tmpfs: less than a run's evidence can take, refused at configure time in one line."""
    with mounted_tmpfs(tmp_path / "tiny", "1m") as mnt:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-q",
                "-m",
                "preflight",
                f"--evidence-dir={mnt}",
            ],
            cwd=ROOT,
            env=harness_env(PYTHONPATH=str(ROOT / "src")),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, (proc.stdout + proc.stderr)[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"ERROR: --evidence-dir {mnt}: only 1.0 MiB free in {mnt}; a run's evidence needs 50 MiB")

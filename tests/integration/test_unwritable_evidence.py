"""An evidence directory nothing can be written in is refused before anything runs, in one line
(a read-only mount: /proc here, which even root cannot write; permission bits say nothing for root)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_env import harness_env

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
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "preflight",
                           f"--evidence-dir={READ_ONLY}"], cwd=ROOT, env=harness_env(PYTHONPATH=str(ROOT / "src")),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"ERROR: --evidence-dir {READ_ONLY}: cannot write in /proc: "), line
    assert line.endswith("; nothing was run (give a writable directory)"), line
    assert "Traceback" not in out and " passed" not in out

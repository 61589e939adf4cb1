"""Whatever fails inside the session's start (`start_session`: provenance, archive, plan records),
the bundle it opened is closed: failed, verifiable, never left `running` behind LATEST."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_env import harness_env

ROOT = Path(__file__).resolve().parents[2]

# Loaded with -p before the session: start_session fails after its first records are written.
_PLANTED = """
from dppo_harness.pytest_plugin import fixtures


def start_session(bundle, **kw):
    bundle.update_result(metrics={"planted/started": 1.0})
    raise RuntimeError("planted failure inside start_session")


fixtures.start_session = start_session
"""


@pytest.mark.timeout(600)
def test_a_failure_inside_start_session_still_closes_the_bundle(tmp_path):
    (tmp_path / "planted_start_failure.py").write_text(_PLANTED)
    evidence = tmp_path / "evidence"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "planted_start_failure",
            "-q",
            "tests/preflight/test_backend_record.py",
            f"--evidence-dir={evidence}",
        ],
        cwd=ROOT,
        env=harness_env(PYTHONPATH=f"{ROOT / 'src'}:{tmp_path}", TINKER_BASE_URL=None),
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED and "planted failure inside start_session" in out, out[
        -3000:
    ]
    run = evidence / (evidence / "LATEST").read_text().strip()
    r = json.loads((run / "result.json").read_text())
    assert (r["status"], r["verdict"]) == ("failed", "inconclusive"), r
    assert r["metrics"]["planted/started"] == 1.0 and "preflight" in r["summary"], r["summary"]
    v = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        env=harness_env(PYTHONPATH=str(ROOT / "src")),
    )
    assert v.returncode == 0 and "(status failed)" in v.stdout, v.stdout + v.stderr

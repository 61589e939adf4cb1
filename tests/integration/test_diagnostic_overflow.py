"""The diagnostic past one evidence file per update: 24 updates in 3 archive files, beside the
session, preflight, fixed diagnostic files and closing records. Run as a user runs it, the bundle
closes within its limits, its closing records are there, its journal holds every update's record and
snapshot, it verifies, and its update archives replay every loss call."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_env import harness_env

from dppo_harness.evidence.files import MAX_FILES
from dppo_harness.evidence.journal import JOURNAL_FILE, read_entries

ROOT = Path(__file__).resolve().parents[2]
PLAN = "diagnostic-ci-overflow.json"
# What `finish` registers last; unit-parity-summary.json needs the unit stage, not run here.
CLOSING = ("client-identities.json", "client-releases.json", "budget-ledger.json")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=harness_env(PYTHONPATH=str(ROOT / "src")),
    )


@pytest.mark.timeout(600)
def test_a_diagnostic_past_one_file_per_update_closes_within_the_bundle(tmp_path):
    plans = tmp_path / "plans"
    plans.mkdir()
    shutil.copy(ROOT / "plans" / "exp_e6b0965af3.json", plans)  # the original plan it names
    shutil.copy(ROOT / "plans" / "exp_e6b0965af3.json.resolution.json", plans)
    shutil.copy(ROOT / "tests" / "fixtures" / "plans" / PLAN, plans)
    updates = json.loads((plans / PLAN).read_text())["schedule"]["max_optimizer_updates"]
    evidence = tmp_path / "evidence"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/preflight",
            "tests/diagnostic",
            f"--plan={plans / PLAN}",
            f"--evidence-dir={evidence}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        env=harness_env(PYTHONPATH=str(ROOT / "src"), TINKER_BASE_URL=None),
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    bundle = evidence / (evidence / "LATEST").read_text().strip()
    result = json.loads((bundle / "result.json").read_text())
    assert result["status"] == "succeeded", result["summary"]
    assert result["metrics"]["diagnostic/updates_done"] == updates

    # The budget is checked at each write, with the closing records reserved from the session's start.
    reserve = json.loads((bundle / "ledger.json").read_text())["evidence_budget"]
    assert reserve["limit_files"] == MAX_FILES and set(CLOSING) <= set(reserve["closing_records"]), reserve

    registered = [f["name"] for f in result["evidence"]["files"]]
    archives = sorted(n for n in registered if n.startswith("diagnostic-updates-"))
    assert len(registered) <= MAX_FILES and sorted(p.name for p in (bundle / "files").iterdir()) == sorted(registered)
    assert set(CLOSING) <= set(registered), sorted(set(CLOSING) - set(registered))
    assert archives == ["diagnostic-updates-01-08.npz", "diagnostic-updates-09-16.npz", "diagnostic-updates-17-24.npz"]
    journal = read_entries(bundle / JOURNAL_FILE)  # what a kill would have left: every record, the snapshots
    records = [e.label for e in journal if e.kind == "record"]
    assert records == ["frozen batch", *(f"update {u}" for u in range(1, updates + 1))]
    frozen = (bundle / "files" / "diagnostic-frozen-batch.npz").read_bytes()
    assert next(e.blob for e in journal if e.label == "frozen batch") == frozen  # the writer registers those bytes
    assert [e.label for e in journal if e.kind == "snapshot"][-1] == "stage diagnostic end"

    verify = _cli("dppo_harness.evidence", "verify", str(bundle))
    assert verify.returncode == 0 and "verify: OK" in verify.stdout and "(status succeeded)" in verify.stdout, (
        verify.stdout + verify.stderr
    )
    replay = _cli("dppo_harness.instrument.replay", str(bundle))
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert (
        f"replay: {updates} loss calls from {len(archives)} files, {updates} matched, 0 problem(s)" in replay.stdout
    ), replay.stdout[-2000:]

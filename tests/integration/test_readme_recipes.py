"""The README's recipe "The harness against a server you started", step 2, as written:
the embedded server (default profile, the stand-in model on CPU) on a free port, the `tinker`
backend, exactly the README's variables (no Modal ones) and its command line. Three things are
added: a CI-size diagnostic plan (the README's default plan is the requester's full 32 x 8 batch),
an evidence dir outside the repository, given with a space as a user types it, and the test paths
`UNIT_PARITY_AND_STAGES`, so that unit parity in this session is the loss-parity file (the whole
unit suite runs in this same CI; the diagnostic still starts only after it passed here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness_paths import LOSS_PARITY

from dppo_harness.local_server.process import LocalServerProcess, live_child_pids
from dppo_harness.service.secrets_scan import SECRET_ENV_VARS

ROOT = Path(__file__).resolve().parents[2]
CI_PLAN = ROOT / "tests" / "fixtures" / "plans" / "diagnostic-ci-short.json"
README_URL = "http://127.0.0.1:8123"
UNIT_PARITY_AND_STAGES = f"{LOSS_PARITY} tests/preflight tests/diagnostic"


def _user_env() -> dict[str, str]:
    """This environment without any service variable, with this interpreter's bin first on PATH
    (the README's `python` and `pytest` are the installed ones)."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV_VARS and k != "TINKER_BASE_URL"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def test_separate_server_recipe_step_2_runs_as_written(readme, tmp_path):
    cmd = readme("The harness against a server you started", "TINKER_BASE_URL=")
    assert README_URL in cmd and "MODAL_PROXY" not in cmd and "--backend tinker" in cmd, cmd
    before = live_child_pids()
    evidence = tmp_path / "runs"
    with LocalServerProcess(run_dir=tmp_path / "server") as srv:
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                "bash",
                "-c",
                cmd.replace(README_URL, srv.base_url)
                + f" {UNIT_PARITY_AND_STAGES} --plan={CI_PLAN} --evidence-dir {evidence} -p no:cacheprovider -q",
            ],
            cwd=ROOT,
            env=_user_env(),
            capture_output=True,
            text=True,
            timeout=1500,
        )
        secs = time.monotonic() - t0
    print(f"README recipe (diagnostic, CI plan): {secs:.0f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run = evidence / (evidence / "LATEST").read_text().strip()
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "succeeded" and result["backend"]["requested_backend"] == "tinker", result["backend"]
    conn = json.loads((run / "files" / "connectivity-preflight.json").read_text())
    variables = next(c for c in conn["checks"] if c["check"] == "variables")
    assert "proxy headers: none" in variables["detail"], variables
    verify = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(run)], capture_output=True, text=True, timeout=300
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert live_child_pids() <= before

"""The embedded server's death is seen in bounded time: a wait on a killed server ends within
seconds with its exit code and log tail (the SDK alone re-polls a vanished server for minutes), and
a SIGKILLed harness leaves no orphan server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tinker
from run_env import harness_env

from dppo_harness.local_server.process import LocalServerProcess
from dppo_harness.service.observed import make_service_client
from dppo_harness.service.wait.policy import ServiceDied, WaitPolicy
from dppo_harness.service.wait.waiter import ServiceWaiter

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3-random"
BASE = "Qwen/Qwen3.5-2B"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


@pytest.mark.timeout(240)
def test_a_killed_server_ends_the_wait_within_seconds_with_its_exit_code(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with LocalServerProcess(run_dir=tmp_path / "server", model=MODEL) as srv:
        waiter = ServiceWaiter(WaitPolicy.from_options(service_timeout_s=600))
        srv.on_death = lambda s: waiter.service_died(
            ServiceDied(f"the embedded server (pid {s.pid})", *s.death_report())
        )
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4)
        os.kill(srv.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ServiceDied) as ei:
            tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        assert time.monotonic() - t0 < 15
        assert ei.value.exit_code == -signal.SIGKILL and "exited (exit code -9)" in ei.value.line
        stopped = waiter.evidence()["stopped"]
        assert stopped["kind"] == "server_died" and stopped["exit_code"] == -9 and "log_tail" in stopped


@pytest.mark.timeout(240)
def test_a_sigkilled_harness_leaves_no_orphan_server(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from dppo_harness.local_server.process import LocalServerProcess
        srv = LocalServerProcess(run_dir={str(tmp_path / "server")!r}, model={MODEL!r}).start()
        print(srv.pid, flush=True)
        time.sleep(600)
    """)
    harness = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=harness_env(PYTHONPATH=str(ROOT / "src"))
    )
    try:
        server_pid = int(harness.stdout.readline())
        assert _alive(server_pid)
        harness.kill()  # SIGKILL: no atexit, no finally
        harness.wait(30)
        deadline = time.monotonic() + 20
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), "the server outlived its harness"
    finally:
        harness.kill()


def _server_child(harness_pid: int) -> int | None:
    """The pid of the embedded server `harness_pid` started, if it runs."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == harness_pid and b"dppo_harness.local_server" in cmd:
            return int(d.name)
    return None


@pytest.mark.timeout(600)
def test_the_server_killed_mid_diagnostic_ends_the_run_within_a_minute_with_its_exit(tmp_path):
    """`pytest tests/preflight tests/diagnostic` on the local backend, as a user runs it; the
    embedded server is SIGKILLed at the diagnostic's first update: the run ends within a minute,
    failed, its bundle verifies and names the server's exit code and log tail."""
    import json
    import shutil

    plans = tmp_path / "plans"
    plans.mkdir()
    shutil.copy(ROOT / "plans" / "exp_e6b0965af3.json", plans)
    shutil.copy(ROOT / "plans" / "exp_e6b0965af3.json.resolution.json", plans)
    shutil.copy(ROOT / "tests" / "fixtures" / "plans" / "diagnostic-ci-short.json", plans)
    evidence = tmp_path / "evidence"
    harness = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "tests/preflight",
            "tests/diagnostic",
            f"--plan={plans / 'diagnostic-ci-short.json'}",
            f"--evidence-dir={evidence}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=harness_env(PYTHONPATH=str(ROOT / "src"), TINKER_BASE_URL=None),
    )
    out: list[str] = []
    killed_at = None
    try:
        for line in harness.stdout:
            out.append(line)
            if killed_at is None and "[diagnostic] update 1/" in line:
                pid = _server_child(harness.pid)
                assert pid is not None, "no embedded server child found"
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
        harness.wait(120)
    finally:
        harness.kill()
    text = "".join(out)
    assert killed_at is not None, text[-3000:]
    secs = time.monotonic() - killed_at
    assert harness.returncode != 0 and secs < 60, (secs, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    run = evidence / (evidence / "LATEST").read_text().strip()
    r = json.loads((run / "result.json").read_text())
    assert (r["status"], r["verdict"]) == ("failed", "inconclusive"), r["summary"]
    stopped = r["service_wait"]["stopped"]
    assert stopped["kind"] == "server_died" and stopped["exit_code"] == -signal.SIGKILL and stopped["log_tail"], stopped
    assert "exited (exit code -9)" in stopped["line"] and stopped["line"] in text
    v = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        env=harness_env(PYTHONPATH=str(ROOT / "src")),
    )
    assert v.returncode == 0 and "(status failed)" in v.stdout, v.stdout + v.stderr

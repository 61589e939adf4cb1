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
from dppo_harness.service import clients as service
from dppo_harness.service.service_wait import ServiceWaiter
from dppo_harness.service.service_wait_policy import ServiceDied, WaitPolicy

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
        srv.on_death = lambda s: waiter.service_died(ServiceDied(f"the embedded server (pid {s.pid})",
                                                                 *s.death_report()))
        sc = service.make_service_client("local", srv.base_url, waiter=waiter)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
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
        srv = LocalServerProcess(run_dir={str(tmp_path / 'server')!r}, model={MODEL!r}).start()
        print(srv.pid, flush=True)
        time.sleep(600)
    """)
    harness = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env=harness_env(PYTHONPATH=str(ROOT / "src")))
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

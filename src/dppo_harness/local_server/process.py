"""Start and stop the embedded server as a subprocess (`LocalServerProcess`, used by the pytest
plugin and the integration tests): it binds 127.0.0.1 only and leaves nothing running after
`stop()` / the `with` block. Tests start it in their own process with
tests/support/server_in_process.py.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dppo_harness
from dppo_harness.local_server.profiles import SPINDLE_CREDENTIALS, client_auth_headers
from dppo_harness.service.secrets_scan import without_credentials

READY_RE = re.compile(r"^listening on (http://127\.0\.0\.1:(\d+))$")
PROGRESS_RE = re.compile(r"progress: (.*)$")  # warmstart.PROGRESS_MARKER lines in the server's log
_live: weakref.WeakSet[LocalServerProcess] = weakref.WeakSet()


class LocalServerDied(RuntimeError):
    """The server process exited (or never became ready); the message carries its log tail."""


def _src_root() -> str:
    return str(Path(dppo_harness.__file__).resolve().parents[1])


def _get_json(url: str, timeout: float = 5.0, headers: Mapping[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=dict(headers or {}))
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def server_environment(env: Mapping[str, str], profile: str) -> dict[str, str]:
    """The server's environment: `env` without any credential-named variable, except those the
    spindle profile checks requests against (the server needs nothing else secret)."""
    return without_credentials(env, keep=[var for _, var in SPINDLE_CREDENTIALS] if profile == "spindle" else [])


class LocalServerProcess:
    """`python -m dppo_harness.local_server` as a child process (docs/local-server.md "Python API").
    `env=None` inherits this process's environment; a given `env` is the child's whole environment
    (PYTHONPATH is added); with `profile="spindle"` this helper's own probes send its credentials.
    """

    def __init__(
        self,
        run_dir: Path | str | None = None,
        *,
        model: str | None = None,
        profile: str = "default",
        fault_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 900.0,
        python: str = sys.executable,
        progress: Callable[[str], None] | None = None,
        heartbeat_s: float = 10.0,
    ) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="dppo-local-server-"))
        self.startup_timeout = startup_timeout
        self.cmd = [python, "-m", "dppo_harness.local_server", "--host", "127.0.0.1", "--port", "0"]
        self.cmd += ["--run-dir", str(self.run_dir), "--exit-with-parent", str(os.getpid()), "--profile", profile]
        self.cmd += (["--model", model] if model else []) + list(fault_args)
        self.env = server_environment(os.environ if env is None else env, profile)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (_src_root(), self.env.get("PYTHONPATH")) if p)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        # Never in the command line or a log: only sent as headers by this helper's probes.
        self._probe_headers = client_auth_headers(self.env) if profile == "spindle" else {}
        self.proc: subprocess.Popen | None = None
        self.base_url: str = ""
        self.start_seconds: float | None = None
        self._stdout: queue.Queue[str | None] = queue.Queue()
        # While waiting for readiness: the server's progress lines (its log) go to `progress`, and
        # a line at least every `heartbeat_s` says it is still starting.
        self.progress = progress
        self.heartbeat_s = heartbeat_s
        self._log_offset = 0
        # Called once, from a watcher thread, if the server exits while nobody stopped it.
        self.on_death: Callable[[LocalServerProcess], None] | None = None
        self._stopping = False

    @property
    def log_path(self) -> Path:
        return self.run_dir / "server.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> LocalServerProcess:
        if self.proc is not None:
            raise RuntimeError("LocalServerProcess already started")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child, closed below
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=self.env,
                text=True,
                bufsize=1,
            )
        finally:
            log.close()
        _live.add(self)
        threading.Thread(target=self._pump_stdout, name="local-server-stdout", daemon=True).start()
        threading.Thread(target=self._watch_exit, name="local-server-exit-watch", daemon=True).start()
        try:
            self.base_url = self._wait_ready(t0)
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        return self

    def _watch_exit(self) -> None:
        proc = self.proc
        assert proc is not None
        proc.wait()
        if not self._stopping and self.on_death is not None:
            try:
                self.on_death(self)
            except Exception as exc:  # the watcher must not die silently with the report
                print(f"local server exit report failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    def death_report(self) -> tuple[int | None, str]:
        """(exit code, the last lines of its log) of a server that exited."""
        return self.returncode, self.log_tail(20)

    def _pump_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._stdout.put(line.rstrip("\n"))
        self._stdout.put(None)

    def _forward_progress(self, t0: float, said_at: float) -> float:
        """Send the log's new progress lines to `progress`; a heartbeat line when none came for
        `heartbeat_s`. Returns when a line was last said."""
        if self.progress is None:
            return said_at
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                chunk = f.read()
        except OSError:
            chunk = b""
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._log_offset += len(complete)
        now = time.perf_counter()
        for raw in complete.decode(errors="replace").splitlines():
            m = PROGRESS_RE.search(raw)
            if m:
                self.progress(f"[local server] {m.group(1)}")
                said_at = now
        if now - said_at >= self.heartbeat_s:
            self.progress(f"[local server] starting (pid {self.pid}): {now - t0:.0f}s, waiting for its ready line")
            said_at = now
        return said_at

    def _wait_ready(self, t0: float) -> str:
        said_at = time.perf_counter()
        if self.progress is not None:
            self.progress(f"[local server] starting the embedded server (pid {self.pid}, log {self.log_path})")
        while True:
            left = self.startup_timeout - (time.perf_counter() - t0)
            if left <= 0:
                raise LocalServerDied(self._describe(f"not ready after {self.startup_timeout:.0f}s"))
            said_at = self._forward_progress(t0, said_at)
            try:
                line = self._stdout.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(timeout=10)  # type: ignore[union-attr]
                raise LocalServerDied(self._describe("exited before printing its ready line"))
            match = READY_RE.match(line)
            if match:
                self._forward_progress(t0, time.perf_counter())
                if self.progress is not None:
                    self.progress(f"[local server] ready at {match.group(1)} after {time.perf_counter() - t0:.0f}s")
                return match.group(1)

    def _wait_healthy(self, t0: float) -> None:
        while True:
            try:
                health = _get_json(f"{self.base_url}/api/v1/healthz", timeout=2.0, headers=self._probe_headers)
                if health.get("status") == "ok":
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if not self.alive():
                raise LocalServerDied(self._describe("is not running"))
            if time.perf_counter() - t0 > self.startup_timeout:
                raise LocalServerDied(self._describe("healthz never answered ok"))
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _describe(self, what: str) -> str:
        code = self.returncode
        status = f"exit code {code}" if code is not None else "still running"
        return (
            f"local server (pid {self.pid}, {status}) {what}; command: {' '.join(self.cmd)}\n"
            f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
        )

    def stats(self) -> dict[str, Any]:
        """GET /_harness/stats while running; after exit, the stats file the server left behind."""
        if self.alive():
            return _get_json(f"{self.base_url}/_harness/stats", headers=self._probe_headers)
        path = self.run_dir / "server_stats.json"
        if path.is_file():
            return json.loads(path.read_text())
        raise LocalServerDied(self._describe("is not running and left no stats file"))

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        self._stopping = True
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
            except ProcessLookupError:
                pass
        if proc.stdout is not None:
            proc.stdout.close()
        _live.discard(self)
        return proc.returncode

    def __enter__(self) -> LocalServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        server.stop(timeout=5.0)

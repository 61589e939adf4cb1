"""Launch scope on a service that is not the embedded server, driven as a user runs the harness.

The embedded server's `spindle` profile answers behind a small proxy that strips its marker (the
`X-Embedded-Tinker-Server` header and the capabilities' `embedded_server` key), so the harness's
connectivity preflight sees an ordinary service. The proxy forwards only the requests that
preflight sends through the SDK (client config, auth, dynamic config, capabilities) and records
every request, answering every other one 401 (which the SDK does not retry), so a stage that went
past the launch check shows up as recorded requests and the server's sessions.

- the saved spec (its launch, stated in its resolution file, authorizes no training stage),
  `-m comparison`: refused before the first test, one line
  naming what would authorize it, no traceback, only the capabilities read reached the proxy and
  the server holds no session or model;
- the same refusal for explicit test paths (`tests/gates`): the stages of the collected tests count;
- the same spec with a launch block authorizing the gate, in the plan or in a resolution file
  beside the verbatim spec: not refused (the run goes on to create clients, which the proxy turns
  away), so the authorization is the plan's, not the code's.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from server_in_process import InProcessServer

from dppo_harness.constants import EMBEDDED_SERVER_HEADER
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.profiles import make_profile

ROOT = Path(__file__).resolve().parents[2]
# Made at run time and put first, so no source file (or code patch in the evidence) holds any
# 16-byte piece of them: the scan also looks for pieces of a value cut by a length limit.
_TAG = secrets.token_hex(8)
PLANTED = {  # planted, not real: the server checks them
    "TINKER_API_KEY": f"tml-{_TAG}-PLANTED-launch",
    "MODAL_PROXY_TOKEN_ID": f"wk-{_TAG}-PLANTED-launch",
    "MODAL_PROXY_TOKEN_SECRET": f"ws-{_TAG}-PLANTED-launch",
}
CAPABILITIES = "/api/v1/get_server_capabilities"
# What the connectivity preflight sends at first contact (connectivity.py, service/rest.py).
CONNECTIVITY_READS = frozenset(
    {
        "/api/v1/client/config",
        "/api/v1/auth/token",
        "/api/v1/client/dynamic_config",
        CAPABILITIES,
        "/api/v1/spindle/deployments",
    }
)


class _MarkerStrippingProxy(ThreadingHTTPServer):
    """Forwards the connectivity preflight's requests to `upstream` without the embedded-server
    marker; records every request and refuses (401) every other one."""

    daemon_threads = True

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.requests: list[str] = []
        self.refuse_capabilities = 0  # answer this many capability reads 503, as a service with a transient fault
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _MarkerStrippingProxy

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        path = self.path.split("?")[0]
        self.server.requests.append(f"{self.command} {path}")
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        if path == CAPABILITIES and self.server.refuse_capabilities > 0:
            self.server.refuse_capabilities -= 1
            self._answer(503, {"error": "this test's proxy: a transient fault"})
            return
        if path in CONNECTIVITY_READS:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            resp = httpx.request(
                self.command,
                self.server.upstream + self.path,
                headers=headers,
                content=data,
                timeout=30,
                trust_env=False,
            )
            assert EMBEDDED_SERVER_HEADER in resp.headers  # what the proxy hides
            body = resp.json()
            if isinstance(body, dict):
                body.pop("embedded_server", None)
            self._answer(resp.status_code, body)
            return
        self._answer(401, {"error": "this test's proxy serves the connectivity preflight's requests only"})

    do_GET = do_POST = do_PUT = do_DELETE = _handle


class _Spindle:
    """The spindle profile in this process: the harness runs as its own process against the proxy,
    and no request past the connectivity reads reaches a model, so the untrained preset serves."""

    def __init__(self, run_dir: Path):
        engine = Engine(run_dir, model_name="tiny-qwen3-random")
        self.server = InProcessServer(engine, profile=make_profile("spindle", PLANTED)).start()
        self.base_url = self.server.base_url

    def stats(self) -> dict:
        assert self.server.state is not None
        return self.server.state.stats()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    srv = _Spindle(tmp_path_factory.mktemp("launch-spindle"))
    proxy = _MarkerStrippingProxy(srv.base_url)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv, proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        srv.server.stop()


def _harness(args: list[str], base_url: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in PLANTED and k != "TINKER_BASE_URL"}
    env.update(PLANTED, TINKER_TELEMETRY="0", TINKER_BASE_URL=base_url, PYTHONPATH=str(ROOT / "src"))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--backend=tinker", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def _refusal_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "launch scope:" in line]


# A stage selected by marker with the plan given, and by path alone with no plan: the default plan
# (the saved spec, whose launch its resolution file states) is the one the stage would load, so
# the gate is refused before the first test all the same.
@pytest.mark.parametrize(
    "selection",
    [["-m", "comparison", f"--plan={ROOT / 'plans' / 'exp_e6b0965af3.json'}"], ["tests/gates"]],
    ids=["-m comparison --plan", "tests/gates, no plan"],
)
def test_unauthorized_stage_is_refused_before_any_client(service, selection, tmp_path):
    srv, proxy = service
    before = len(proxy.requests)
    proc, secs = _harness([*selection, f"--evidence-dir={tmp_path / 'evidence'}"], proxy.url)
    out = proc.stdout + proc.stderr
    print(f"refused in {secs:.1f} s (pytest start-up and collection included)")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    lines = _refusal_lines(out)
    assert len(lines) == 1, out[-3000:]
    stages = "gate, comparison" if selection[0] == "-m" else "gate"
    assert (
        f"stage {stages} is not authorized" in lines[0]
        and "launch (stated in exp_e6b0965af3.json.resolution.json) authorizes no training stage" in lines[0]
        and f"a plan whose launch.authorized_stages lists {stages} would authorize it" in lines[0]
    ), lines[0]
    assert "Traceback" not in out and " passed" not in out  # no test ran, unit parity included
    sent = proxy.requests[before:]
    # The connectivity preflight's reads, nothing else.
    assert f"GET {CAPABILITIES}" in sent and {r.split(" ", 1)[1] for r in sent} <= CONNECTIVITY_READS, sent
    stats = srv.stats()
    assert stats["sessions"] == 0 and stats["models"] == {}, stats


def test_a_connectivity_error_at_the_launch_check_refuses_instead_of_skipping_it(service, tmp_path):
    """A transient fault on the first capabilities read: the check cannot tell whether this is the
    embedded server, so the run is refused there (a later retry by a fixture would have trained)."""
    srv, proxy = service
    proxy.refuse_capabilities = 1
    try:
        proc, _secs = _harness(
            [
                "tests/gates",
                f"--plan={ROOT / 'plans' / 'exp_e6b0965af3.json'}",
                f"--evidence-dir={tmp_path / 'evidence'}",
            ],
            proxy.url,
        )
    finally:
        proxy.refuse_capabilities = 0
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    (line,) = _refusal_lines(out)
    assert "could not be told" in line and "HTTP 503" in line and "launch.authorized_stages lists gate" in line, line
    assert "Traceback" not in out and " passed" not in out
    assert srv.stats()["sessions"] == 0 and srv.stats()["models"] == {}


@pytest.mark.parametrize("stated_in", ["plan", "resolution file"])
def test_a_plan_whose_launch_authorizes_the_stage_is_not_refused(service, tmp_path, stated_in):
    """The launch in the plan itself, or (the spec kept verbatim) in its resolution file beside it."""
    _srv, proxy = service
    saved = ROOT / "plans" / "exp_e6b0965af3.json"
    launch = {
        "source": "this test",
        "launch_mode": "redo",
        "scope": "the activation gate only",
        "only_authorized_run": True,
        "authorized_stages": ["gate"],
    }
    plan = tmp_path / "authorized.json"
    resolution = json.loads(saved.with_name(saved.name + ".resolution.json").read_text())
    del resolution["launch"]
    if stated_in == "plan":
        spec = json.loads(saved.read_text())
        spec["launch"] = launch
        plan.write_text(json.dumps(spec, indent=2))
    else:
        plan.write_bytes(saved.read_bytes())
        resolution["launch"] = launch
    plan.with_name(plan.name + ".resolution.json").write_text(json.dumps(resolution))
    before = len(proxy.requests)
    proc, _secs = _harness(
        ["tests/gates", f"--plan={plan}", f"--evidence-dir={tmp_path / 'evidence'}", "-x"], proxy.url
    )
    out = proc.stdout + proc.stderr
    assert not _refusal_lines(out), out[-3000:]
    assert proc.returncode != 0  # the proxy turns the clients away
    sent = proxy.requests[before:]
    assert f"GET {CAPABILITIES}" in sent and any(r.split(" ", 1)[1] not in CONNECTIVITY_READS for r in sent), (
        sent,
        out[-3000:],
    )

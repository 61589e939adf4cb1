"""Connectivity preflight against a tiny HTTP stub on 127.0.0.1: one actionable line per failure,
never a secret value; the marker and the model choice come from the same capabilities read."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

from dppo_harness.constants import EMBEDDED_SERVER_HEADER, EMBEDDED_SERVER_MARKER
from dppo_harness.service.connectivity import ConnectivityError, auth_failure_line, check_connectivity
from dppo_harness.stages.write import write_connectivity

ENV = {
    "TINKER_API_KEY": "tml-PLANTED-key-7f3a",
    "MODAL_PROXY_TOKEN_ID": "wk-PLANTED-id-91c2",
    "MODAL_PROXY_TOKEN_SECRET": "ws-PLANTED-secret-5d0e",
}
QWEN = "Qwen/Qwen3.5-2B"


class Stub:
    """Speaks as much of the protocol as the SDK's connection needs (POST client/config and
    client/dynamic_config, GET get_server_capabilities, as configured); checks the proxy headers
    on every request."""

    def __init__(
        self,
        *,
        status=200,
        models=(QWEN,),
        marker=False,
        require_auth=True,
        body=None,
        jwt=None,
        modal=True,
        deployments=None,
        config=None,
    ):
        self.status, self.models, self.marker, self.require_auth, self.body = status, models, marker, require_auth, body
        self.deployments = deployments  # [(base_model, parameterization)]: answered at spindle/deployments
        self.config = config if config is not None else {}  # the client/config answer
        self.jwt = jwt  # set: the service asks for the SDK's JWT exchange and accepts only the JWT afterwards
        self.modal = modal  # False: a stock Tinker service, the API key only
        self.seen_headers: list[dict] = []
        self.paths: list[str] = []
        stub = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                self._reply()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._reply()

            def _reply(self):
                stub.seen_headers.append(dict(self.headers))
                stub.paths.append(f"{self.command} {self.path}")
                code, payload = stub.answer(self.path, self.headers)
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                if stub.marker:
                    self.send_header(EMBEDDED_SERVER_HEADER, EMBEDDED_SERVER_MARKER)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, path, headers):
        path = urlsplit(path).path  # a request through a proxy names the absolute URL
        if self.jwt is not None:
            return self.answer_jwt(path, headers)
        if path == "/api/v1/spindle/deployments" and self.deployments is not None:
            rows = [{"base_model": m, "parameterization": p, "max_context_length": 16384} for m, p in self.deployments]
            return 200, {"deployments": rows}
        if path not in ("/api/v1/get_server_capabilities", "/api/v1/client/config", "/api/v1/client/dynamic_config"):
            return 404, {"detail": "Not Found"}
        if self.require_auth:
            for h, var in (
                ("X-API-Key", "TINKER_API_KEY"),
                ("Modal-Key", "MODAL_PROXY_TOKEN_ID"),
                ("Modal-Secret", "MODAL_PROXY_TOKEN_SECRET"),
            )[: 3 if self.modal else 1]:
                if h not in headers:
                    return 401, {"error": f"missing header {h}", "category": "user"}
                if headers[h] != ENV[var]:
                    return 401, {"error": f"invalid credentials in header {h}", "category": "user"}
        if self.status != 200:
            return self.status, self.body or {"error": "nope"}
        if path == "/api/v1/client/config":
            return 200, self.config
        if path != "/api/v1/get_server_capabilities":
            return 200, {}  # the SDK's defaults: API-key auth
        caps = self.body or {"supported_models": [{"model_name": m, "trainable": True} for m in self.models]}
        if self.marker:
            caps = dict(
                caps,
                embedded_server={
                    "marker": EMBEDDED_SERVER_MARKER,
                    "stand_in": "local/tiny-qwen3-gsm8k",
                    "profile": "spindle",
                },
            )
        return 200, caps

    def answer_jwt(self, path, headers):
        if path in ("/api/v1/client/config", "/api/v1/auth/token"):
            if headers.get("X-API-Key") != ENV["TINKER_API_KEY"]:
                return 401, {"error": "invalid credentials in header X-API-Key", "category": "user"}
            return 200, {"pjwt_auth_enabled": True} if path.endswith("config") else {"jwt": self.jwt}
        if headers.get("X-API-Key") != self.jwt:
            return 401, {"error": "invalid credentials in header X-API-Key: a JWT is required", "category": "user"}
        if path == "/api/v1/client/dynamic_config":
            return 200, {}
        return 200, {"supported_models": [{"model_name": QWEN, "trainable": True}]}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub_factory():
    made = []

    def make(**kw):
        s = Stub(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _fail(url, env=ENV, model=QWEN) -> ConnectivityError:
    with pytest.raises(ConnectivityError) as ei:
        check_connectivity("tinker", None, model, env=dict(env, TINKER_BASE_URL=url), timeout_s=5)
    line = str(ei.value)
    assert "\n" not in line
    for v in ENV.values():
        assert v not in line and v[3:] not in line
    return ei.value


def test_all_checks_pass_and_headers_are_the_sdks(stub_factory):
    s = stub_factory()
    rep = check_connectivity("tinker", None, QWEN, env=dict(ENV, TINKER_BASE_URL=s.url))
    assert [c["check"] for c in rep.checks] == ["variables", "reachable", "auth", "sdk", "model"]
    assert rep.model == QWEN and rep.substitution is None and rep.marker is None
    headers = [{k.lower(): v for k, v in h.items()} for h in s.seen_headers]
    assert all(h["x-api-key"] == ENV["TINKER_API_KEY"] for h in headers)
    assert all(h["modal-secret"] == ENV["MODAL_PROXY_TOKEN_SECRET"] for h in headers)
    # first contact: the SDK's first request, then what it does not hand back, each once
    assert s.paths == [
        "POST /api/v1/client/config",
        "GET /api/v1/get_server_capabilities",
        "POST /api/v1/client/dynamic_config",
        "GET /api/v1/spindle/deployments",
    ]
    files: dict[str, object] = {}
    write_connectivity(
        SimpleNamespace(result={}, register_json=lambda n, k, obj: files.update(file=obj)), rep, "tinker"
    )
    contact = files["file"]["first_contact"]
    assert contact["client_config"] == {"path": "/api/v1/client/config", "http_status": 200, "body": {}}
    assert contact["spindle_deployments"]["http_status"] == 404  # a stock Tinker service has none: recorded
    assert json.dumps(files["file"]).count("PLANTED") == 0


@pytest.mark.parametrize("missing", sorted(ENV))
def test_missing_variable_names_it(stub_factory, missing):
    s = stub_factory()
    env = {k: v for k, v in ENV.items() if k != missing}
    err = _fail(s.url, env)
    assert err.check == "variables" and missing in str(err)
    assert s.seen_headers == []  # nothing was sent


def test_stock_tinker_service_needs_only_url_and_api_key(stub_factory):
    """Without MODAL_PROXY_TOKEN_ID/SECRET no Modal header is sent, and a service that asks for
    none accepts the run."""
    s = stub_factory(modal=False)
    rep = check_connectivity(
        "tinker", None, QWEN, env={"TINKER_API_KEY": ENV["TINKER_API_KEY"], "TINKER_BASE_URL": s.url}
    )
    assert rep.model == QWEN and "proxy headers: none (no proxy-token variables set)" in rep.checks[0]["detail"]
    assert not {"Modal-Key", "Modal-Secret"} & set(s.seen_headers[0])


def test_missing_modal_headers_401_names_both_variables(stub_factory):
    s = stub_factory()  # behind the Modal proxy
    err = _fail(s.url, {"TINKER_API_KEY": ENV["TINKER_API_KEY"]})
    assert err.check == "auth" and "HTTP 401" in str(err) and "header Modal-Key" in str(err)
    assert "set MODAL_PROXY_TOKEN_ID and MODAL_PROXY_TOKEN_SECRET" in str(err)


def test_wrong_modal_secret_is_a_401_line_naming_the_variable(stub_factory):
    s = stub_factory()
    err = _fail(s.url, dict(ENV, MODAL_PROXY_TOKEN_SECRET="ws-wrong-value"))
    assert err.check == "auth"
    assert "HTTP 401" in str(err) and "check MODAL_PROXY_TOKEN_ID/SECRET" in str(err)
    assert "MODAL_PROXY_TOKEN_SECRET" in str(err) and "Modal-Secret" in str(err) and "ws-wrong" not in str(err)


def test_wrong_api_key_names_tinker_api_key(stub_factory):
    s = stub_factory()
    err = _fail(s.url, dict(ENV, TINKER_API_KEY="tml-wrong"))
    assert "check TINKER_API_KEY" in str(err)


def test_401_without_a_header_name_still_points_at_the_modal_tokens():
    line = auth_failure_line(401, "<html>Unauthorized</html>", "https://x.invalid")
    assert "check MODAL_PROXY_TOKEN_ID/SECRET" in line


def test_404_names_the_url(stub_factory):
    s = stub_factory()
    err = _fail(s.url + "/wrong/root")
    assert err.check == "reachable" and "404" in str(err) and f"{s.url}/wrong/root" in str(err)


def test_connection_refused_names_the_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    err = _fail(f"http://127.0.0.1:{port}")
    assert err.check == "reachable" and f"127.0.0.1:{port}" in str(err) and "TINKER_BASE_URL" in str(err)
    assert time.monotonic() - t0 < 5


def test_url_credentials_are_not_echoed(stub_factory):
    s = stub_factory()
    url = s.url.replace("http://", "http://user:tml-PLANTED-key-7f3a@") + "/nope"
    err = _fail(url)
    assert "user" not in str(err)


def test_missing_model_lists_the_served_ones(stub_factory):
    s = stub_factory(models=("meta-llama/Llama-3.2-1B", "moonshotai/Kimi-K2"))
    err = _fail(s.url)
    assert err.check == "model" and "meta-llama/Llama-3.2-1B" in str(err) and "moonshotai/Kimi-K2" in str(err)


def test_closest_family_model_is_chosen_and_recorded(stub_factory):
    s = stub_factory(models=("Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-9B", "Qwen/Qwen3-0.6B"))
    rep = check_connectivity("tinker", None, "Qwen/Qwen3.5-0.8B", env=dict(ENV, TINKER_BASE_URL=s.url))
    assert rep.model == "Qwen/Qwen3.5-2B"
    assert rep.substitution["original"] == "Qwen/Qwen3.5-0.8B" and rep.substitution["effective"] == "Qwen/Qwen3.5-2B"


def test_server_error_and_non_tinker_answers_fail(stub_factory):
    assert "HTTP 503" in str(_fail(stub_factory(status=503).url))
    assert "supported_models" in str(_fail(stub_factory(body={"hello": 1}).url))


def test_marker_is_detected_on_the_tinker_backend(stub_factory):
    s = stub_factory(marker=True)
    rep = check_connectivity("tinker", None, QWEN, env=dict(ENV, TINKER_BASE_URL=s.url))
    assert rep.embedded and rep.marker.stand_in == "local/tiny-qwen3-gsm8k"
    assert rep.marker.sources == ["header", "capabilities"] and rep.marker.profile == "spindle"


def test_local_backend_needs_no_credentials(stub_factory):
    s = stub_factory(require_auth=False)
    rep = check_connectivity("local", s.url, QWEN, env={})
    assert rep.model == QWEN
    with pytest.raises(ConnectivityError, match="loopback"):
        check_connectivity("local", "http://10.0.0.1:1", QWEN, env={})


def _jwt(lifetime_s: float = 3600) -> str:
    import base64

    def part(obj):
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    now = time.time()
    return f"{part({'alg': 'none'})}.{part({'iat': now, 'exp': now + lifetime_s})}.sig"


def test_a_service_that_asks_for_the_sdks_jwt_exchange_passes(stub_factory):
    """The SDK exchanges the key for a JWT when client/config asks: a raw read with the key fails."""
    token = _jwt()
    s = stub_factory(jwt=token)
    rep = check_connectivity("tinker", None, QWEN, env=dict(ENV, TINKER_BASE_URL=s.url))
    assert rep.model == QWEN
    assert "POST /api/v1/auth/token" in s.paths
    caps = [h for p, h in zip(s.paths, s.seen_headers, strict=True) if p.endswith("get_server_capabilities")]
    assert caps and all({k.lower(): v for k, v in h.items()}["x-api-key"] == token for h in caps)


def test_the_environments_proxy_is_used_like_the_sdks(stub_factory, monkeypatch):
    """HTTP_PROXY reaches the connectivity check as it reaches every SDK request (httpx trust_env)."""
    s = stub_factory()
    for var in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTP_PROXY", s.url)
    rep = check_connectivity("tinker", None, QWEN, env=dict(ENV, TINKER_BASE_URL="http://tinker.invalid"))
    assert rep.model == QWEN and rep.base_url == "http://tinker.invalid"
    assert all("tinker.invalid" in p for p in s.paths)  # absolute-form requests: they went through the proxy


def test_runs_credentials_feed_the_proxy_headers(stub_factory):
    """--proxy-credentials runs: Modal-Key/Modal-Secret from RUNS_PROXY_TOKEN_*; lines name those."""
    s = stub_factory()
    runs = {
        "TINKER_API_KEY": ENV["TINKER_API_KEY"],
        "RUNS_PROXY_TOKEN_ID": ENV["MODAL_PROXY_TOKEN_ID"],
        "RUNS_PROXY_TOKEN_SECRET": ENV["MODAL_PROXY_TOKEN_SECRET"],
    }
    rep = check_connectivity("tinker", None, QWEN, env=dict(runs, TINKER_BASE_URL=s.url), proxy_tokens="runs")
    assert rep.model == QWEN
    with pytest.raises(ConnectivityError) as ei:
        check_connectivity(
            "tinker",
            None,
            QWEN,
            env=dict(runs, TINKER_BASE_URL=s.url, RUNS_PROXY_TOKEN_SECRET="ws-wrong"),
            proxy_tokens="runs",
        )
    assert "check RUNS_PROXY_TOKEN_ID/SECRET" in str(ei.value) and "RUNS_PROXY_TOKEN_SECRET" in str(ei.value)
    with pytest.raises(ConnectivityError, match="RUNS_PROXY_TOKEN_ID"):
        check_connectivity("tinker", None, QWEN, env=dict(ENV, TINKER_BASE_URL=s.url), proxy_tokens="runs")


SPINDLE_LIKE = [("Qwen/Qwen3.5-9B-Base", "lora"), ("Qwen/Qwen3.5-4B", "full"), ("Qwen/Qwen3.5-9B-Base", "lora")]


def test_substitution_never_picks_a_full_fine_tune_only_model(stub_factory):
    """Spindle's repo deploys Qwen3.5-4B for full fine-tuning only and the 9B base with LoRA:
    capabilities list both without saying so; spindle/deployments does."""
    s = stub_factory(models=("Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-4B"), deployments=SPINDLE_LIKE)
    rep = check_connectivity("tinker", None, QWEN, env=dict(ENV, TINKER_BASE_URL=s.url))
    assert rep.model == "Qwen/Qwen3.5-9B-Base" and rep.substitution["effective"] == "Qwen/Qwen3.5-9B-Base"
    assert "with LoRA" in rep.substitution["reason"]
    # without the deployment list, capabilities alone would have picked the nearer, full-only 4B
    s2 = stub_factory(models=("Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-4B"))
    assert check_connectivity("tinker", None, QWEN, env=dict(ENV, TINKER_BASE_URL=s2.url)).model == "Qwen/Qwen3.5-4B"


def test_a_model_served_only_for_full_fine_tuning_is_refused_in_one_line(stub_factory):
    s = stub_factory(models=("Qwen/Qwen3.5-4B",), deployments=[("Qwen/Qwen3.5-4B", "full")])
    err = _fail(s.url, model="Qwen/Qwen3.5-4B")
    assert err.check == "model" and "full fine-tuning only" in str(err) and "LoRA-capable: none" in str(err)


def test_a_client_config_the_installed_sdk_cannot_use_is_refused(stub_factory):
    s = stub_factory(config={"pjwt_auth_enabled": "sometimes", "fwdbwd_max_chunk_len": "many"})
    err = _fail(s.url)
    assert err.check == "sdk" and "does not serve this SDK" in str(err) and "tinker 0.25.0" in str(err)

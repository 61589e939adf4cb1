"""The embedded server's `--profile spindle`, its marker, its REST reads and its request log, driven
by the stock tinker SDK (and raw httpx where the SDK hides the wire) against real child servers.

Credentials are planted per test run; no planted value may appear in any response or log.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from dppo_harness import constants
from dppo_harness.local_server.process import LocalServerDied, LocalServerProcess
from dppo_harness.local_server.profiles import OPTIMIZER_ECHO_KEYS

os.environ.setdefault("TINKER_TELEMETRY", "0")

FAST_MODEL = "tiny-qwen3-random"
STAND_IN = "local/tiny-qwen3-random"
PROMPT = [248045, 846, 198]  # "<|im_start|>user\n"
API = "/api/v1"
# A value sent only inside request bodies: the request log must never contain it.
BODY_CANARY = f"body-canary-{uuid.uuid4().hex[:12]}"
LOG_LINE = re.compile(r"dppo_harness\.local_server\.requests (GET|POST|PUT|DELETE) (/\S+) (\d{3}) (\d+\.\d)ms$")


def _planted() -> dict[str, str]:
    tag = uuid.uuid4().hex[:16]
    return {
        "TINKER_API_KEY": f"tml-planted-{tag}",
        "MODAL_PROXY_TOKEN_ID": f"wk-planted-{tag}",
        "MODAL_PROXY_TOKEN_SECRET": f"ws-planted-{tag}",
    }


CREDS = _planted()


def _headers(creds: dict[str, str] = CREDS, **override: str | None) -> dict[str, str]:
    headers = {
        "X-API-Key": creds["TINKER_API_KEY"],
        "Modal-Key": creds["MODAL_PROXY_TOKEN_ID"],
        "Modal-Secret": creds["MODAL_PROXY_TOKEN_SECRET"],
    }
    for name, value in override.items():
        name = name.replace("_", "-")
        if value is None:
            headers.pop(name)
        else:
            headers[name] = value
    return headers


_OPENED: list[tuple[LocalServerProcess, tinker.ServiceClient]] = []


def _opened(server: LocalServerProcess, client: tinker.ServiceClient) -> tinker.ServiceClient:
    """Track a client so its server's fixture closes it before stopping (no SDK heartbeat outlives it)."""
    _OPENED.append((server, client))
    return client


def _close_clients_of(server: LocalServerProcess) -> None:
    for srv, client in [e for e in _OPENED if e[0] is server]:
        _OPENED.remove((srv, client))
        with contextlib.suppress(Exception):  # a client refused at auth has nothing to end
            client.holder.close()  # SDK 0.25 has no session close: stop the session's heartbeat


def _service_client(
    server: LocalServerProcess, creds: dict[str, str] = CREDS, **overrides: str
) -> tinker.ServiceClient:
    modal = {"Modal-Key": creds["MODAL_PROXY_TOKEN_ID"], "Modal-Secret": creds["MODAL_PROXY_TOKEN_SECRET"]}
    modal.update(overrides)
    return _opened(
        server,
        tinker.ServiceClient(base_url=server.base_url, api_key=creds["TINKER_API_KEY"], default_headers=modal),
    )


def _rest_client(service_client: tinker.ServiceClient) -> tinker.RestClient:
    # tinker.RestClient() cannot carry the Modal headers; the service client's REST client does.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return service_client.create_rest_client()


def _no_planted_values(text: str, creds: dict[str, str] = CREDS) -> None:
    for var, value in creds.items():
        assert value not in text, f"the value of {var} leaked"


def _request_log_lines(server: LocalServerProcess) -> list[re.Match]:
    lines = server.log_path.read_text(errors="replace").splitlines()
    return [m for m in (LOG_LINE.search(line) for line in lines) if m]


@pytest.fixture(scope="module")
def spindle(tmp_path_factory):
    server = LocalServerProcess(
        run_dir=tmp_path_factory.mktemp("spindle"),
        model=FAST_MODEL,
        profile="spindle",
        env={**os.environ, **CREDS},
        fault_args=[
            "--fault-reject-first",
            "create_model:429:1",
            "--fault-reject-first",
            "asample:503:2",
            "--fault-latency-ms",
            "asample:150",
            "--fault-retry-after-ms",
            "50",
        ],
    ).start()
    yield server
    _close_clients_of(server)
    server.stop()
    assert not server.alive()


@pytest.fixture(scope="module")
def default_server(shared_random_server):
    """The default profile on the FAST_MODEL preset: the session's shared server."""
    yield shared_random_server
    _close_clients_of(shared_random_server)


def _datum(n: int = 4) -> types.Datum:
    tokens = [248045, 846, 198, 5, 6, 7, 8, 9][:n]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": tokens[1:] + [10], "weights": [1.0] * n},
    )


# ---- authentication -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"X_API_Key": None, "Modal_Key": None, "Modal_Secret": None}, "missing header X-API-Key"),
        ({"Modal_Key": None}, "missing header Modal-Key"),
        ({"Modal_Secret": None}, "missing header Modal-Secret"),
        ({"X_API_Key": "tml-wrong-key"}, "invalid credentials in header X-API-Key"),
        ({"Modal_Key": "wk-wrong"}, "invalid credentials in header Modal-Key"),
        ({"Modal_Secret": "ws-wrong-secret"}, "invalid credentials in header Modal-Secret"),
    ],
)
def test_spindle_401_names_the_header_never_a_value(spindle, override, message):
    sent = _headers(**override)
    for method, path in (
        ("GET", f"{API}/get_server_capabilities"),
        ("POST", f"{API}/create_session"),
        ("GET", f"{API}/healthz"),
        ("GET", "/_harness/stats"),
    ):
        resp = httpx.request(method, spindle.base_url + path, headers=sent, json={})
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json() == {"error": message, "category": "user"}
        assert resp.headers[constants.EMBEDDED_SERVER_HEADER] == constants.EMBEDDED_SERVER_MARKER
        wire = resp.text + "".join(f"{k}: {v}" for k, v in resp.headers.items())
        _no_planted_values(wire)
        for value in sent.values():
            assert value not in wire


def test_spindle_accepts_the_right_headers_and_marks_every_response(spindle):
    ok = httpx.get(spindle.base_url + f"{API}/healthz", headers=_headers())
    assert ok.status_code == 200 and ok.json() == {"status": "ok"}
    missing = httpx.get(spindle.base_url + f"{API}/no_such_endpoint", headers=_headers())
    assert missing.status_code == 404
    for resp in (ok, missing):
        assert resp.headers[constants.EMBEDDED_SERVER_HEADER] == constants.EMBEDDED_SERVER_MARKER


def test_sdk_without_modal_secret_fails_fast_naming_the_header(spindle):
    client = _service_client(spindle, **{"Modal-Secret": ""})
    t0 = time.monotonic()
    with pytest.raises(tinker.APIStatusError) as info:
        client.create_lora_training_client(constants.BASE_MODEL, rank=4)
    assert time.monotonic() - t0 < 30
    assert info.value.status_code == 401
    assert "Modal-Secret" in str(info.value)
    _no_planted_values(str(info.value))


def test_sdk_with_wrong_api_key_gets_401(spindle):
    wrong = {**CREDS, "TINKER_API_KEY": "tml-not-the-planted-key"}
    client = _service_client(spindle, creds=wrong)
    with pytest.raises(tinker.APIStatusError) as info:
        client.create_lora_training_client(constants.BASE_MODEL, rank=4)
    assert info.value.status_code == 401 and "X-API-Key" in str(info.value)
    _no_planted_values(str(info.value))


def test_spindle_exits_at_once_naming_an_unset_variable(tmp_path):
    env = {k: v for k, v in {**os.environ, **CREDS}.items() if k != "MODAL_PROXY_TOKEN_SECRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH")) if p
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dppo_harness.local_server",
            "--profile",
            "spindle",
            "--model",
            FAST_MODEL,
            "--run-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MODAL_PROXY_TOKEN_SECRET" in lines[0], proc.stderr
    _no_planted_values(proc.stderr)


def test_process_helper_reports_the_missing_variable(tmp_path):
    env = {k: v for k, v in {**os.environ, **CREDS}.items() if k != "TINKER_API_KEY"}
    server = LocalServerProcess(run_dir=tmp_path, model=FAST_MODEL, profile="spindle", env=env, startup_timeout=60)
    with pytest.raises(LocalServerDied, match="TINKER_API_KEY") as info:
        server.start()
    assert server.returncode == 2 and not server.alive()
    _no_planted_values(str(info.value))


# ---- identity, marker, served name --------------------------------------------------------------


def test_spindle_serves_the_base_model_by_name_with_the_marker(spindle):
    client = _service_client(spindle)
    caps = client.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [constants.BASE_MODEL]
    raw = httpx.get(spindle.base_url + f"{API}/get_server_capabilities", headers=_headers()).json()
    assert raw["embedded_server"] == {
        "marker": constants.EMBEDDED_SERVER_MARKER,
        "stand_in": STAND_IN,
        "profile": "spindle",
    }

    training = client.create_lora_training_client(constants.BASE_MODEL, rank=4, user_metadata={"note": BODY_CANARY})
    info = training.get_info()
    assert info.model_name == constants.BASE_MODEL and info.model_data.model_name == constants.BASE_MODEL
    assert info.model_data.arch == STAND_IN
    raw_info = httpx.post(
        spindle.base_url + f"{API}/get_info",
        headers=_headers(),
        json={"model_id": training.model_id, "type": "get_info"},
    ).json()
    assert raw_info["model_data"]["embedded_server"] == constants.EMBEDDED_SERVER_MARKER
    assert raw_info["model_data"]["arch"] == STAND_IN

    # No optimizer echo beyond the SDK type: the applied hyperparameters are not sent back.
    training.forward_backward([_datum()], "cross_entropy").result()
    metrics = training.optim_step(types.AdamParams(learning_rate=1e-3, eps=1e-8)).result().metrics or {}
    assert not set(metrics) & OPTIMIZER_ECHO_KEYS, metrics
    assert metrics["optim/grad_norm"] > 0

    # The stand-in's own name is not served under this profile.
    with pytest.raises(tinker.RequestFailedError, match="not served"):
        client.create_lora_training_client(STAND_IN, rank=4)


def test_default_profile_carries_the_marker_too(default_server):
    raw = httpx.get(default_server.base_url + f"{API}/get_server_capabilities")
    assert raw.headers[constants.EMBEDDED_SERVER_HEADER] == constants.EMBEDDED_SERVER_MARKER
    assert raw.json()["embedded_server"] == {
        "marker": constants.EMBEDDED_SERVER_MARKER,
        "stand_in": STAND_IN,
        "profile": "default",
    }
    missing = httpx.get(default_server.base_url + f"{API}/no_such_endpoint")
    assert missing.status_code == 404
    assert missing.headers[constants.EMBEDDED_SERVER_HEADER] == constants.EMBEDDED_SERVER_MARKER
    client = _opened(
        default_server, tinker.ServiceClient(base_url=default_server.base_url, api_key=constants.LOCAL_API_KEY)
    )
    training = client.create_lora_training_client(constants.BASE_MODEL, rank=4)
    info = training.get_info()
    assert info.model_data.arch == STAND_IN and info.model_name == constants.BASE_MODEL
    raw_info = httpx.post(
        default_server.base_url + f"{API}/get_info", json={"model_id": training.model_id, "type": "get_info"}
    ).json()
    assert raw_info["model_data"]["embedded_server"] == constants.EMBEDDED_SERVER_MARKER


# ---- pydantic request validation over HTTP ------------------------------------------------------


def test_malformed_requests_get_400_naming_the_field(spindle):
    session = httpx.post(
        spindle.base_url + f"{API}/create_session",
        headers=_headers(),
        json={"tags": [], "user_metadata": None, "sdk_version": "test"},
    ).json()["session_id"]
    cases = [
        (
            {
                "session_id": session,
                "model_seq_id": 0,
                "base_model": constants.BASE_MODEL,
                "lora_config": {"rank": "four"},
            },
            "lora_config.rank",
        ),
        (
            {"session_id": session, "base_model": constants.BASE_MODEL, "lora_config": {"rank": 4}},
            "missing field model_seq_id",
        ),
        (
            {
                "session_id": session,
                "model_seq_id": 0,
                "base_model": constants.BASE_MODEL,
                "lora_config": {"rank": 4},
                "bogus": 1,
            },
            "unknown field bogus",
        ),
    ]
    for body, needle in cases:
        resp = httpx.post(spindle.base_url + f"{API}/create_model", headers=_headers(), json=body)
        assert resp.status_code == 400, resp.text
        assert needle in resp.json()["error"] and resp.json()["category"] == "user"
    not_json = httpx.post(spindle.base_url + f"{API}/optim_step", headers=_headers(), content=b"{not json")
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]


# ---- REST reads ---------------------------------------------------------------------------------


def test_rest_reads_through_the_sdk_rest_client(spindle):
    client = _service_client(spindle)
    rest = _rest_client(client)
    training = client.create_lora_training_client(
        constants.BASE_MODEL, rank=8, user_metadata={"renderer_name": constants.RENDERER_NAME}
    )
    training.forward_backward([_datum()], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    state_path = training.save_state("rest-read-1").result().path
    sampler_path = training.save_weights_for_sampler("rest-read-s1").result().path

    run = rest.get_training_run_by_tinker_path(state_path).result()
    assert run.training_run_id == training.model_id
    assert run.base_model == constants.BASE_MODEL and run.is_lora and run.lora_rank == 8
    assert run.user_metadata == {"renderer_name": constants.RENDERER_NAME}  # what the cookbook checks
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state_path
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler_path
    assert rest.get_training_run(training.model_id).result() == run
    # The cookbook's own resume/load check reads it through the same call (it used to warn and skip).
    from tinker_cookbook import checkpoint_utils

    assert checkpoint_utils.get_renderer_name_from_checkpoint(client, state_path) == constants.RENDERER_NAME

    listing = rest.list_checkpoints(training.model_id).result()
    assert [(c.checkpoint_type, c.checkpoint_id, c.tinker_path) for c in listing.checkpoints] == [
        ("training", "weights/rest-read-1", state_path),
        ("sampler", "sampler_weights/rest-read-s1", sampler_path),
    ]
    weights = rest.get_weights_info_by_tinker_path(state_path).result()
    assert weights.base_model == constants.BASE_MODEL and weights.is_lora and weights.lora_rank == 8

    runs = rest.list_training_runs().result()
    assert training.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count >= 1

    # A run restored from the checkpoint is a training run of its own, with the checkpoint's rank.
    restored = client.create_training_client_from_state_with_optimizer(state_path)
    again = rest.get_training_run(restored.model_id).result()
    assert again.base_model == constants.BASE_MODEL and again.lora_rank == 8

    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("no-such-run").result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(f"tinker://{training.model_id}/weights/never-saved").result()


def test_lora_switches_reach_the_engine_and_are_reported(spindle):
    """train_mlp / train_attn / train_unembed select the LoRA targets over HTTP (not silently all
    layers), and the weights info of a checkpoint reports the switches it was trained with."""
    client = _service_client(spindle)
    rest = _rest_client(client)
    attn_only = client.create_lora_training_client(constants.BASE_MODEL, rank=4, train_mlp=False, train_unembed=False)
    everything = client.create_lora_training_client(constants.BASE_MODEL, rank=4)
    for training in (attn_only, everything):
        training.forward_backward([_datum()], "cross_entropy").result()
    path = attn_only.save_state("switches-1").result().path
    weights = rest.get_weights_info_by_tinker_path(path).result()
    assert (weights.train_mlp, weights.train_attn, weights.train_unembed) == (False, True, False)
    full = rest.get_weights_info_by_tinker_path(everything.save_state("switches-2").result().path).result()
    assert (full.train_mlp, full.train_attn, full.train_unembed) == (True, True, True)


# ---- faults in the spindle profile --------------------------------------------------------------


def test_spindle_storms_and_latency_are_injectable(spindle):
    before = spindle.stats()["faults"]["injected"]
    client = _service_client(spindle)
    sampler = client.create_sampling_client(base_model=constants.BASE_MODEL)
    t0 = time.monotonic()
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=3)).result()
    assert len(result.sequences) == 2
    assert time.monotonic() - t0 >= 0.15
    injected = spindle.stats()["faults"]["injected"]
    assert injected["asample:503"] - before.get("asample:503", 0) == 2
    assert injected["asample:latency"] >= 1


# ---- request log --------------------------------------------------------------------------------


def test_request_log_has_one_line_per_request_and_no_headers_or_bodies(spindle):
    client = _service_client(spindle)
    training = client.create_lora_training_client(constants.BASE_MODEL, rank=4, user_metadata={"note": BODY_CANARY})
    training.forward_backward([_datum()], "cross_entropy").result()
    marker_path = f"{API}/get_server_capabilities"
    n_before = sum(1 for m in _request_log_lines(spindle) if m.group(2) == marker_path)
    httpx.get(spindle.base_url + marker_path, headers=_headers(Modal_Secret="ws-wrong"))
    httpx.get(spindle.base_url + marker_path, headers=_headers())
    # The request-log line is written (unbuffered stderr) before the response leaves the server,
    # so both lines are in the log once both calls returned: no waiting.
    lines = [m for m in _request_log_lines(spindle) if m.group(2) == marker_path]
    assert [m.group(3) for m in lines[n_before : n_before + 2]] == ["401", "200"]

    text = spindle.log_path.read_text(errors="replace")
    matches = _request_log_lines(spindle)
    statuses = {
        (m.group(1), m.group(2).split("/")[3] if m.group(2).startswith(API) else m.group(2), m.group(3))
        for m in matches
    }
    assert ("POST", "create_model", "200") in statuses and ("POST", "forward_backward", "200") in statuses
    assert ("POST", "create_model", "429") in statuses  # injected rejections are logged too
    _no_planted_values(text)
    assert BODY_CANARY not in text
    assert "ws-wrong" not in text
    for header in ("x-api-key", "modal-key", "modal-secret", "user-agent"):
        assert header not in text.lower()

"""The embedded server's `--profile spindle` against what Spindle's source shows (modal-projects/spindle;
docs/local-server.md "Spindle profile"), driven by the stock tinker 0.25 SDK and raw httpx where
the SDK hides the wire. One engine is built per module and shared by in-process servers (one per
configuration); the CLI checks and the request log use child processes.

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
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from server_in_process import InProcessServer
from tinker import types

from dppo_harness import constants
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.faults import FaultConfig, parse_model_lost, parse_queue_pause, parse_reject_first
from dppo_harness.local_server.process import LocalServerDied, LocalServerProcess
from dppo_harness.local_server.profiles import (
    SPINDLE_CLIENT_CONFIG,
    SpindleSettings,
    make_profile,
)

# optim_step metrics that only echo the requested optimizer config; Spindle does not send them.
OPTIMIZER_ECHO_KEYS = frozenset(
    f"optim/{k}" for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
)

os.environ.setdefault("TINKER_TELEMETRY", "0")

FAST_MODEL = "tiny-qwen3-random"
STAND_IN = "local/tiny-qwen3-random"
FULL_ONLY = "Qwen/Qwen3.5-4B"
PROMPT = [248045, 846, 198]  # "<|im_start|>user\n"
API = "/api/v1"
BODY_CANARY = f"body-canary-{uuid.uuid4().hex[:12]}"
LOG_LINE = re.compile(r"dppo_harness\.local_server\.requests (GET|POST|PUT|DELETE) (/\S+) (\d{3}) (\d+\.\d)ms$")
UNAUTHORIZED = {"error": "unauthorized", "message": "unauthorized"}
NOT_FOUND = {"detail": "Not Found"}


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


def _no_planted_values(text: str, creds: dict[str, str] = CREDS) -> None:
    for var, value in creds.items():
        assert value not in text, f"the value of {var} leaked"


# ---- servers and clients ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("spindle-engine"), model_name=FAST_MODEL)


_CLIENTS: list[tinker.ServiceClient] = []


@contextlib.contextmanager
def _server(engine, faults: FaultConfig | None = None, **settings) -> Iterator[InProcessServer]:
    """A spindle-profile server in this process over the shared engine (settings: SpindleSettings)."""
    profile = make_profile("spindle", CREDS, SpindleSettings(**settings))
    srv = InProcessServer(engine, faults=faults, profile=profile).start()
    try:
        yield srv
    finally:
        while _CLIENTS:
            with contextlib.suppress(Exception):
                _CLIENTS.pop().holder.close()  # SDK 0.25 has no session close: stop its heartbeat
        srv.stop()


@pytest.fixture(scope="module")
def spindle(engine):
    with _server(engine) as srv:
        yield srv


def _sdk(srv, creds: dict[str, str] = CREDS, **overrides: str) -> tinker.ServiceClient:
    modal = {"Modal-Key": creds["MODAL_PROXY_TOKEN_ID"], "Modal-Secret": creds["MODAL_PROXY_TOKEN_SECRET"]}
    modal.update(overrides)
    client = tinker.ServiceClient(base_url=srv.base_url, api_key=creds["TINKER_API_KEY"], default_headers=modal)
    _CLIENTS.append(client)
    return client


def _rest(client: tinker.ServiceClient) -> tinker.RestClient:
    with warnings.catch_warnings():  # tinker.RestClient() cannot carry the Modal headers
        warnings.simplefilter("ignore", FutureWarning)
        return client.create_rest_client()


def _post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.base_url + f"{API}/{path}", headers=_headers(), json=body, timeout=60, **kw)


def _session(srv) -> str:
    resp = _post(srv, "create_session", {"tags": [], "user_metadata": None, "sdk_version": "test"})
    assert resp.status_code == 200, resp.text
    return resp.json()["session_id"]


def _create(srv, session: str, seq: int = 0, **lora) -> httpx.Response:
    body = {
        "session_id": session,
        "model_seq_id": seq,
        "base_model": constants.BASE_MODEL,
        "lora_config": {"rank": 4, **lora},
    }
    return _post(srv, "create_model", body)


def _poll(srv, request_id: str) -> httpx.Response:
    return _post(srv, "retrieve_future", {"request_id": request_id})


def _result(srv, request_id: str, timeout: float = 120.0) -> dict:
    """Polls until the future resolves; every pending poll must be Spindle's exact 408 body."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = _poll(srv, request_id)
        if resp.status_code != 408:
            assert resp.status_code == 200, resp.text
            return resp.json()
        assert resp.json() == {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    raise AssertionError(f"{request_id} still pending after {timeout} s")


def _model(srv, session: str, seq: int = 0) -> str:
    resp = _create(srv, session, seq)
    assert resp.status_code == 200, resp.text
    assert _result(srv, resp.json()["request_id"])["model_id"] == resp.json()["model_id"]
    return resp.json()["model_id"]


def _datum(n: int = 4) -> types.Datum:
    tokens = [248045, 846, 198, 5, 6, 7, 8, 9][:n]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": tokens[1:] + [10], "weights": [1.0] * n},
    )


# ---- 1. auth: the exchange's front door, then Spindle's X-API-Key --------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"Modal_Key": None}, "research exchange front door: missing header Modal-Key"),
        ({"Modal_Secret": None}, "research exchange front door: missing header Modal-Secret"),
        ({"Modal_Key": "wk-wrong"}, "research exchange front door: invalid credentials in header Modal-Key"),
        ({"Modal_Secret": "ws-wrong"}, "research exchange front door: invalid credentials in header Modal-Secret"),
    ],
)
def test_front_door_401_names_the_header_never_a_value(spindle, override, message):
    sent = _headers(**override)
    for method, path in (("GET", f"{API}/healthz"), ("POST", f"{API}/create_session"), ("GET", f"{API}/nope")):
        resp = httpx.request(method, spindle.base_url + path, headers=sent, json={})
        assert resp.status_code == 401 and resp.json() == {"error": message, "category": "user"}, resp.text
        assert resp.headers[constants.EMBEDDED_SERVER_HEADER] == constants.EMBEDDED_SERVER_MARKER
        _no_planted_values(resp.text + "".join(f"{k}: {v}" for k, v in resp.headers.items()))


@pytest.mark.parametrize("key", [None, "tml-wrong-key", "no-prefix-key"])
def test_spindle_checks_x_api_key_after_routing(spindle, key):
    sent = _headers(X_API_Key=key)
    for method, path in (
        ("GET", f"{API}/healthz"),
        ("GET", f"{API}/get_server_capabilities"),
        ("POST", f"{API}/create_session"),
        ("GET", f"{API}/spindle/deployments"),
        ("GET", "/_harness/stats"),
    ):
        resp = httpx.request(method, spindle.base_url + path, headers=sent, json={})
        assert resp.status_code == 401 and resp.json() == UNAUTHORIZED, (path, resp.text)
        _no_planted_values(resp.text)
    # an unknown route answers 404 before the key is looked at
    missing = httpx.get(spindle.base_url + f"{API}/no_such_endpoint", headers=sent)
    assert missing.status_code == 404 and missing.json() == NOT_FOUND
    assert missing.headers[constants.EMBEDDED_SERVER_HEADER] == constants.EMBEDDED_SERVER_MARKER


def test_sdk_with_wrong_key_or_without_front_door_header_gets_401(spindle):
    wrong = {**CREDS, "TINKER_API_KEY": "tml-not-the-planted-key"}
    with pytest.raises(tinker.APIStatusError) as info:
        _sdk(spindle, creds=wrong).create_lora_training_client(constants.BASE_MODEL, rank=4)
    assert info.value.status_code == 401 and "unauthorized" in str(info.value)
    t0 = time.monotonic()
    with pytest.raises(tinker.APIStatusError) as info:
        _sdk(spindle, **{"Modal-Secret": ""}).create_lora_training_client(constants.BASE_MODEL, rank=4)
    assert time.monotonic() - t0 < 30
    assert info.value.status_code == 401 and "Modal-Secret" in str(info.value)
    _no_planted_values(str(info.value))


def test_spindle_exits_at_once_naming_an_unset_variable(tmp_path):
    env = {k: v for k, v in {**os.environ, **CREDS}.items() if k != "MODAL_PROXY_TOKEN_SECRET"}
    proc = _cli(["--profile", "spindle", "--run-dir", str(tmp_path)], env)
    assert proc.returncode == 2 and proc.stdout == ""
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


# ---- 2. routes Spindle lacks and has; 3. client/config --------------------------------------------


def test_routes_spindle_lacks_answer_fastapi_404(spindle):
    session = _session(spindle)
    for method, path in (
        ("POST", f"sessions/{session}/finish"),
        ("GET", f"sessions/{session}"),
        ("POST", "cancel_future"),
        ("POST", "retrieve_futures"),
        ("GET", "checkpoints"),
        ("POST", "save_weights_external"),
        ("POST", "external_weights_urls"),
        ("POST", "join_sampling_session"),
        ("POST", "create_custom_loss"),
        ("POST", "copy_weights"),
        ("POST", "auth/token"),
    ):
        resp = httpx.request(method, spindle.base_url + f"{API}/{path}", headers=_headers(), json={})
        assert resp.status_code == 404 and resp.json() == NOT_FOUND, (path, resp.text)


def test_deployments_capabilities_and_client_config(spindle, engine):
    deployments = httpx.get(spindle.base_url + f"{API}/spindle/deployments", headers=_headers()).json()
    ctx = engine.config.max_position_embeddings
    assert deployments == {
        "deployments": [
            {
                "name": "qwen3-5-2b-lora",
                "definition_id": "qwen3-5-2b-lora",
                "base_model": constants.BASE_MODEL,
                "parameterization": "lora",
                "max_context_length": ctx,
            },
            {
                "name": "qwen3-5-4b-full",
                "definition_id": "qwen3-5-4b-full",
                "base_model": FULL_ONLY,
                "parameterization": "full",
                "max_context_length": 32768,
            },
        ]
    }
    raw = httpx.get(spindle.base_url + f"{API}/get_server_capabilities", headers=_headers()).json()
    assert raw["supported_models"] == [
        {"model_name": constants.BASE_MODEL, "max_context_length": ctx},
        {"model_name": FULL_ONLY, "max_context_length": 32768},
    ]
    assert raw["embedded_server"] == {
        "marker": constants.EMBEDDED_SERVER_MARKER,
        "stand_in": STAND_IN,
        "profile": "spindle",
    }
    caps = _sdk(spindle).get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [constants.BASE_MODEL, FULL_ONLY]
    config = httpx.post(spindle.base_url + f"{API}/client/config", headers=_headers(), json={}).json()
    assert (
        config
        == SPINDLE_CLIENT_CONFIG
        == {
            "pjwt_auth_enabled": False,
            "credential_default_source": "api_key",
            "parallel_fwdbwd_chunks": True,
            "proto_write_fwdbwd": True,
            "proto_compress_fwdbwd": True,
            "use_pyqwest_transport": False,
            "create_model_via_load_weights": True,
        }
    )


def test_default_profile_keeps_its_routes_and_has_no_deployments(engine):
    with InProcessServer(engine) as srv:
        assert httpx.get(srv.base_url + f"{API}/spindle/deployments").status_code == 404
        assert httpx.post(srv.base_url + f"{API}/cancel_future", json={"request_id": "x"}).status_code == 404
        caps = httpx.get(srv.base_url + f"{API}/get_server_capabilities").json()
        assert [m["model_name"] for m in caps["supported_models"]] == [constants.BASE_MODEL, STAND_IN]


# ---- 4. creation refusals ------------------------------------------------------------------------


def test_create_model_refusals_at_the_post(spindle):
    session = _session(spindle)
    body = {"session_id": session, "model_seq_id": 0, "lora_config": {"rank": 4}}
    for base, message in (
        (STAND_IN, f"unsupported base_model: {STAND_IN}"),
        (FULL_ONLY, f"lora parameterization is not available for {FULL_ONLY}"),
    ):
        resp = _post(spindle, "create_model", {**body, "base_model": base})
        assert resp.status_code == 400 and resp.json() == {"error": "invalid_request", "message": message}
    with pytest.raises(tinker.BadRequestError, match="lora parameterization is not available"):
        _sdk(spindle).create_lora_training_client(FULL_ONLY, rank=4)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"seed": 3}, "accept model: Miles multi-LoRA does not support per-model seeds"),
        ({"train_mlp": False}, "accept model: Miles uses deployment-wide LoRA targets; model train_attn, train_mlp"),
        ({"train_unembed": False}, "must match the deployment"),
        ({"rank": 64}, "accept model: LoRA rank must be between 1 and 32"),
    ],
)
def test_miles_refusals_fail_the_creation_future_as_user_errors(spindle, kwargs, text):
    rank = kwargs.pop("rank", 4)
    with pytest.raises(tinker.RequestFailedError) as info:
        _sdk(spindle).create_lora_training_client(constants.BASE_MODEL, rank=rank, **kwargs)
    assert text in str(info.value)
    assert info.value.category == types.RequestErrorCategory.User
    assert spindle.state.stats()["trainer_slots_held"] == len(spindle.state.slots)  # a refusal frees its slot
    assert all(m in spindle.state.models for m in spindle.state.slots)


# ---- 5. get_info and optim_step ------------------------------------------------------------------


def test_get_info_and_optim_step_answer_spindles_fields(spindle):
    training = _sdk(spindle).create_lora_training_client(constants.BASE_MODEL, rank=8)
    raw = _post(spindle, "get_info", {"model_id": training.model_id, "type": "get_info"}).json()
    assert raw == {
        "type": "get_info",
        "model_id": training.model_id,
        "model_data": {"model_name": STAND_IN},  # the model that computes, not the deployment's name
        "model_name": STAND_IN,
        "is_lora": True,
        "lora_rank": 8,
        "parameterization": {"type": "lora"},
    }
    info = training.get_info()
    assert info.model_name == STAND_IN and info.model_data.model_name == STAND_IN
    training.forward_backward([_datum()], "cross_entropy").result()
    metrics = training.optim_step(types.AdamParams(learning_rate=1e-3, eps=1e-8)).result().metrics or {}
    assert not set(metrics) & OPTIMIZER_ECHO_KEYS
    assert {k for k in metrics if not k.startswith("timing/")} == {"update_successful:mean", "grad_norm:mean"}
    assert metrics["update_successful:mean"] == 1.0 and metrics["grad_norm:mean"] > 0
    assert metrics["timing/optimizer_step"] == 0.0


# ---- 6. futures: cold start, slots, never a paused state -----------------------------------------


def test_cold_start_and_slots_keep_creations_pending_as_active(engine):
    with _server(engine, cold_start_s=2.0, trainer_slots=1) as srv:
        session = _session(srv)
        t0 = time.monotonic()
        first = _create(srv, session, 0).json()
        assert first["model_id"] == f"{session}:train:0"
        pending = _poll(srv, first["request_id"])
        assert pending.status_code == 408
        assert pending.json() == {"type": "try_again", "request_id": first["request_id"], "queue_state": "active"}
        assert _result(srv, first["request_id"]) == {"model_id": first["model_id"], "type": "create_model"}
        assert time.monotonic() - t0 >= 2.0
        # the one slot is held: the next creation (a create-via-load too) waits, active, no reason
        second = _create(srv, session, 1).json()
        for _ in range(2):
            resp = _poll(srv, second["request_id"])
            assert resp.status_code == 408 and resp.json()["queue_state"] == "active"
            assert set(resp.json()) == {"type", "request_id", "queue_state"}
        assert srv.state.waiting_creations == 1
        unload = _post(srv, "unload_model", {"model_id": first["model_id"], "type": "unload_model"}).json()
        assert _result(srv, second["request_id"])["model_id"] == second["model_id"]
        assert _result(srv, unload["request_id"]) == {"model_id": first["model_id"], "type": "unload_model"}
        assert srv.state.slots == {second["model_id"]}


def test_zero_slots_pend_forever_and_a_refused_creation_fails_as_server(engine):
    with _server(engine, trainer_slots=0) as srv:
        created = _create(srv, _session(srv)).json()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            resp = _poll(srv, created["request_id"])
            assert resp.status_code == 408 and resp.json()["queue_state"] == "active"
    with _server(engine, FaultConfig(capacity_exhausted=1)) as srv:
        client = _sdk(srv)
        with pytest.raises(tinker.RequestFailedError) as info:
            client.create_lora_training_client(constants.BASE_MODEL, rank=4)
        assert "engine refused work: trainer capacity exhausted" in str(info.value)
        assert info.value.category == types.RequestErrorCategory.Server
        client.create_lora_training_client(constants.BASE_MODEL, rank=4)  # the storm is over: placed


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(env if env is not None else {**os.environ, **CREDS})
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH")) if p
    )
    return subprocess.run(
        [sys.executable, "-m", "dppo_harness.local_server", "--model", FAST_MODEL, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_refuses_paused_holds_under_spindle_and_spindle_options_on_default(tmp_path):
    paused = _cli(["--profile", "spindle", "--run-dir", str(tmp_path), "--fault-queue-pause", "create_model:1:5"])
    assert paused.returncode != 0 and paused.stdout == ""
    lines = paused.stderr.strip().splitlines()
    assert len(lines) == 1 and "never sends queue_state paused_capacity" in lines[0], paused.stderr
    assert "create_model:1:5:active" in lines[0]
    default = _cli(["--run-dir", str(tmp_path), "--cold-start-s", "3", "--fault-model-lost", "optim_step:2"])
    assert default.returncode != 0
    assert default.stderr.strip().splitlines()[-1] == (
        "--cold-start-s, --fault-model-lost: only with --profile spindle (Spindle's capacity, sweep and trainer faults)"
    )


def test_an_active_hold_polls_like_any_pending_request(engine):
    with _server(engine, FaultConfig(queue_pause=(parse_queue_pause("create_model:1:2:active"),))) as srv:
        created = _create(srv, _session(srv)).json()
        resp = _poll(srv, created["request_id"])
        assert resp.status_code == 408
        assert resp.json() == {"type": "try_again", "request_id": created["request_id"], "queue_state": "active"}
        assert _result(srv, created["request_id"])["model_id"] == created["model_id"]


# ---- 7. Spindle's error shapes: 429 saturated, 410 model_lost ------------------------------------


def test_injected_429_is_spindles_saturated_body_and_the_sdk_retries_it(engine):
    faults = FaultConfig(reject_first=(parse_reject_first("create_model:429:1"),), retry_after_ms=50)
    with _server(engine, faults) as srv:
        session = _session(srv)
        resp = _create(srv, session)
        assert resp.status_code == 429
        assert resp.json() == {"error": "saturated", "message": "engine refused work: operation buffer full"}
        training = _sdk(srv).create_lora_training_client(constants.BASE_MODEL, rank=4)  # the SDK retries a 429
        assert training.model_id


def test_model_lost_answers_410_and_fails_pending_futures(engine):
    with _server(engine, FaultConfig(model_lost=(parse_model_lost("optim_step:2"),))) as srv:
        model_id = _model(srv, _session(srv))
        adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
        step = {"model_id": model_id, "adam_params": adam, "type": "optim_step"}
        waiting = _post(srv, "optim_step", {**step, "seq_id": 3}).json()  # waits for seq_id 1 and 2
        lost = _post(srv, "optim_step", {**step, "seq_id": 1})
        assert lost.status_code == 410
        assert lost.json() == {"error": "model_lost", "message": f"engine owning model {model_id} terminated"}
        assert _result(srv, waiting["request_id"]) == {
            "error": "engine terminated before producing a result",
            "category": "server",
        }
        again = _post(srv, "save_weights", {"model_id": model_id, "seq_id": 4, "path": "x", "type": "save_weights"})
        assert again.status_code == 410 and again.json()["error"] == "model_lost"
        assert model_id not in srv.state.slots
    # the stock SDK does not retry a 410 on a submit: it raises at once
    with _server(engine, FaultConfig(model_lost=(parse_model_lost("forward_backward:2"),))) as srv:
        training = _sdk(srv).create_lora_training_client(constants.BASE_MODEL, rank=4)
        training.forward_backward([_datum()], "cross_entropy").result()
        t0 = time.monotonic()
        with pytest.raises(tinker.APIStatusError) as info:
            training.forward_backward([_datum()], "cross_entropy").result()
        assert info.value.status_code == 410 and time.monotonic() - t0 < 10


# ---- 8. checkpoints ------------------------------------------------------------------------------


def test_checkpoint_loads_saves_and_archive(spindle):
    client = _sdk(spindle)
    training = client.create_lora_training_client(constants.BASE_MODEL, rank=8)
    training.forward_backward([_datum()], "cross_entropy").result()
    path = training.save_state("ckpt-a").result().path
    assert path == f"tinker://{training.model_id}/weights/ckpt-a"
    # create-via-load (the SDK's create_training_client_from_state under create_model_via_load_weights)
    session = _session(spindle)
    created = _post(
        spindle, "load_weights", {"path": path, "session_id": session, "model_seq_id": 0, "optimizer": True}
    ).json()
    assert _result(spindle, created["request_id"]) == {"type": "load_weights", "model_id": f"{session}:train:0"}
    restored = client.create_training_client_from_state_with_optimizer(path)
    assert restored.get_info().lora_rank == 8
    # a load into an existing model returns the path
    assert training.load_state(path).result().path == path
    # a second save under the name fails the future, category server
    with pytest.raises(tinker.RequestFailedError) as info:
        training.save_state("ckpt-a").result()
    assert f"checkpoint already exists: /checkpoints/ckpt-a/{training.model_id}" in str(info.value)
    assert info.value.category == types.RequestErrorCategory.Server
    # archive downloads are not served
    archive = httpx.get(
        spindle.base_url + f"{API}/training_runs/{training.model_id}/checkpoints/weights/ckpt-a/archive",
        headers=_headers(),
    )
    assert archive.status_code == 405
    assert archive.json() == {
        "error": "unsupported",
        "message": "archive downloads are not served; copy the checkpoint directly with "
        f"`modal volume get spindle-checkpoints /ckpt-a/{training.model_id} <dest>`",
    }
    with pytest.raises(tinker.APIStatusError) as info:
        _rest(client).get_checkpoint_archive_url(training.model_id, "weights/ckpt-a").result()
    assert info.value.status_code == 405


# ---- 9. sessions: no finish, an idle sweep --------------------------------------------------------


def test_idle_sessions_are_swept_with_their_models_and_slots(engine):
    with _server(engine, trainer_slots=1, session_idle_timeout_s=1.5, sweep_interval_s=0.25) as srv:
        idle = _session(srv)
        idle_model = _model(srv, idle)
        busy = _session(srv)
        waiting = _create(srv, busy).json()  # waits for the idle session's slot
        deadline = time.monotonic() + 30
        result = None
        while result is None and time.monotonic() < deadline:
            assert _post(srv, "session_heartbeat", {"session_id": busy, "type": "session_heartbeat"}).status_code == 200
            resp = _poll(srv, waiting["request_id"])
            if resp.status_code == 200:
                result = resp.json()
            else:
                time.sleep(0.2)
        assert result == {"model_id": waiting["model_id"], "type": "create_model"}
        assert srv.state.slots == {waiting["model_id"]} and srv.state.reclaimed_sessions == 1
        gone = _post(srv, "get_info", {"model_id": idle_model, "type": "get_info"})
        assert gone.status_code == 404 and gone.json() == {
            "error": "not_found",
            "message": f"model not found: {idle_model}",
        }
        hb = _post(srv, "session_heartbeat", {"session_id": idle, "type": "session_heartbeat"})
        assert hb.status_code == 404 and hb.json()["error"] == "not_found"


# ---- 10. sampling stops ----------------------------------------------------------------------------


def test_empty_stop_ignores_eos_and_integer_stops_are_token_ids(spindle):
    sampler = _sdk(spindle).create_sampling_client(base_model=constants.BASE_MODEL)
    prompt = types.ModelInput.from_ints(PROMPT)
    full = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=12, seed=5, stop=[])).result()
    for seq in full.sequences:
        assert len(seq.tokens) == 12 and seq.stop_reason == "length"
    alone = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=5, stop=[])).result()
    tokens = alone.sequences[0].tokens
    assert len(tokens) == 12
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=5, stop=[stop_at])).result()
    seq = stopped.sequences[0]
    assert seq.stop_reason == "stop", (tokens, seq.tokens)
    assert seq.tokens == tokens[: first + 1] or seq.tokens == tokens[:first]


# ---- existing behaviour kept under spindle -------------------------------------------------------


def test_malformed_requests_get_400_in_spindles_shape(spindle):
    session = _session(spindle)
    base = {"session_id": session, "model_seq_id": 0, "base_model": constants.BASE_MODEL}
    for body, needle in (
        ({**base, "lora_config": {"rank": "four"}}, "lora_config.rank"),
        ({"session_id": session, "base_model": constants.BASE_MODEL, "lora_config": {"rank": 4}}, "model_seq_id"),
        ({**base, "lora_config": {"rank": 4}, "bogus": 1}, "unknown field bogus"),
    ):
        resp = _post(spindle, "create_model", body)
        assert resp.status_code == 400 and resp.json()["error"] == "invalid_request"
        assert needle in resp.json()["message"]
    not_json = httpx.post(spindle.base_url + f"{API}/optim_step", headers=_headers(), content=b"{not json")
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["message"]


def test_rest_reads_through_the_sdk_rest_client(spindle):
    client = _sdk(spindle)
    rest = _rest(client)
    training = client.create_lora_training_client(
        constants.BASE_MODEL, rank=8, user_metadata={"renderer_name": constants.RENDERER_NAME}
    )
    training.forward_backward([_datum()], "cross_entropy").result()
    state_path = training.save_state("rest-read-1").result().path
    sampler_path = training.save_weights_for_sampler("rest-read-s1").result().path
    run = rest.get_training_run_by_tinker_path(state_path).result()
    assert run.training_run_id == training.model_id and run.lora_rank == 8
    assert run.user_metadata == {"renderer_name": constants.RENDERER_NAME}
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler_path
    listing = rest.list_checkpoints(training.model_id).result()
    assert [c.tinker_path for c in listing.checkpoints] == [state_path, sampler_path]
    weights = rest.get_weights_info_by_tinker_path(state_path).result()
    assert weights.base_model == constants.BASE_MODEL and weights.lora_rank == 8
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("no-such-run").result()


def test_lora_switches_reach_the_engine_on_the_default_profile(engine):
    """The default profile keeps per-model LoRA targets (Spindle refuses them, see above)."""
    with InProcessServer(engine) as srv:
        client = tinker.ServiceClient(base_url=srv.base_url, api_key=constants.LOCAL_API_KEY)
        try:
            attn_only = client.create_lora_training_client(
                constants.BASE_MODEL, rank=4, train_mlp=False, train_unembed=False
            )
            attn_only.forward_backward([_datum()], "cross_entropy").result()
            path = attn_only.save_state("switches-1").result().path
            weights = _rest(client).get_weights_info_by_tinker_path(path).result()
            assert (weights.train_mlp, weights.train_attn, weights.train_unembed) == (False, True, False)
        finally:
            with contextlib.suppress(Exception):
                client.holder.close()


def test_storms_and_latency_are_injectable(engine):
    faults = FaultConfig(
        reject_first=(parse_reject_first("asample:503:2"),), latency_ms=(("asample", 150.0),), retry_after_ms=50
    )
    with _server(engine, faults) as srv:
        sampler = _sdk(srv).create_sampling_client(base_model=constants.BASE_MODEL)
        t0 = time.monotonic()
        result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=3))
        assert len(result.result().sequences) == 2 and time.monotonic() - t0 >= 0.15
        injected = srv.state.faults.snapshot()["injected"]
        assert injected["asample:503"] == 2 and injected["asample:latency"] >= 1


# ---- request log (a child server: its stderr) -----------------------------------------------------


def test_request_log_has_one_line_per_request_and_no_headers_or_bodies(tmp_path):
    server = LocalServerProcess(run_dir=tmp_path, model=FAST_MODEL, profile="spindle", env={**os.environ, **CREDS})
    server.start()
    try:
        session = httpx.post(
            server.base_url + f"{API}/create_session",
            headers=_headers(),
            json={"tags": [], "user_metadata": {"note": BODY_CANARY}, "sdk_version": "t"},
        )
        assert session.status_code == 200
        path = f"{API}/get_server_capabilities"
        httpx.get(server.base_url + path, headers=_headers(Modal_Secret="ws-wrong"))
        httpx.get(server.base_url + path, headers=_headers(X_API_Key="tml-wrong"))
        httpx.get(server.base_url + path, headers=_headers())
        text = server.log_path.read_text(errors="replace")
        lines = [m for m in (LOG_LINE.search(line) for line in text.splitlines()) if m]
        assert [m.group(3) for m in lines if m.group(2) == path][-3:] == ["401", "401", "200"]
        assert any(m.group(2) == f"{API}/create_session" and m.group(3) == "200" for m in lines)
        _no_planted_values(text)
        assert BODY_CANARY not in text and "ws-wrong" not in text and "tml-wrong" not in text
        for header in ("x-api-key", "modal-key", "modal-secret"):
            assert header not in text.lower()
    finally:
        server.stop()
    assert not server.alive()

"""Reliability paths of the embedded server, driven by the stock tinker SDK over HTTP.

Each server here is a real `python -m dppo_harness.local_server` child with fault options; every
test checks that its server is gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import tinker
from child_pids import live_child_pids
from tinker import types

from dppo_harness import constants
from dppo_harness.local_server.faults import FaultSpecError, parse_reject_first
from dppo_harness.local_server.process import LocalServerProcess

os.environ.setdefault("TINKER_TELEMETRY", "0")

PROMPT = [248045, 846, 198]  # "<|im_start|>user\n": real Qwen3.5 ids the stand-in vocabulary keeps


# The protocol and fault paths do not depend on the weights: the small random-init preset starts
# in seconds and needs no warm-start cache (the SDK tests use the default warm-started model).
FAST_MODEL = "tiny-qwen3-random"


def _server(tmp_path_factory, name: str, fault_args: list[str]) -> LocalServerProcess:
    return LocalServerProcess(run_dir=tmp_path_factory.mktemp(name), model=FAST_MODEL, fault_args=fault_args).start()


def _client(server: LocalServerProcess, **kwargs) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.base_url, api_key=constants.LOCAL_API_KEY, **kwargs)


def _assert_gone(server: LocalServerProcess) -> None:
    server.stop()
    assert not server.alive()
    assert server.pid not in live_child_pids()


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    """One server with rejections on several kinds (first N) and a short Retry-After."""
    server = _server(
        tmp_path_factory,
        "faulty",
        [
            "--fault-reject-first",
            "create_model:503:1",
            "--fault-reject-first",
            "forward_backward:429:2",
            "--fault-reject-first",
            "asample:429:2",
            "--fault-reject-first",
            "retrieve_future:503:1",
            "--fault-retry-after-ms",
            "50",
        ],
    )
    yield server
    _assert_gone(server)


def test_default_headers_arrive_and_secrets_are_not_recorded(faulty_server):
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    secret = f"s3cret-{uuid.uuid4().hex}"
    client = _client(faulty_server, default_headers={"X-Harness-Probe": probe, "Modal-Secret": secret})
    try:
        client.create_sampling_client(base_model=constants.BASE_MODEL)
        stats = faulty_server.stats()
    finally:
        client.holder.close()  # SDK 0.25: no session close; stop its heartbeat
    assert probe in stats["headers"]["values"]["x-harness-probe"]
    assert stats["headers"]["names"]["modal-secret"] >= 1
    assert stats["headers"]["names"]["x-api-key"] >= 1
    dumped = json.dumps(stats)
    assert secret not in dumped and constants.LOCAL_API_KEY not in dumped
    assert secret not in faulty_server.log_tail(10_000)


def test_sdk_retries_injected_429_and_503_and_succeeds(faulty_server):
    client = _client(faulty_server)
    try:
        tc = client.create_lora_training_client(base_model=constants.BASE_MODEL, rank=4, seed=0)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(PROMPT[:-1]),
            loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0, 1.0]},
        )
        out = tc.forward_backward([datum], "cross_entropy").result(timeout=300)
        sampler = tc.save_weights_and_get_sampling_client()
        res = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=1)).result(
            timeout=300
        )
        stats = faulty_server.stats()["faults"]
    finally:
        client.holder.close()  # SDK 0.25: no session close; stop its heartbeat
    assert out.metrics["loss:sum"] > 0
    assert len(res.sequences) == 2 and all(len(s.tokens) >= 1 for s in res.sequences)
    injected = stats["injected"]
    assert injected["create_model:503"] == 1
    assert injected["forward_backward:429"] == 2
    assert injected["asample:429"] == 2
    assert injected["retrieve_future:503"] == 1
    # The SDK resent each rejected request: more requests arrived than were rejected.
    assert stats["requests"]["forward_backward"] >= 3
    assert stats["requests"]["asample"] >= 3


def test_capacity_exhausted_surfaces_to_sdk_and_harness_retry(tmp_path_factory):
    from dppo_harness.service.wait.policy import call_with_capacity_retry, is_capacity_error

    server = _server(tmp_path_factory, "capacity", ["--fault-capacity-exhausted", "2"])
    try:
        client = _client(server)
        with pytest.raises(tinker.RequestFailedError) as info:
            client.create_lora_training_client(base_model=constants.BASE_MODEL, rank=4)
        assert "trainer capacity exhausted" in str(info.value)
        assert info.value.category == types.RequestErrorCategory.Server
        assert is_capacity_error(info.value)
        # The harness's retry layer sees the refusal, backs off and succeeds on the next attempt.
        retries: list = []
        tc = call_with_capacity_retry(
            lambda: client.create_lora_training_client(base_model=constants.BASE_MODEL, rank=4), sleep=retries.append
        )
        assert len(retries) == 1  # one backoff after the refusal
        assert tc.get_info().lora_rank == 4
        assert server.stats()["faults"]["injected"]["create_model:capacity_exhausted"] == 2
        client.holder.close()  # SDK 0.25: no session close; stop its heartbeat
    finally:
        _assert_gone(server)


def test_unknown_model_is_refused_with_a_user_error(faulty_server):
    client = _client(faulty_server)
    try:
        with pytest.raises(tinker.RequestFailedError) as info:
            client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4)
    finally:
        client.holder.close()  # SDK 0.25: no session close; stop its heartbeat
    message = str(info.value)
    assert info.value.category == types.RequestErrorCategory.User
    assert "'Qwen/Qwen3-8B' is not served" in message and constants.BASE_MODEL in message


def test_server_death_after_k_requests_is_a_clear_error(tmp_path_factory):
    # client_config, dynamic_config, create_session, create_model, retrieve_future = 5 (SDK 0.25's
    # create_lora_training_client sends no get_info); the 6th API request (normally the first
    # forward; a session heartbeat if the machine is slow) kills the server.
    server = _server(tmp_path_factory, "dies", ["--fault-die-after", "5"])
    try:
        client = _client(server)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(PROMPT[:-1]),
            loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0, 1.0]},
        )
        tc = client.create_lora_training_client(base_model=constants.BASE_MODEL, rank=4)  # SDK 0.25: synchronous
        tc.forward([datum], "cross_entropy")  # never answered: the server exits at it
        deadline = time.monotonic() + 120
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.returncode == 75
        assert "fault injection: exiting after 5 API requests" in server.log_tail()
        stats = server.stats()  # read from the file the dying server left behind
        assert stats["faults"]["api_requests"] == 6 and stats["faults"]["injected"]["*:die"] == 1
    finally:
        _assert_gone(server)


def test_injected_latency_is_non_blocking(tmp_path_factory):
    server = _server(tmp_path_factory, "latency", ["--fault-latency-ms", "asample:400"])
    client = _client(server)
    try:
        sampler = client.create_sampling_client(base_model=constants.BASE_MODEL)
        params = types.SamplingParams(max_tokens=2, seed=0)
        prompt = types.ModelInput.from_ints(PROMPT)
        sampler.sample(prompt, 1, params).result(timeout=300)  # warm-up
        t0 = time.perf_counter()
        sampler.sample(prompt, 1, params).result(timeout=300)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        futures = [sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=i)) for i in range(16)]
        for f in futures:
            f.result(timeout=300)
        sixteen = time.perf_counter() - t0
        injected = server.stats()["faults"]["injected"]["asample:latency"]
    finally:
        client.holder.close()  # SDK 0.25: no session close; stop its heartbeat
        _assert_gone(server)
    assert one >= 0.4 and injected == 18
    # Served one after another, the 16 latencies alone take 6.4 s. The bound is half of that, not a
    # multiple of `one`: the samples' own compute grows with the machine's load, the latency does not.
    assert sixteen < 16 * 0.4 / 2, f"16 concurrent samples took {sixteen:.2f}s, one took {one:.2f}s"


# ---- CLI refusals (no engine is loaded: these fail before startup) -----------------------------


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    from dppo_harness.local_server.process import _src_root

    env = dict(os.environ, PYTHONPATH=_src_root())
    return subprocess.run(
        [sys.executable, "-m", "dppo_harness.local_server", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "example.com"])
def test_cli_refuses_non_loopback_hosts(host):
    res = _run_cli("--host", host, "--port", "0")
    assert res.returncode != 0
    assert "loopback" in res.stderr and "listening on" not in res.stdout


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("forward_backward:418:2", "status must be one of"),
        ("asample:429", "3 ':'-separated"),
        ("asample:429:x", "N must be an integer"),
    ],
)
def test_bad_fault_spec_names_the_problem(spec, needle):
    with pytest.raises(FaultSpecError, match=needle):
        parse_reject_first(spec)
    res = _run_cli("--fault-reject-first", spec)
    assert res.returncode != 0 and needle in res.stderr and "--fault-reject-first" in res.stderr


def test_cli_refuses_recording_secret_header_values():
    res = _run_cli("--record-header-values", "X-Harness-Probe,Modal-Secret")
    assert res.returncode != 0 and "refusing to record secret header" in res.stderr

"""The SDK's session setup is waited on like every other call: the connectivity check keeps its
bound when the service never answers a first-contact read, and a ServiceClient's first create
(which builds the SDK's session holder inside tinker 0.25's blocking call: client/config,
dynamic_config, create_session) stops under the hang window instead of the SDK's minutes of
per-attempt timeouts and retries; the stopped setup holds nothing the release needs."""

from __future__ import annotations

import threading
import time

import pytest
from server_in_process import InProcessServer

from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.faults import FaultConfig, parse_latency, parse_reject_first
from dppo_harness.service.connectivity import ConnectivityError, check_connectivity
from dppo_harness.service.observed import make_service_client
from dppo_harness.service.wait.policy import ServiceHang, WaitPolicy
from dppo_harness.service.wait.waiter import ServiceWaiter

MODEL = "tiny-qwen3-random"
BASE = "Qwen/Qwen3.5-2B"
NEVER = "600000"  # ms: longer than any bound here, shorter than the SDK's own patience


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("setup-run"), model_name=MODEL)


@pytest.mark.timeout(60)
def test_the_connectivity_probe_keeps_its_bound_when_the_sdk_setup_never_ends(engine, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(latency_ms=(parse_latency(f"client_dynamic_config:{NEVER}"),))
    with InProcessServer(engine, faults=faults) as srv:
        t0 = time.monotonic()
        with pytest.raises(ConnectivityError, match="client/dynamic_config got no answer"):
            check_connectivity("local", srv.base_url, BASE, timeout_s=2)
        assert time.monotonic() - t0 < 8  # one read's 2 s bound
        assert not [t for t in threading.enumerate() if t.name.startswith("connectivity:")]


@pytest.mark.timeout(120)
def test_a_503_on_the_first_client_config_is_retried_by_the_sdk_inside_the_wait(engine, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(reject_first=(parse_reject_first("client_config:503:1"),))
    with InProcessServer(engine, faults=faults) as srv:
        waiter = ServiceWaiter(WaitPolicy.from_options(service_timeout_s=60))
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        try:
            tc = sc.create_lora_training_client(base_model=BASE, rank=4)
            assert tc.sdk_client.model_id and srv.state.faults.injected["client_config:503"] == 1
            assert waiter.stopped is None and waiter.waits == 1  # the creation, its session setup inside
        finally:
            sc.release(30)


def setup_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sdk call: create_lora_training_client")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["create_session", "client_config", "client_dynamic_config"])
def test_a_session_setup_that_is_never_answered_stops_under_the_hang_window(engine, monkeypatch, kind):
    """The stop comes at the hang window. tinker 0.25 offers no way to cancel a session setup: its
    thread (a daemon) runs on inside the SDK's retries, holding the ServiceClient's setup lock. The
    stop and the release do not wait for it: nothing was created, so there is nothing to unload."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(latency_ms=(parse_latency(f"{kind}:{NEVER}"),))
    with InProcessServer(engine, faults=faults) as srv:
        waiter = ServiceWaiter(WaitPolicy.from_options(service_timeout_s=2))
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        t0 = time.monotonic()
        with pytest.raises(ServiceHang, match=r"create_lora_training_client on .*no answer for 2 s"):
            sc.create_lora_training_client(base_model=BASE, rank=4)
        assert time.monotonic() - t0 < 9 and waiter.stopped is not None
        t0 = time.monotonic()
        assert all(t.daemon for t in setup_threads())
        assert sc.release(5) == [] and sc.created == []
        assert time.monotonic() - t0 < 5

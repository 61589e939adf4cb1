"""The harness's clients against the embedded server (in this process): every client and future it
hands out waits under the policy; queue pauses reach the waiter through the SDK's own log lines and
a refused sample submit through the one confined SDK reach; what tinker 0.25 retries silently ends
as a hang in bounded time; SDK telemetry, which carries request headers after a 401, is off unless
asked for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import pytest
import tinker
from server_in_process import InProcessServer

from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.faults import (
    FaultConfig,
    parse_queue_pause,
    parse_reject_first,
    parse_reject_for,
)
from dppo_harness.local_server.profiles import make_profile
from dppo_harness.service.observed import create_from_state_with_response, make_service_client
from dppo_harness.service.secrets_scan import SecretScanner, live_secret_items
from dppo_harness.service.wait.policy import CapacityExhausted, ServiceHang, ServiceStopped, WaitPolicy
from dppo_harness.service.wait.waiter import ServiceWaiter, WaitedClient, WaitedFuture
from dppo_harness.service.wait.watch import SUBMIT_REFUSED_REASON

MODEL = "tiny-qwen3-random"  # protocol paths only: the random preset starts in seconds
BASE = "Qwen/Qwen3.5-2B"
PLANTED = {
    "TINKER_API_KEY": "tml-PLANTED-tel-51d0c8a3",
    "MODAL_PROXY_TOKEN_ID": "wk-PLANTED-tel-9e27b4f1",
    "MODAL_PROXY_TOKEN_SECRET": "ws-PLANTED-tel-3c8a6d05",
}
PROMPT = [248045, 846, 198]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("waits-run"), model_name=MODEL)


def _datum() -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(PROMPT),
        loss_fn_inputs={"target_tokens": [846, 198, 5], "weights": [1.0, 1.0, 1.0]},
    )


def test_every_client_and_future_the_harness_gets_is_waited(engine, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with InProcessServer(engine) as srv:
        waiter = ServiceWaiter(WaitPolicy.from_options(service_timeout_s=120))
        calls = []
        orig = waiter.wait
        waiter.wait = lambda f, **k: (calls.append(k["call"]), orig(f, **k))[1]
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        try:
            tc = sc.create_lora_training_client(base_model=BASE, rank=4)  # blocks in 0.25: run beside, waited
            assert isinstance(tc, WaitedClient) and isinstance(tc.sdk_client, tinker.TrainingClient)
            futures = {
                "forward": tc.forward([_datum()], "cross_entropy"),
                "forward_backward": tc.forward_backward([_datum()], "cross_entropy"),
                "optim_step": tc.optim_step(tinker.AdamParams(learning_rate=1e-3)),
                "save_state": tc.save_state("w0"),
                "save_weights_for_sampler": tc.save_weights_for_sampler("s0"),
            }
            assert all(isinstance(f, WaitedFuture) for f in futures.values())
            assert all(futures[k].result() is not None for k in ("forward", "forward_backward", "optim_step"))
            path = futures["save_state"].result().path
            sampler = tc.create_sampling_client(futures["save_weights_for_sampler"].result().path)
            assert isinstance(sampler, WaitedClient) and sampler.label.startswith("sampler of ")
            sample = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=2))
            assert isinstance(sample, WaitedFuture) and sample.result().sequences
            for made in (
                sc.create_training_client_from_state(path),
                sc.create_training_client_from_state_with_optimizer(path),
                sc.create_sampling_client(base_model=BASE),
            ):
                assert isinstance(made, WaitedClient)
            restored, response = create_from_state_with_response(sc, path, "dppo_seed0")
            assert isinstance(restored, WaitedClient) and restored.label == "dppo_seed0" and response.path == path
            assert isinstance(sc.create_rest_client(), WaitedClient)
            # 1 creation, 5 futures, the sampler made and its sample, 3 creations, the restore's REST
            # client, weights_info, creation and load, and the last REST client: each one wait; four
            # training clients (the first, two from state, the restore's; none of the SDK's steps)
            assert waiter.waits == 16 and waiter.stopped is None
            # the SDK's create-from-state calls back into the creation methods: its steps, not clients
            assert calls.count("create_training_client_from_state") == 1 and len(sc.created) == 4
        finally:
            sc.release(30)


@contextlib.contextmanager
def _waited_session(engine, faults, policy):
    """The embedded server in this process with `faults`, and a harness ServiceClient waited under
    `policy`: (waiter, service client), closed at the end."""
    with InProcessServer(engine, faults=faults) as srv:
        waiter = ServiceWaiter(policy)
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        try:
            yield waiter, sc
        finally:
            sc.release(30)


@pytest.mark.usefixtures("short_unload_drain")
def test_queue_pauses_and_hangs_reach_the_waiter_through_the_sdks_observers(engine, monkeypatch):
    """Each creation path and a training call, against the server's queue faults: the pause is
    seen with the server's own reason (in the line the SDK's observer logs), a hang is a hang."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(
        queue_pause=(
            parse_queue_pause("create_model:1:1.5"),
            parse_queue_pause("load_weights:1:1.5"),
            parse_queue_pause("optim_step:1:forever"),
            parse_queue_pause("save_weights:2:forever:active"),
        ),
    )
    with _waited_session(engine, faults, WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=60)) as (
        waiter,
        sc,
    ):
        tc = sc.create_lora_training_client(base_model=BASE, rank=4)
        t0 = time.monotonic()
        with pytest.raises(CapacityExhausted) as cap:
            tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        assert 3 <= time.monotonic() - t0 < 10
        assert cap.value.block.error == (
            "embedded server fault: no capacity for optim_step request 1; paused until further notice"
        )
        pauses = [p.as_dict() for p in waiter.pauses]
        assert pauses[0]["call"] == "create_lora_training_client" and pauses[0]["outcome"] == "resumed"
        assert pauses[0]["queue_state_reason"].endswith("paused for 1.5 s")
        assert pauses[-1]["call"] == "optim_step" and pauses[-1]["outcome"] == "gave_up"
    with _waited_session(engine, faults, WaitPolicy.from_options(capacity_patience_s=30, service_timeout_s=60)) as (
        waiter,
        sc,
    ):
        tc = sc.create_lora_training_client(base_model=BASE, rank=4)
        path = tc.save_state("w0").result().path
        restored, response = create_from_state_with_response(sc, path, "dppo_seed0")
        # the load on the fresh client paused: its client's observer logged it, the load's wait saw it
        assert response.path == path and [p.call for p in waiter.pauses][-1] == "load_state_with_optimizer"
        waiter.policy = WaitPolicy.from_options(service_timeout_s=2)
        t0 = time.monotonic()
        with pytest.raises(ServiceHang, match="save_state on dppo_seed0: no answer for 2 s"):
            restored.save_state("never").result()
        assert 2 <= time.monotonic() - t0 < 8


def _telemetry_bodies(engine, sdk_telemetry: bool) -> list[bytes]:
    """A harness client on a spindle-profile server whose credentials stop being accepted (401 on
    the first poll): the telemetry request bodies the server received by the client's close."""
    faults = FaultConfig(reject_first=(parse_reject_first("retrieve_future:401:1"),))
    with InProcessServer(engine, faults=faults, profile=make_profile("spindle", PLANTED)) as srv:
        sc = make_service_client("tinker", srv.base_url, env=PLANTED, sdk_telemetry=sdk_telemetry)
        with pytest.raises(ValueError, match="status 401"):
            sc.create_lora_training_client(base_model=BASE, rank=4)
        sc.release(30)  # ends the session's holder, which stops (and flushes) the SDK's telemetry
        return list(srv.state.telemetry_bodies)


CF_ACCESS = {
    "CLOUDFLARE_ACCESS_CLIENT_ID": "cf-PLANTED-id-7f3a91c2",
    "CLOUDFLARE_ACCESS_CLIENT_SECRET": "cf-PLANTED-sec-0b64e8d5",
}


def test_sdk_telemetry_is_off_by_default_so_no_credential_reaches_it(engine, monkeypatch):
    # The SDK adds CF-Access-Client-Id/-Secret from these to every request: the scan must know them.
    for name, value in CF_ACCESS.items():
        monkeypatch.setenv(name, value)
    scanner = SecretScanner(live_secret_items({**PLANTED, **CF_ACCESS}))
    monkeypatch.setenv("TINKER_TELEMETRY", "1")  # restored after the test; the harness overrides it
    # Opted in, the SDK posts the 401's request headers: the credentials, verbatim.
    opted_in = _telemetry_bodies(engine, sdk_telemetry=True)
    leaks = {m.label for body in opted_in for m in scanner.find(body)}
    assert opted_in and leaks == set(PLANTED) | set(CF_ACCESS), leaks
    # The harness's default: no telemetry post at all, so no credential in any telemetry body.
    default = _telemetry_bodies(engine, sdk_telemetry=False)
    assert default == [] and not [m for body in default for m in scanner.find(body)]


@pytest.mark.usefixtures("short_unload_drain")
@pytest.mark.timeout(90)
def test_a_queue_position_that_moves_every_poll_is_one_pause_given_up_in_time(engine, monkeypatch):
    """The server rewords the pause at every poll (a queue position): one pause, with the service's
    words as the SDK logged them, and the call still gives up when the patience window closes."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(queue_pause=(parse_queue_pause("optim_step:1:forever:moving"),))
    with _waited_session(engine, faults, WaitPolicy.from_options(capacity_patience_s=4, service_timeout_s=60)) as (
        waiter,
        sc,
    ):
        tc = sc.create_lora_training_client(base_model=BASE, rank=4)
        t0 = time.monotonic()
        step = tc.optim_step(tinker.AdamParams(learning_rate=1e-3))
        with pytest.raises(CapacityExhausted) as cap:
            step.result()
        assert 4 <= time.monotonic() - t0 < 12
        # the stop cancelled the SDK's wait: nothing polls on for a stopped run
        assert waiter.evidence()["stopped"]["futures_cancelled"] == 1
        with pytest.raises(concurrent.futures.CancelledError):  # the SDK's own wait ended with it
            step.future().result(5)
        assert "; queue position " in cap.value.block.error  # the service's latest words
        (pause,) = [p.as_dict() for p in waiter.pauses if p.call == "optim_step"]
        assert pause["outcome"] == "gave_up"


def _creation_stop(engine, faults, policy):
    with InProcessServer(engine, faults=faults) as srv:
        waiter = ServiceWaiter(policy)
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        t0 = time.monotonic()
        try:
            with pytest.raises(ServiceStopped) as ei:
                sc.create_lora_training_client(base_model=BASE, rank=4)
        finally:
            sc.release(5)  # nothing was created; the session's heartbeat ends
        return ei.value, time.monotonic() - t0, waiter.evidence()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("status", [402, 429, 503])
def test_refused_polls_of_a_creation_end_as_a_capacity_wait_within_the_patience(engine, monkeypatch, status):
    """tinker 0.25 re-polls a 402 (billing: for up to an hour), a 429 and a 503 without a word to
    anyone: a creation whose session is set up sees no pause and no answer, as on a Spindle placing
    its model, so it ends at --capacity-patience-s with what was observed, not after the SDK's hour;
    what the service said is not seen (docs/service.md)."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(reject_for=(parse_reject_for(f"retrieve_future:{status}:600"),))
    stop, secs, block = _creation_stop(
        engine, faults, WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=30)
    )
    assert isinstance(stop, CapacityExhausted) and 3 <= secs < 20, (type(stop), secs)
    assert stop.block.error.startswith(
        "create_lora_training_client on a new LoRA client on Qwen/Qwen3.5-2B: pending for 3 s, no answer"
    )
    assert block["stopped"]["kind"] == "capacity"


@pytest.mark.timeout(90)
def test_refused_polls_of_an_operation_end_as_a_hang_within_the_timeout(engine, monkeypatch):
    """The same silent re-polls on an operation (not a creation): no pause, no answer, a hang at
    --service-timeout-s."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(reject_for=(parse_reject_for("optim_step:503:600"),))
    with InProcessServer(engine, faults=faults) as srv:
        waiter = ServiceWaiter(WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=4))
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        try:
            tc = sc.create_lora_training_client(base_model=BASE, rank=4)
            t0 = time.monotonic()
            with pytest.raises(ServiceHang) as ei:
                tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
            assert 4 <= time.monotonic() - t0 < 20
        finally:
            sc.release(5)
    assert ei.value.line.startswith("optim_step on ") and "no answer for 4 s" in ei.value.line


@pytest.mark.timeout(90)
def test_a_refused_sample_submit_is_a_capacity_stop_not_a_hang(engine, monkeypatch):
    """Every sample submit answered 429: the SDK backs off and resubmits without limit, silently; the
    confined reach sees its backoff, so the wait ends as capacity at the patience window."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(reject_for=(parse_reject_for("asample:429:600"),))
    policy = WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=60)
    with _waited_session(engine, faults, policy) as (waiter, sc):
        sampler = sc.create_sampling_client(base_model=BASE)
        t0 = time.monotonic()
        with pytest.raises(CapacityExhausted) as cap:
            sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=2)).result()
        assert 3 <= time.monotonic() - t0 < 15
        assert cap.value.block.error == SUBMIT_REFUSED_REASON
        (pause,) = [p.as_dict() for p in waiter.pauses]
        assert pause["queue_state"] == "submit_refused" and pause["outcome"] == "gave_up"

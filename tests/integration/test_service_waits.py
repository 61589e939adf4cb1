"""The harness's clients against the embedded server (in this process): every client and future it
hands out waits under the policy; queue pauses reach the waiter through the SDK's own observers;
SDK telemetry, which carries request headers after a 401, is off unless asked for.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import tinker

from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.faults import (
    FaultConfig,
    parse_never_complete,
    parse_queue_pause,
    parse_reject_first,
    parse_reject_for,
)
from dppo_harness.local_server.process import InProcessServer
from dppo_harness.local_server.profiles import make_profile
from dppo_harness.service.observed import create_from_state_with_response, make_service_client
from dppo_harness.service.secrets_scan import SecretScanner, live_secret_items
from dppo_harness.service.wait.clients import WaitedClient, WaitedFuture
from dppo_harness.service.wait.policy import (
    CapacityExhausted,
    NoQueueState,
    PaymentRequired,
    ServiceHang,
    ServiceStopped,
    WaitPolicy,
)
from dppo_harness.service.wait.waiter import ServiceWaiter

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
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        try:
            made = sc.create_lora_training_client(base_model=BASE, rank=4)
            assert isinstance(made, WaitedFuture)
            tc = made.result()
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
            sampler = tc.create_sampling_client(futures["save_weights_for_sampler"].result().path).result()
            assert isinstance(sampler, WaitedClient) and sampler.label.startswith("sampler of ")
            sample = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=2))
            assert isinstance(sample, WaitedFuture) and sample.result().sequences
            for fut in (
                sc.create_training_client_from_state(path),
                sc.create_training_client_from_state_with_optimizer(path),
                sc.create_sampling_client(base_model=BASE),
            ):
                assert isinstance(fut, WaitedFuture) and isinstance(fut.result(), WaitedClient)
            restored, response = create_from_state_with_response(sc, path, "dppo_seed0")
            assert isinstance(restored, WaitedClient) and restored.label == "dppo_seed0" and response.path == path
            assert isinstance(sc.create_rest_client(), WaitedClient)
            assert waiter.waits == 14 and waiter.stopped is None  # 12 calls and two holders set up (session, REST)
        finally:
            sc.close("success").result(30)


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
            sc.close("success").result(30)


def test_queue_pauses_and_hangs_reach_the_waiter_through_the_sdks_observers(engine, monkeypatch):
    """Each creation path and a training call, against the server's queue faults: the pause is
    seen with the server's own reason (through the SDK's observer), a hang is a hang."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(
        queue_pause=(
            parse_queue_pause("create_model:1:1.5"),
            parse_queue_pause("load_weights:1:1.5"),
            parse_queue_pause("optim_step:1:forever"),
        ),
        never_complete=(parse_never_complete("save_weights:2"),),
    )
    with _waited_session(engine, faults, WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=60)) as (
        waiter,
        sc,
    ):
        tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
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
        tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
        path = tc.save_state("w0").result().path
        restored, response = create_from_state_with_response(sc, path, "dppo_seed0")
        assert response.path == path and [p.call for p in waiter.pauses][-1] == (
            "create_training_client_from_state_with_optimizer"
        )  # the load's own observer saw its pause
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
            sc.create_lora_training_client(base_model=BASE, rank=4).result()
        sc.close("errored").result(30)  # the SDK flushes its telemetry on close
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


@pytest.mark.timeout(90)
def test_a_queue_position_that_moves_every_poll_is_one_pause_given_up_in_time(engine, monkeypatch):
    """The server rewords the pause at every poll (a queue position): the SDK reports each text to
    the observer, and the call still gives up when the patience window closes."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(queue_pause=(parse_queue_pause("optim_step:1:forever:moving"),))
    with _waited_session(engine, faults, WaitPolicy.from_options(capacity_patience_s=4, service_timeout_s=60)) as (
        waiter,
        sc,
    ):
        tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
        t0 = time.monotonic()
        step = tc.optim_step(tinker.AdamParams(learning_rate=1e-3))
        with pytest.raises(CapacityExhausted) as cap:
            step.result()
        assert 4 <= time.monotonic() - t0 < 12
        # the stop cancelled the SDK's wait: nothing polls on for a stopped run
        assert step.future().cancelled() and waiter.evidence()["stopped"]["futures_cancelled"] == 1
        assert "; queue position " in cap.value.block.error  # the service's latest words
        (pause,) = [p.as_dict() for p in waiter.pauses if p.call == "optim_step"]
        assert pause["outcome"] == "gave_up" and pause["reason_changes"] >= 2


def _creation_stop(engine, faults, policy):
    with InProcessServer(engine, faults=faults) as srv:
        waiter = ServiceWaiter(policy)
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        t0 = time.monotonic()
        try:
            with pytest.raises(ServiceStopped) as ei:
                sc.create_lora_training_client(base_model=BASE, rank=4).result()
        finally:
            sc.close("errored")  # not waited: the stop already ended the run
        return ei.value, time.monotonic() - t0, waiter.evidence()


@pytest.mark.timeout(90)
def test_a_402_on_polls_is_its_own_stop_with_the_services_text(engine, monkeypatch):
    """The SDK sleeps and re-polls a 402 for up to an hour without telling its observer."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(reject_for=(parse_reject_for("retrieve_future:402:600"),))
    stop, secs, block = _creation_stop(
        engine, faults, WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=60)
    )
    assert isinstance(stop, PaymentRequired) and 3 <= secs < 15, (type(stop), secs)
    assert "HTTP 402" in stop.line and "retrieve_future refused for 600 s" in stop.line
    assert block["stopped"]["kind"] == "payment_required" and block["stopped"]["http_status"] == 402
    assert "injected 402" in block["stopped"]["error"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("status", [429, 503])
def test_refused_polls_end_within_their_window_citing_the_service(engine, monkeypatch, status):
    """429 on polls: backed off without limit by the SDK, so a capacity stop after the patience
    window; 503: re-polled without limit, so a hang after the timeout, citing the last answer."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(reject_for=(parse_reject_for(f"retrieve_future:{status}:600"),))
    stop, secs, block = _creation_stop(
        engine, faults, WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=4)
    )
    assert secs < 20, secs
    if status == 429:
        assert isinstance(stop, CapacityExhausted) and stop.block.error.startswith("HTTP 429 on polls: ")
    else:
        assert isinstance(stop, ServiceHang) and "the service's last answer: HTTP 503: " in stop.line
        assert block["stopped"]["http_status"] == 503 and "injected 503" in block["stopped"]["error"]


def _session_poller_sample(engine, faults, policy):
    """One sample that completes, then one that may not, from a sampling client on the SDK's session
    poller (the service's config says sample_use_retrieve_futures): (stop or None, seconds, waiter
    evidence)."""
    with InProcessServer(engine, faults=faults) as srv:
        waiter = ServiceWaiter(policy)
        sc = make_service_client("local", srv.base_url, waiter=waiter)
        try:
            sampler = sc.create_sampling_client(base_model=BASE).result()
            assert sampler.sdk_client.holder.get_client_config().sample_use_retrieve_futures
            params = tinker.SamplingParams(max_tokens=2)
            assert sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, params).result().sequences
            assert srv.state.faults.snapshot()["requests"].get("retrieve_futures", 0) >= 1  # the poller path
            t0, stop = time.monotonic(), None
            try:
                sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, params).result()
            except ServiceStopped as exc:
                stop = exc
            return stop, time.monotonic() - t0, waiter.evidence()
        finally:
            sc.close("errored")


@pytest.mark.timeout(90)
def test_a_sample_on_the_session_poller_that_never_completes_says_no_queue_state_was_sent(engine, monkeypatch):
    """The session poller never calls the queue-state observer: a sample that never completes is
    stopped at the timeout as a wait whose queue the service never reported (its polls answered),
    not as a hang of a silent service and not after the SDK's own 900 s."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(sample_use_retrieve_futures=True, never_complete=(parse_never_complete("asample:2"),))
    stop, secs, block = _session_poller_sample(
        engine, faults, WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=8)
    )
    assert isinstance(stop, NoQueueState) and 8 <= secs < 16, (type(stop), secs)
    assert stop.polls >= 1 and "retrieve_futures" in stop.line and "sample on sampler of" in stop.line
    assert block["stopped"]["kind"] == "no_queue_state" and block["stopped"]["session_polls_answered"] == stop.polls
    assert block["stopped"]["futures_cancelled"] == 1


@pytest.mark.timeout(90)
def test_a_short_pause_on_the_session_poller_is_waited_out(engine, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(sample_use_retrieve_futures=True, queue_pause=(parse_queue_pause("asample:2:2"),))
    stop, secs, block = _session_poller_sample(
        engine, faults, WaitPolicy.from_options(capacity_patience_s=30, service_timeout_s=30)
    )
    assert stop is None and 2 <= secs < 10 and block.get("stopped") is None


@pytest.mark.timeout(90)
def test_a_402_on_session_polls_is_the_payment_stop_with_the_services_text(engine, monkeypatch):
    """The session poller sleeps and re-polls a 402 silently; the harness's tap sees the refusal."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    faults = FaultConfig(sample_use_retrieve_futures=True, reject_for=(parse_reject_for("retrieve_futures:402:600"),))
    with _waited_session(engine, faults, WaitPolicy.from_options(capacity_patience_s=3, service_timeout_s=60)) as (
        waiter,
        sc,
    ):
        sampler = sc.create_sampling_client(base_model=BASE).result()
        t0 = time.monotonic()
        with pytest.raises(PaymentRequired) as ei:
            sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=2)).result()
        assert 3 <= time.monotonic() - t0 < 15
        assert "HTTP 402" in ei.value.line and "retrieve_futures refused for 600 s" in ei.value.line
        assert waiter.evidence()["stopped"]["http_status"] == 402

"""Service layer: client factory from env, capacity retry with a fake clock, client release."""

import httpx
import pytest
import tinker

from dppo_harness import constants
from dppo_harness.evidence import EvidenceBundle
from dppo_harness.service.config import client_kwargs
from dppo_harness.service.observed import ClientRegistry, make_service_client
from dppo_harness.service.secrets_scan import live_secret_items
from dppo_harness.service.wait.policy import (
    CapacityExhausted,
    CapacityTracker,
    ServiceConfigError,
    WaitPolicy,
    call_with_capacity_retry,
    is_capacity_error,
)

FAKE_ENV = {
    "TINKER_BASE_URL": "https://spindle.example.invalid/api",
    "TINKER_API_KEY": "tml-FAKE-api-key-0001",
    "MODAL_PROXY_TOKEN_ID": "wk-FAKE-token-id-0002",
    "MODAL_PROXY_TOKEN_SECRET": "ws-FAKE-token-secret-0003",
    "RUNS_PROXY_TOKEN_ID": "wk-FAKE-runs-id-0004",
    "RUNS_PROXY_TOKEN_SECRET": "ws-FAKE-runs-secret-0005",
}


def _status_error(cls, code: int, text: str):
    req = httpx.Request("POST", "http://127.0.0.1:1/api/v1/create_model")
    return cls(text, response=httpx.Response(code, request=req), body=None)


def test_tinker_client_uses_env_and_modal_headers():
    kw = client_kwargs("tinker", env=FAKE_ENV)
    assert kw["base_url"] == FAKE_ENV["TINKER_BASE_URL"] and kw["api_key"] == FAKE_ENV["TINKER_API_KEY"]
    key = {"X-API-Key": FAKE_ENV["TINKER_API_KEY"]}
    assert kw["default_headers"] == {
        **key,
        "Modal-Key": FAKE_ENV["MODAL_PROXY_TOKEN_ID"],
        "Modal-Secret": FAKE_ENV["MODAL_PROXY_TOKEN_SECRET"],
    }
    fork = client_kwargs("tinker", env=FAKE_ENV, proxy_tokens="runs")["default_headers"]
    assert fork == {
        **key,
        "Modal-Key": FAKE_ENV["RUNS_PROXY_TOKEN_ID"],
        "Modal-Secret": FAKE_ENV["RUNS_PROXY_TOKEN_SECRET"],
    }
    assert client_kwargs("tinker", env=FAKE_ENV, proxy_tokens="none")["default_headers"] == key
    client = make_service_client("tinker", env=FAKE_ENV)
    assert isinstance(client, tinker.ServiceClient)
    assert client.release(5.0) == []  # lazy client: nothing was created, nothing to unload


def test_modal_headers_are_sent_only_when_set():
    env = {k: v for k, v in FAKE_ENV.items() if not k.startswith("MODAL_")}
    assert client_kwargs("tinker", env=env)["default_headers"] == {"X-API-Key": env["TINKER_API_KEY"]}
    assert {"Modal-Key", "Modal-Secret"} <= set(client_kwargs("tinker", env=FAKE_ENV)["default_headers"])
    with pytest.raises(ServiceConfigError, match="RUNS_PROXY_TOKEN_ID"):  # the fork's tokens: asked for, required
        client_kwargs(
            "tinker", env={k: v for k, v in FAKE_ENV.items() if not k.startswith("RUNS_")}, proxy_tokens="runs"
        )


@pytest.mark.parametrize(
    "missing, proxy",
    [
        ("TINKER_BASE_URL", "modal"),
        ("TINKER_API_KEY", "modal"),
        ("MODAL_PROXY_TOKEN_ID", "modal"),
        ("MODAL_PROXY_TOKEN_SECRET", "modal"),
        ("RUNS_PROXY_TOKEN_SECRET", "runs"),
    ],
)
def test_missing_variable_named_without_values(missing, proxy):
    env = {k: v for k, v in FAKE_ENV.items() if k != missing}
    with pytest.raises(ServiceConfigError) as e:
        make_service_client("tinker", env=env, proxy_tokens=proxy)
    msg = str(e.value)
    assert missing in msg
    assert not any(v in msg for v in FAKE_ENV.values())
    empty = dict(FAKE_ENV, **{missing: ""})  # set but empty counts as missing
    with pytest.raises(ServiceConfigError, match=missing):
        make_service_client("tinker", env=empty, proxy_tokens=proxy)


def test_local_backend_needs_no_env_and_loopback_only():
    kw = client_kwargs("local", "http://127.0.0.1:8123", env={})
    # the key header too: tinker 0.25 would otherwise send TINKER_API_KEY from the environment
    assert kw == {
        "base_url": "http://127.0.0.1:8123",
        "api_key": constants.LOCAL_API_KEY,
        "default_headers": {"X-API-Key": constants.LOCAL_API_KEY},
    }
    assert isinstance(make_service_client("local", "http://localhost:9", env={}), tinker.ServiceClient)
    with pytest.raises(ServiceConfigError, match="loopback"):
        client_kwargs("local", "http://10.0.0.5:8000", env={})
    with pytest.raises(ServiceConfigError, match="base_url"):
        client_kwargs("local", None, env={})
    with pytest.raises(ServiceConfigError, match="unknown backend"):
        client_kwargs("spindle", env=FAKE_ENV)


def test_live_secret_values_from_env():
    values = [v for _, v in live_secret_items(FAKE_ENV)]
    assert sorted(values) == sorted(v for k, v in FAKE_ENV.items() if k != "TINKER_BASE_URL")
    assert live_secret_items({"TINKER_API_KEY": ""}) == []


def test_capacity_error_classification():
    assert is_capacity_error(_status_error(tinker.RateLimitError, 429, "Too Many Requests"))
    assert is_capacity_error(_status_error(tinker.InternalServerError, 503, "Service Unavailable"))
    assert not is_capacity_error(_status_error(tinker.InternalServerError, 500, "boom"))
    assert not is_capacity_error(_status_error(tinker.BadRequestError, 400, "bad optimizer"))
    assert is_capacity_error(tinker.RequestFailedError("trainer capacity exhausted", "req-1", "server"))
    assert not is_capacity_error(tinker.RequestFailedError("shape mismatch", "req-2", "user"))
    assert not is_capacity_error(ValueError("nope"))
    # A status code inside a failed future's message counts; the same digits inside a name do not.
    assert is_capacity_error(tinker.RequestFailedError("HTTP 503 from the trainer pool", "req-3", "server"))
    assert is_capacity_error(tinker.RequestFailedError("status 429: slow down", "req-4", "server"))
    for name in ("'20261202T004503Z-731a34-initial-shared-seed0'", "'run-429'", '"ckpt 503"'):
        assert not is_capacity_error(
            tinker.RequestFailedError(
                f"checkpoint {name} already exists; pass overwrite=True to replace it", "req-5", "user"
            )
        ), name
    assert not is_capacity_error(tinker.RequestFailedError("model tiny-429b not found", "req-6", "user"))


class FakeClock:
    def __init__(self):
        self.t = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


class FakeClient:
    """A session whose release unloads one model; `fail`: the service refuses the unload."""

    def __init__(self, fail: bool = False):
        self.released = 0
        self.fail = fail

    def release(self, timeout_s):
        from dppo_harness.service.rest import UnloadOutcome

        self.released += 1
        if self.fail:
            return [UnloadOutcome("m-1", False, "unload_model answered HTTP 409: conflict; unload refused", 0.1)]
        return [UnloadOutcome("m-1", True, "{'type': 'unload_model', 'model_id': 'm-1'}", 0.1)]


def _storm(error):
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        raise error

    return fn, calls


def test_capacity_storm_before_any_step_gives_up_after_ten_minutes(tmp_path):
    clock, reg = FakeClock(), ClientRegistry()
    real = make_service_client("local", "http://127.0.0.1:9", env={}, registry=reg, stage="preflight")
    fake = reg.register(FakeClient(), stage="preflight", label="probe")
    # As the SDK raises it for a failed future; the block keeps the service's own text.
    err = tinker.RequestFailedError(
        "Request failed: trainer capacity exhausted: 0 of 8 trainers free for self.request_id='req-9' "
        "and expected type self.model_cls=<class 'CreateModelResponse'>",
        "req-9",
        "server",
    )
    fn, calls = _storm(err)
    with pytest.raises(CapacityExhausted) as e:
        call_with_capacity_retry(
            fn, policy=WaitPolicy(), steps_completed=0, registry=reg, clock=clock, sleep=clock.sleep
        )
    assert clock.sleeps == [60.0, 120.0, 240.0, 180.0]  # 1, 2, 4 min, then up to the 10-minute mark
    assert calls["n"] == 5
    block = e.value.block
    assert block.as_dict() == {
        "error": "trainer capacity exhausted: 0 of 8 trainers free",
        "comparison_steps_completed": 0,
        "released_clients": True,
    }
    assert fake.released == 1 and reg.all_released and real.release(1.0) == []
    bundle = EvidenceBundle.create(tmp_path, "storm", env={})
    bundle.update_result(
        **block.result_fields(),
        original_hypothesis_tested=False,
        tested_instead="nothing: capacity refused before the first step",
        summary="Spindle refused capacity for 10 minutes before any step.",
    )
    r = bundle.result
    assert (r["status"], r["verdict"], r["outcome_reason"]) == ("failed", "inconclusive", "incomplete_execution")
    assert r["capacity_block"]["released_clients"] is True


def test_capacity_storm_after_steps_keeps_trying_for_thirty_minutes():
    clock, tracker = FakeClock(), CapacityTracker()
    for _ in range(3):
        tracker.step_done()
    fn, _ = _storm(_status_error(tinker.RateLimitError, 429, "rate limited"))
    reg = ClientRegistry()
    reg.register(FakeClient(fail=True), stage="diagnostic", label="trainer")
    with pytest.raises(CapacityExhausted) as e:
        call_with_capacity_retry(fn, steps_completed=tracker, registry=reg, clock=clock, sleep=clock.sleep)
    assert sum(clock.sleeps) == pytest.approx(1800.0)
    assert max(clock.sleeps) == 240.0
    assert e.value.block.comparison_steps_completed == 3
    assert e.value.block.released_clients is False  # the unload was refused: reported truthfully
    assert "unload refused" in reg.records()[0]["error"]


def test_capacity_retry_recovers_and_scales():
    clock = FakeClock()
    outcomes = [_status_error(tinker.InternalServerError, 503, "busy")] * 2

    def fn():
        if outcomes:
            raise outcomes.pop()
        return "ok"

    assert (
        call_with_capacity_retry(
            fn,
            policy=WaitPolicy.from_options(backend="local", env={}),
            clock=clock,
            sleep=clock.sleep,
        )
        == "ok"
    )
    assert clock.sleeps == pytest.approx([0.6, 1.2])  # one backoff per refused attempt


def test_non_capacity_error_is_not_retried():
    clock = FakeClock()
    fn, calls = _storm(_status_error(tinker.BadRequestError, 400, "unsupported optimizer"))
    with pytest.raises(tinker.BadRequestError):
        call_with_capacity_retry(fn, clock=clock, sleep=clock.sleep)
    assert calls["n"] == 1 and clock.sleeps == []


def test_registry_releases_per_stage():
    reg = ClientRegistry()
    a = reg.register(FakeClient(), stage="preflight", label="probe")
    b = reg.register(FakeClient(), stage="diagnostic", label="trainer")
    recs = reg.release_stage("preflight")
    assert [{k: r[k] for k in ("label", "stage", "released", "error")} for r in recs] == [
        {"label": "probe", "stage": "preflight", "released": True, "error": None}
    ]
    assert recs[0]["released_at"] and recs[0]["training_clients"] == []
    assert a.released == 1 and b.released == 0 and not reg.all_released
    assert reg.release_all("interrupted") and (a.released, b.released) == (1, 1)  # each released once


def test_sdk_internal_retry_time_counts_toward_the_window():
    clock = FakeClock()

    def fn():  # the SDK retried 429/503 itself for 5 minutes before raising
        clock.t += 300.0
        raise _status_error(tinker.InternalServerError, 503, "Service Unavailable")

    with pytest.raises(CapacityExhausted) as e:
        call_with_capacity_retry(fn, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == [60.0] and e.value.attempts == 2
    assert e.value.block.error == "Service Unavailable" and e.value.block.released_clients is False


def test_capacity_policy_scale_from_env():
    from dppo_harness.service.wait.policy import CAPACITY_SCALE_VAR

    assert WaitPolicy.from_options(env={}).backoff_s == WaitPolicy().backoff_s
    p = WaitPolicy.from_options(env={CAPACITY_SCALE_VAR: "0.01"})
    assert (
        p.backoff(0) == pytest.approx(0.6)
        and p.capacity_window(0) == pytest.approx(6.0)
        and p.capacity_window(1) == pytest.approx(18.0)
    )
    for bad in ("0", "-1", "2", "fast"):
        with pytest.raises(ServiceConfigError, match=CAPACITY_SCALE_VAR):
            WaitPolicy.from_options(env={CAPACITY_SCALE_VAR: bad})


def test_observed_service_client_reports_training_clients_without_breaking_them(monkeypatch):
    from dppo_harness.service.observed import ObservedServiceClient

    seen = []

    def boom(client, label, rest):
        seen.append((client, label))
        raise RuntimeError("recording failed")

    monkeypatch.setattr(tinker.ServiceClient, "create_lora_training_client", lambda self, *a, **k: "tc")
    sc = make_service_client("tinker", env=FAKE_ENV, observer=boom)
    assert isinstance(sc, ObservedServiceClient)
    assert sc.create_lora_training_client(base_model="Qwen/Qwen3.5-2B") == "tc"  # observer error swallowed
    assert seen == [("tc", "create_lora_training_client")]
    # without an observer too: every client the harness makes waits under the policy
    plain = make_service_client("tinker", env=FAKE_ENV)
    assert isinstance(plain, ObservedServiceClient) and plain.waiter is not None

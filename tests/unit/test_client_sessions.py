"""Client economy and honest release records (pure, no server): every ServiceClient session lists
the training clients it created (stage, SDK method, role), each release says which sessions it
closed and which stayed open, and training clients are counted per stage."""

from __future__ import annotations

import json

import tinker

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.pytest_plugin import session as plugin_session
from dppo_harness.service.observed import describe_client, make_service_client
from dppo_harness.service.release import ClientRegistry

FAKE_ENV = {
    "TINKER_BASE_URL": "http://127.0.0.1:9",
    "TINKER_API_KEY": "tml-fake",
    "MODAL_PROXY_TOKEN_ID": "wk-x",
    "MODAL_PROXY_TOKEN_SECRET": "ws-y",
}


class _Fut:
    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value


class _Training:
    def __init__(self, model_id):
        self.model_id = model_id


def _sessions(monkeypatch, reg):
    n = {"i": 0}

    def create(self, *a, **k):
        n["i"] += 1
        return _Fut(_Training(f"{id(self)}:train:{n['i']}"))

    monkeypatch.setattr(tinker.ServiceClient, "create_lora_training_client", create)
    monkeypatch.setattr(tinker.ServiceClient, "create_training_client_from_state_with_optimizer", create)
    closed = []
    monkeypatch.setattr(tinker.ServiceClient, "close", lambda self, status="success": closed.append(status))
    probes = make_service_client("tinker", env=FAKE_ENV, registry=reg, stage="preflight-probes", label="probes")
    session = make_service_client("tinker", env=FAKE_ENV, registry=reg, stage="session", label="arms")
    return probes, session, closed


def test_training_clients_are_listed_per_session_and_counted_per_stage(monkeypatch):
    reg = ClientRegistry()
    probes, session, _ = _sessions(monkeypatch, reg)
    reg.current_stage = "preflight"
    setup = probes.create_lora_training_client(base_model="m").result()
    describe_client(probes, setup, "setup: saves the initial checkpoint")
    probes.create_training_client_from_state_with_optimizer("p").result()
    arm = session.create_training_client_from_state_with_optimizer("p").result()
    describe_client(session, arm, "arm dppo_seed0")
    reg.current_stage = "gate"
    session.create_training_client_from_state_with_optimizer("p").result()
    assert reg.training_clients_by_stage() == {"preflight": 3, "gate": 1}
    recs = {r["label"]: r for r in reg.records()}
    assert [(c["stage"], c["method"], c["role"]) for c in recs["probes"]["training_clients"]] == [
        ("preflight", "create_lora_training_client", "setup: saves the initial checkpoint"),
        ("preflight", "create_training_client_from_state_with_optimizer", None),
    ]
    assert recs["arms"]["training_clients"][0]["model_id"] == arm.model_id


def test_each_release_says_what_it_closed_and_what_stays_open(monkeypatch, tmp_path):
    reg = ClientRegistry()
    probes, session, closed = _sessions(monkeypatch, reg)
    reg.current_stage = "preflight"
    probes.create_lora_training_client(base_model="m").result()
    session.create_training_client_from_state_with_optimizer("p").result()
    state = plugin_session.StageState(registry=reg, bundle=EvidenceBundle.create(tmp_path, "b", env={}))
    plugin_session.note_releases(state, reg.release_stage("preflight-probes"))  # before the arms train
    reg.current_stage = "diagnostic"
    plugin_session.release_remaining(state)  # session end
    plugin_session.write_session_records(state)
    rel = json.loads(state.bundle.file_path("client-releases.json").read_text())
    first, last = rel["events"]
    assert first["stage"] == "preflight" and first["closed"] == ["probes"]
    assert first["still_open"] == [{"label": "arms", "training_clients": 1}]  # the arms' session stays alive
    assert last["closed"] == ["arms"] and last["still_open"] == []
    assert [s["label"] for s in rel["sessions"]] == ["probes", "arms"] and all(s["released"] for s in rel["sessions"])
    assert rel["training_clients_by_stage"] == {"preflight": 2} and rel["training_clients_total"] == 2
    assert "no per-client release" in rel["note"] and closed == ["success", "success"]


def test_stage_end_posts_the_training_clients_it_created(monkeypatch, tmp_path):
    reg = ClientRegistry()
    probes, _session, _ = _sessions(monkeypatch, reg)
    bundle = EvidenceBundle.create(tmp_path, "b", env={})
    state = plugin_session.StageState(registry=reg, bundle=bundle)
    plugin_session.enter_stage(state, "preflight")
    probes.create_lora_training_client(base_model="m").result()
    probes.create_lora_training_client(base_model="m").result()
    plugin_session.enter_stage(state, "diagnostic")  # closes the preflight stage
    plugin_session.enter_stage(state, "report")
    metrics = bundle.result["metrics"]
    assert metrics["clients/training_created/preflight"] == 2.0
    assert metrics["clients/training_created/diagnostic"] == 0.0


def test_a_failed_close_is_never_recorded_as_released_by_a_later_one():
    """The SDK's second close() returns a completed future whatever became of the first: the
    registry judges by the first close's own future and never sends a second."""
    import concurrent.futures

    class Session:
        def __init__(self):
            self.closes = 0

        def close(self, status):
            self.closes += 1
            f = concurrent.futures.Future()
            if self.closes == 1:
                f.set_exception(RuntimeError("session finish refused: 503"))
            else:
                f.set_result(None)
            return f

    reg = ClientRegistry()
    s = Session()
    reg.register(s, stage="session", label="arms")
    assert reg.release_all("errored") is False
    assert reg.release_all("errored") is False and s.closes == 1
    (record,) = reg.records()
    assert record["released"] is False and "session finish refused: 503" in record["error"]
    assert not reg.all_released


def test_after_the_service_died_a_release_closes_nothing_and_returns_at_once():
    """A dead server has no session left to finish: each close would wait out the release timeout
    (60 s a session), so the end of a run whose embedded server was killed took minutes."""
    import concurrent.futures
    import time

    class Session:
        closes = 0

        def close(self, status):
            Session.closes += 1
            return concurrent.futures.Future()  # never answered: the server is gone

    reg = ClientRegistry(release_timeout_s=30.0)
    for label in ("arms", "sampler"):
        reg.register(Session(), stage="diagnostic", label=label)
    reg.service_gone("the embedded server (pid 1) exited (exit code -9)")
    t0 = time.monotonic()
    assert reg.release_stage("diagnostic", "errored") and reg.release_all("errored") is False
    assert time.monotonic() - t0 < 10 and Session.closes == 0  # far under one 30 s close, on a loaded machine
    for record in reg.records():
        assert record["released"] is False and record["error"] == (
            "not closed: the embedded server (pid 1) exited (exit code -9); nothing is left to close"
        )

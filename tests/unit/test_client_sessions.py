"""Client economy and honest release records (pure, no server): every ServiceClient session lists
the training clients it created (stage, SDK method, role), each release says which sessions it
closed and which stayed open, and training clients are counted per stage."""

from __future__ import annotations

import json

import tinker

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.pytest_plugin import hooks as plugin_session
from dppo_harness.service.observed import ClientRegistry, describe_client, make_service_client
from dppo_harness.service.rest import ServiceRest, UnloadOutcome

FAKE_ENV = {
    "TINKER_BASE_URL": "http://127.0.0.1:9",
    "TINKER_API_KEY": "tml-fake",
    "MODAL_PROXY_TOKEN_ID": "wk-x",
    "MODAL_PROXY_TOKEN_SECRET": "ws-y",
}


class _Training:
    def __init__(self, model_id):
        self.model_id = model_id


def _sessions(monkeypatch, reg):
    n = {"i": 0}

    def create(self, *a, **k):  # tinker 0.25's creation methods block and return the client
        n["i"] += 1
        return _Training(f"{id(self)}:train:{n['i']}")

    monkeypatch.setattr(tinker.ServiceClient, "create_lora_training_client", create)
    monkeypatch.setattr(tinker.ServiceClient, "create_training_client_from_state_with_optimizer", create)
    closed = []  # the models unloaded, in order

    def unload(rest, model_id, timeout_s):
        closed.append(model_id)
        return UnloadOutcome(model_id, True, f"{{'type': 'unload_model', 'model_id': '{model_id}'}}", 0.01)

    monkeypatch.setattr(ServiceRest, "unload", unload)
    probes = make_service_client("tinker", env=FAKE_ENV, registry=reg, stage="preflight-probes", label="probes")
    session = make_service_client("tinker", env=FAKE_ENV, registry=reg, stage="session", label="arms")
    return probes, session, closed


def test_training_clients_are_listed_per_session_and_counted_per_stage(monkeypatch):
    reg = ClientRegistry()
    probes, session, _ = _sessions(monkeypatch, reg)
    reg.current_stage = "preflight"
    setup = probes.create_lora_training_client(base_model="m")
    describe_client(probes, setup, "setup: saves the initial checkpoint")
    probes.create_training_client_from_state_with_optimizer("p")
    arm = session.create_training_client_from_state_with_optimizer("p")
    describe_client(session, arm, "arm dppo_seed0")
    reg.current_stage = "gate"
    session.create_training_client_from_state_with_optimizer("p")
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
    probes.create_lora_training_client(base_model="m")
    session.create_training_client_from_state_with_optimizer("p")
    state = plugin_session.StageState(registry=reg, bundle=EvidenceBundle.create(tmp_path, "b", env={}))
    reg.release_stage("preflight-probes")  # before the arms train
    reg.current_stage = "diagnostic"
    reg.release_remaining()  # session end
    plugin_session.write_session_records(state)
    rel = json.loads(state.bundle.file_path("client-releases.json").read_text())
    first, last = rel["events"]
    assert first["stage"] == "preflight" and first["closed"] == ["probes"]
    assert first["still_open"] == [{"label": "arms", "training_clients": 1}]  # the arms' session stays alive
    assert last["closed"] == ["arms"] and last["still_open"] == []
    assert [s["label"] for s in rel["sessions"]] == ["probes", "arms"] and all(s["released"] for s in rel["sessions"])
    assert rel["training_clients_by_stage"] == {"preflight": 2} and rel["training_clients_total"] == 2
    assert "no session finish" in rel["note"] and len(closed) == 2  # each model unloaded once
    releases = [c["release"] for sess in rel["sessions"] for c in sess["training_clients"]]
    assert all(r["how"] == "unload_model" and r["answered"] for r in releases)
    assert first["unloaded"] == [closed[0]] and last["unloaded"] == [closed[1]]


def test_stage_end_posts_the_training_clients_it_created(monkeypatch, tmp_path):
    reg = ClientRegistry()
    probes, _session, _ = _sessions(monkeypatch, reg)
    bundle = EvidenceBundle.create(tmp_path, "b", env={})
    state = plugin_session.StageState(registry=reg, bundle=bundle)
    plugin_session.enter_stage(state, "preflight")
    probes.create_lora_training_client(base_model="m")
    probes.create_lora_training_client(base_model="m")
    plugin_session.enter_stage(state, "diagnostic")  # closes the preflight stage
    plugin_session.enter_stage(state, "report")
    metrics = bundle.result["metrics"]
    assert metrics["clients/training_created/preflight"] == 2.0
    assert metrics["clients/training_created/diagnostic"] == 0.0


def test_a_refused_unload_is_never_recorded_as_released(monkeypatch):
    """An unload the service refused leaves the session unreleased, with the service's words; a
    later release asks again for that model only, and counts it released once it is answered."""
    reg = ClientRegistry()
    _probes, session, _ = _sessions(monkeypatch, reg)
    session.create_training_client_from_state_with_optimizer("p")
    session.create_training_client_from_state_with_optimizer("p")
    asked = []
    answers = iter([False, True, True])

    def unload(rest, model_id, timeout_s):
        asked.append(model_id)
        ok = next(answers)
        return UnloadOutcome(
            model_id, ok, "unloaded" if ok else "unload_model answered HTTP 503: engine_unreachable", 0.0
        )

    monkeypatch.setattr(ServiceRest, "unload", unload)
    assert reg.release_stage("session")[0]["released"] is False
    (record,) = [r for r in reg.records() if r["label"] == "arms"]
    assert record["released"] is False and "HTTP 503: engine_unreachable" in record["error"]
    assert not reg.all_released
    assert reg.release_all("errored") is True  # asked again: answered; the probes had nothing to unload
    assert len(asked) == 3 and asked[2] == asked[0]  # only the refused model asked again
    assert reg.all_released


def test_after_the_service_died_a_release_closes_nothing_and_returns_at_once():
    """A dead server has no session left to finish: each close would wait out the release timeout
    (60 s a session), so the end of a run whose embedded server was killed took minutes."""
    import concurrent.futures
    import time

    class Session:
        closes = 0

        def release(self, timeout_s):
            Session.closes += 1
            concurrent.futures.Future().result(timeout_s)  # never answered: the server is gone

    reg = ClientRegistry(release_timeout_s=30.0)
    for label in ("arms", "sampler"):
        reg.register(Session(), stage="diagnostic", label=label)
    reg.service_gone("the embedded server (pid 1) exited (exit code -9)")
    t0 = time.monotonic()
    assert reg.release_stage("diagnostic") and reg.release_all("errored") is False
    assert time.monotonic() - t0 < 10 and Session.closes == 0  # far under one 30 s close, on a loaded machine
    for record in reg.records():
        assert record["released"] is False and record["error"] == (
            "not released: the embedded server (pid 1) exited (exit code -9); nothing is left to unload"
        )

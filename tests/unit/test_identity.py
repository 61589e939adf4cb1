"""Served-model identity: marker detection, each client's record, the rehearsal label on any backend."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dppo_harness.constants import EMBEDDED_SERVER_MARKER
from dppo_harness.evidence import REHEARSAL_PREFIX, EvidenceBundle
from dppo_harness.evidence.result import label_summary
from dppo_harness.evidence.session import closing_fields, start_session
from dppo_harness.plans import load_plan
from dppo_harness.service import connectivity, observed
from dppo_harness.service.connectivity import ConnectivityReport
from dppo_harness.service.rest import RawResponse
from dppo_harness.service.wait.waiter import ServiceWaiter, WaitedFuture
from dppo_harness.stages.write import write_connectivity

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = "local/tiny-qwen3-gsm8k"
CAPS = {
    "supported_models": [{"model_name": "Qwen/Qwen3.5-2B"}],
    "embedded_server": {"marker": EMBEDDED_SERVER_MARKER, "stand_in": STAND_IN, "profile": "spindle"},
}


def test_marker_from_each_place_and_none_on_a_real_service():
    assert connectivity.detect_marker() is None
    assert connectivity.detect_marker("dppo-harness").sources == ["header"]
    assert connectivity.detect_marker("something-else") is None
    m = connectivity.detect_marker(capabilities=CAPS)
    assert (m.stand_in, m.profile, m.sources) == (STAND_IN, "spindle", ["capabilities"])
    assert connectivity.detect_marker(capabilities={"supported_models": [], "embedded_server": {"marker": "x"}}) is None


@pytest.mark.parametrize(
    "requested,served,want",
    [
        ("Qwen/Qwen3.5-2B", ["Qwen/Qwen3.5-2B"], ("Qwen/Qwen3.5-2B", False)),
        ("Qwen/Qwen3.5-0.8B", ["Qwen/Qwen3.5-9B", "Qwen/Qwen3.5-2B", "Qwen/Qwen3-0.6B"], ("Qwen/Qwen3.5-2B", True)),
        ("Qwen/Qwen3.5-4B", ["Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-8B"], ("Qwen/Qwen3.5-2B", True)),  # tie -> smaller
        ("Qwen/Qwen3.5-2B-Base", ["Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-4B-Base"], ("Qwen/Qwen3.5-4B-Base", True)),
        ("Qwen/Qwen3.5-0.8B", ["meta-llama/Llama-3.2-1B"], (None, False)),
        ("some-model", ["Qwen/Qwen3.5-2B"], (None, False)),
    ],
)
def test_choose_model(requested, served, want):
    c = connectivity.choose_model(requested, served)
    assert (c, c is not None and c != requested) == want


def _report(marker=True, model="Qwen/Qwen3.5-2B", substitution=None):
    m = connectivity.detect_marker(EMBEDDED_SERVER_MARKER, CAPS) if marker else None
    return ConnectivityReport(
        "tinker",
        "http://127.0.0.1:9",
        "Qwen/Qwen3.5-2B",
        model,
        [model],
        substitution,
        m,
        CAPS if marker else {"supported_models": []},
    )


def _bundle(tmp_path, plan_name="exp_e6b0965af3-diagnostic-r1.json", served=None):
    plan = load_plan(ROOT / "plans" / plan_name)
    b = EvidenceBundle.create(tmp_path)
    start_session(b, backend="tinker", plan=plan, stages=("unit", "preflight"), project_root=ROOT, served_model=served)
    return b, plan


def test_embedded_server_on_tinker_backend_is_labelled_rehearsal_before_training(tmp_path):
    b, _plan = _bundle(tmp_path, served=STAND_IN)
    write_connectivity(b, _report(), "tinker")
    r = b.result
    assert r["backend"]["kind"] == "local" and r["backend"]["requested_backend"] == "tinker"
    assert r["backend"]["served_model"] == STAND_IN and r["backend"]["answers_to"] == "Qwen/Qwen3.5-2B"
    assert r["summary"].startswith(REHEARSAL_PREFIX)
    assert [d["effective"] for d in r["deviations"] if d["field"] == "model"] == [STAND_IN]  # once
    eff = json.loads(b.file_path("effective-config.json").read_bytes())
    assert eff["backend"]["served_model"] == STAND_IN
    # a later stage overwrites the summary: the label stays
    b.update_result(summary="Diagnostic done.", tested_instead="the bounded diagnostic")
    assert b.result["summary"].startswith(REHEARSAL_PREFIX)


def test_real_service_is_not_relabelled(tmp_path):
    b, _plan = _bundle(tmp_path)
    sub = {"field": "model", "original": "Qwen/Qwen3.5-0.8B", "effective": "Qwen/Qwen3.5-2B", "reason": "closest"}
    write_connectivity(b, _report(marker=False, substitution=sub), "tinker")
    r = b.result
    assert r["backend"]["kind"] == "tinker" and not r["summary"].startswith(REHEARSAL_PREFIX)
    assert sub in r["deviations"]
    assert b.entry("connectivity-preflight.json") is not None


def test_creation_future_reports_the_client_once():
    seen = []
    inner = SimpleNamespace(result=lambda timeout=None: "client")
    f = WaitedFuture(
        inner, ServiceWaiter(), "create_lora_training_client", "a new client", then=lambda c: seen.append(c) or c
    )
    assert f.result() == "client" and f.result() == "client"
    assert seen == ["client"]


def test_recorder_keeps_the_complete_model_data(tmp_path):
    b, _ = _bundle(tmp_path, served=STAND_IN)
    write_connectivity(b, _report(), "tinker")
    full = {"model_id": "m1", "model_data": {"model_name": STAND_IN, "tokenizer_id": "Qwen/Qwen3.5-2B"}}
    answers = {"get_info": RawResponse(200, full, EMBEDDED_SERVER_MARKER)}
    rest = SimpleNamespace(post=lambda *a: answers["get_info"])
    info = SimpleNamespace(model_id="m1", model_dump=lambda mode: {"model_id": "m1"})
    rec = observed.TrainingClientRecorder(b, CAPS)
    out = rec(SimpleNamespace(get_info=lambda: info), "create_lora_training_client", rest)
    assert out.served_model == STAND_IN and out.served_model_source == "get_info().model_data.model_name"
    saved = json.loads(b.file_path("client-identity-01-create_lora_training_client.json").read_bytes())
    assert saved["get_info"]["model_data"]["model_name"] == STAND_IN and saved["served_model"] == STAND_IN
    assert saved["get_server_capabilities"]["embedded_server"]["stand_in"] == STAND_IN

    # a second client with the same identity: no new file now, one index entry at flush
    full2 = dict(full, model_id="m2")
    answers["get_info"] = RawResponse(200, full2, EMBEDDED_SERVER_MARKER)
    info2 = SimpleNamespace(model_id="m2", model_dump=lambda mode: {"model_id": "m2"})
    rec(SimpleNamespace(get_info=lambda: info2), "create_training_client_from_state", rest)
    assert len([f for f in b.files() if f["name"].startswith("client-identity-")]) == 1
    rec.flush()
    rec.flush()  # once only
    index = json.loads(b.file_path("client-identities.json").read_bytes())
    assert [c["model_id"] for c in index["clients"]] == ["m1", "m2"]
    assert index["clients"][1]["get_info"]["model_data"]["model_name"] == STAND_IN
    assert b.result["backend"]["served_model"] == STAND_IN


def test_the_first_client_names_the_sessions_served_model_on_a_real_service(tmp_path):
    b, _ = _bundle(tmp_path)
    assert b.result["backend"]["served_model"].startswith("reported at client creation")
    info = {"model_id": "m1", "model_data": {"model_name": "Qwen/Qwen3.5-2B"}}
    rest = SimpleNamespace(post=lambda *a: RawResponse(200, info, None))
    sdk = SimpleNamespace(model_id="m1", model_dump=lambda mode: info)
    out = observed.TrainingClientRecorder(b, {"supported_models": []})(
        SimpleNamespace(get_info=lambda: sdk), "create_lora_training_client", rest
    )
    assert out.served_model == b.result["backend"]["served_model"] == "Qwen/Qwen3.5-2B"
    assert b.result["backend"]["kind"] == "tinker" and not b.result["summary"].startswith(REHEARSAL_PREFIX)


def test_a_session_that_only_labelled_the_rehearsal_closes_with_one_label_and_what_ran():
    r = {
        "summary": REHEARSAL_PREFIX,
        "status": "running",
        "original_hypothesis_tested": False,
        "tested_instead": None,
        "backend": {"kind": "local", "embedded_server": {"stand_in": STAND_IN}, "requested_model": "Qwen/Qwen3.5-2B"},
    }
    r["summary"] = label_summary(r, closing_fields(r, ["unit", "preflight"], {})["summary"])
    assert r["summary"].startswith(REHEARSAL_PREFIX + "Stages run: unit, preflight. All selected stages passed")
    assert r["summary"].count("not Spindle") == 1

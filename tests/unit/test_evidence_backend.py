"""The backend block as a record: it writes the same JSON the keyword-built dict did, and the one
served-model rule."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dppo_harness.constants import EMBEDDED_SERVER_MARKER
from dppo_harness.evidence.backend import Backend, EmbeddedServer, ServedModel, backend_of, served_name, session_served

VERSIONS = {"tinker": "0.38.0", "torch": "2.13.0+cpu"}
MARKER = {
    "marker": EMBEDDED_SERVER_MARKER,
    "stand_in": "local/tiny-qwen3-gsm8k",
    "profile": None,
    "sources": ["header", "capabilities"],
}


def test_a_session_block_keeps_its_four_keys_in_order():
    old = {
        "kind": "tinker",
        "requested_model": "Qwen/Qwen3.5-2B",
        "served_model": "reported at client creation",
        "sdk_versions": dict(VERSIONS),
    }
    new = Backend(
        kind="tinker",
        requested_model="Qwen/Qwen3.5-2B",
        served_model="reported at client creation",
        sdk_versions=dict(VERSIONS),
    ).to_json()
    assert json.dumps(new) == json.dumps(old)


def test_an_embedded_server_block_keeps_every_key_and_a_null_url():
    old = {
        "kind": "local",
        "requested_model": "Qwen/Qwen3.5-2B",
        "served_model": "local/tiny-qwen3-gsm8k",
        "sdk_versions": dict(VERSIONS),
        "base_url": None,
        "requested_backend": "tinker",
        "answers_to": "Qwen/Qwen3.5-2B",
        "embedded_server": dict(MARKER),
        "kind_reason": "marker seen",
    }
    new = Backend(
        kind="local",
        requested_model="Qwen/Qwen3.5-2B",
        served_model="local/tiny-qwen3-gsm8k",
        sdk_versions=dict(VERSIONS),
        base_url=None,
        requested_backend="tinker",
        answers_to="Qwen/Qwen3.5-2B",
        embedded_server=EmbeddedServer.model_validate(MARKER),
        kind_reason="marker seen",
    ).to_json()
    assert json.dumps(new) == json.dumps(old)
    assert backend_of({"backend": old}) == Backend.model_validate(old)


def test_a_block_reads_back_or_is_refused():
    assert backend_of({"backend": None}) is None and backend_of({}) is None
    with pytest.raises(ValidationError):
        backend_of({"backend": {"kind": "local", "modle": "typo"}})


def test_the_served_model_is_what_get_info_names_and_a_rehearsal_when_it_is_not_the_plans():
    assert served_name({"model_data": {"model_name": "local/tiny-qwen3-gsm8k"}}) == "local/tiny-qwen3-gsm8k"
    assert served_name({"model_data": {"model_name": None}}) is None and served_name(None) is None
    assert ServedModel("Qwen/Qwen3.5-2B", "local/tiny-qwen3-gsm8k").rehearsal
    assert not ServedModel("Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-2B").rehearsal
    assert ServedModel("Qwen/Qwen3.5-2B", None).rehearsal  # nothing shows the planned model computed
    block = {"backend": {"kind": "tinker", "served_model": "Qwen/Qwen3.5-2B"}}
    assert not session_served(block, "Qwen/Qwen3.5-2B").rehearsal and session_served({}, "Qwen/Qwen3.5-2B").rehearsal

"""The backend block as a record: it writes the same JSON the keyword-built dict did, and the one
served-model rule."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dppo_harness.constants import EMBEDDED_SERVER_MARKER
from dppo_harness.evidence.backend import Backend, EmbeddedServer, backend_of, served_model

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


def test_the_served_model_is_the_stand_in_on_the_embedded_server():
    md = {"model_name": "Qwen/Qwen3.5-2B"}
    assert served_model(md, None).name == "Qwen/Qwen3.5-2B"
    assert served_model(md, None, local=True).origin == "unnamed"
    seen = EmbeddedServer.model_validate(MARKER)
    assert served_model(md, None, seen=seen).name == "local/tiny-qwen3-gsm8k"
    assert served_model({**md, "arch": "local/x"}, Backend(kind="local")).source == (
        "get_info().model_data.arch (embedded server's stand-in; model_name reports 'Qwen/Qwen3.5-2B')"
    )

"""Credential values the evidence scan cannot guard are refused at session start, by variable,
never by value: too short, or found in the harness's own files (in any encoding the scan knows)."""

from __future__ import annotations

import base64
import secrets

import pytest

from dppo_harness import constants
from dppo_harness.service.secrets_scan import MIN_SECRET_LENGTH, unsafe_credentials


def _fresh(prefix: str) -> str:
    return prefix + secrets.token_hex(12)  # made now: in no file


def test_short_and_known_values_are_refused_and_fresh_ones_pass(tmp_path):
    (tmp_path / "notes.txt").write_text("old_log_prob is unused here; key tml-local-rehearsal-copy")
    hidden = _fresh("ws-")
    (tmp_path / "data.b64").write_bytes(base64.b64encode(b"xx" + hidden.encode()))  # only its base64 is there
    files = sorted(tmp_path.iterdir())
    env = {"TINKER_API_KEY": "tml-local-rehearsal-copy", "MODAL_PROXY_TOKEN_ID": "unused",
           "MODAL_PROXY_TOKEN_SECRET": hidden, "RUNS_PROXY_TOKEN_ID": _fresh("wk-")}
    got = unsafe_credentials(env, files, root=tmp_path)
    assert [u.variable for u in got] == ["TINKER_API_KEY", "MODAL_PROXY_TOKEN_ID", "MODAL_PROXY_TOKEN_SECRET"]
    assert "notes.txt" in got[0].reason and "data.b64" in got[2].reason
    assert f"shorter than {MIN_SECRET_LENGTH} characters" in got[1].reason
    for u in got:
        assert env[u.variable] not in u.line() and u.line().startswith(f"{u.variable}: credential value refused")
    assert unsafe_credentials({"TINKER_API_KEY": _fresh("tml-")}, files, root=tmp_path) == []
    assert unsafe_credentials({}, files) == []


PROBE = {"tests/preflight/test_p.py": "def test_restore():\n    assert True\n"}


@pytest.mark.parametrize("value, reason", [
    ("unused", "shorter than"),
    (constants.LOCAL_API_KEY, "occurs in the harness's own files ("),  # constants.py, at least
])
def test_session_refuses_at_once_with_one_line(pytester, monkeypatch, value, reason):
    pytester.makeconftest('pytest_plugins = ["dppo_harness.pytest_plugin.hooks"]')
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    for rel, src in PROBE.items():
        (pytester.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / rel).write_text(src)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    monkeypatch.setenv("MODAL_PROXY_TOKEN_ID", value)
    res = pytester.runpytest("-m", "preflight")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    errors = [ln for ln in res.errlines if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("ERROR: MODAL_PROXY_TOKEN_ID: credential value refused: "), errors
    assert reason in errors[0] and value not in "\n".join(res.outlines + res.errlines)
    assert not any("collected" in ln for ln in res.outlines)

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
    env = {
        "TINKER_API_KEY": "tml-local-rehearsal-copy",
        "MODAL_PROXY_TOKEN_ID": "unused",
        "MODAL_PROXY_TOKEN_SECRET": hidden,
        "RUNS_PROXY_TOKEN_ID": _fresh("wk-"),
    }
    got = unsafe_credentials(env, files, root=tmp_path)
    names = ["TINKER_API_KEY", "MODAL_PROXY_TOKEN_ID", "MODAL_PROXY_TOKEN_SECRET"]
    assert [line.split(":")[0] for line in got] == names
    assert "notes.txt" in got[0] and "data.b64" in got[2]
    assert f"shorter than {MIN_SECRET_LENGTH} characters" in got[1]
    for name, line in zip(names, got, strict=True):
        assert env[name] not in line and line.startswith(f"{name}: credential value refused")
    assert unsafe_credentials({"TINKER_API_KEY": _fresh("tml-")}, files, root=tmp_path) == []
    assert unsafe_credentials({}, files) == []


PROBE = {"tests/preflight/test_p.py": "def test_restore():\n    assert True\n"}


@pytest.mark.parametrize(
    "value, reason",
    [
        ("unused", "shorter than"),
        (constants.LOCAL_API_KEY, "occurs in the harness's own files ("),  # constants.py, at least
    ],
)
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


def test_every_credential_named_variable_is_scanned_and_only_the_harness_ones_refused(tmp_path):
    from dppo_harness.service.secrets_scan import is_credential_name, live_secret_items, scanner_for

    env = {
        "CLOUDFLARE_ACCESS_CLIENT_SECRET": _fresh("cf-"),
        "HF_TOKEN": _fresh("hf_"),
        "WANDB_API_KEY": _fresh("wb"),
        "AWS_SECRET_ACCESS_KEY": _fresh("aws/"),
        "MODAL_TOKEN_SECRET": _fresh("as-"),
        "GITHUB_TOKEN": "short",
        "SSL_KEY_FILE": "/etc/ssl/private/a-very-long-key-path.pem",
        "TOKENIZERS_PARALLELISM": "false-but-padded-long-enough",
        "HOME": "/root/some/long/home/directory",
    }
    names = [n for n, _ in live_secret_items(env)]
    assert names == [
        "CLOUDFLARE_ACCESS_CLIENT_SECRET",
        "AWS_SECRET_ACCESS_KEY",
        "HF_TOKEN",
        "MODAL_TOKEN_SECRET",
        "WANDB_API_KEY",
    ]
    assert not is_credential_name("TOKENIZERS_PARALLELISM") and is_credential_name("OPENAI_API_KEY")
    blob = ("the log says " + base64.b64encode(env["HF_TOKEN"].encode()).decode()).encode()
    with pytest.raises(Exception, match="HF_TOKEN"):
        scanner_for(env).check(blob, "a log")
    # a short credential of another tool is not the harness's to refuse; its own are
    (line,) = unsafe_credentials({**env, "CLOUDFLARE_ACCESS_CLIENT_ID": "x"}, [])
    assert line.startswith("CLOUDFLARE_ACCESS_CLIENT_ID: ")


def test_the_embedded_server_gets_no_credential_it_does_not_check():
    from dppo_harness.local_server.process import server_environment
    from dppo_harness.local_server.profiles import SPINDLE_CREDENTIALS

    env = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "HF_TOKEN": _fresh("hf_"),
        "WANDB_API_KEY": _fresh("wb"),
        "TINKER_API_KEY": _fresh("tml-"),
        "MODAL_PROXY_TOKEN_ID": _fresh("wk-"),
        "MODAL_PROXY_TOKEN_SECRET": _fresh("ws-"),
        "CLOUDFLARE_ACCESS_CLIENT_SECRET": _fresh("cf-"),
    }
    assert server_environment(env, "default") == {"PATH": "/usr/bin", "HOME": "/root"}
    spindle = server_environment(env, "spindle")
    assert set(spindle) == {"PATH", "HOME"} | {var for _, var in SPINDLE_CREDENTIALS}

"""The scanner finds a known secret in the forms a leak takes besides the whole value: a long
piece of it (a message cut by `[:500]` or `[-500:]`) and base64 wrapped into lines (MIME, PEM)."""

from __future__ import annotations

import base64
import json
import secrets
import textwrap

import pytest

from dppo_harness.service.secrets_scan import MIN_SECRET_LENGTH, SecretLeakError, scanner_for

SECRET = "tml-" + secrets.token_hex(20)  # 44 characters, made now
# 36 bytes before the secret: its base64 runs from character 48 to 107, across the 64th and 76th
_LEAD = b"config: " + b"c" * 29


def _cut_front(s: str) -> bytes:  # an error message truncated with [:500], the secret at its end
    text = "x" * 440 + "Authorization: Bearer " + s  # 38 of its 44 characters kept
    return text[:500].encode()


def _cut_back(s: str) -> bytes:  # a log tail kept with [-500:], the secret at its start
    text = "key=" + s + "; " + "y" * 600
    return text[-(600 + 2 + len(s) - 10) :].encode()


def _wrapped(width: int, sep: str = "\n"):
    def enc(s: str) -> bytes:
        blob = base64.b64encode(_LEAD + s.encode() + b"\n" + b"z" * 200).decode()
        return sep.join(textwrap.wrap(blob, width)).encode()

    return enc


def _wrapped_in_json(s: str) -> bytes:
    blob = base64.encodebytes(_LEAD + s.encode() + b" ---" * 30).decode()  # 76-character lines
    return json.dumps({"attachment": blob}).encode()


@pytest.mark.parametrize(
    "form",
    [_cut_front, _cut_back, _wrapped(64), _wrapped(76), _wrapped(76, "\r\n"), _wrapped_in_json],
    ids=["prefix", "suffix", "b64-64", "b64-76", "b64-crlf", "b64-json"],
)
def test_a_piece_or_a_wrapped_encoding_of_a_known_secret_is_found(form):
    scanner = scanner_for({"HF_TOKEN": SECRET})
    data = form(SECRET)
    assert SECRET.encode() not in data  # never the whole value
    with pytest.raises(SecretLeakError, match="HF_TOKEN") as e:
        scanner.check(data, "log.txt")
    assert SECRET not in str(e.value) and SECRET[:MIN_SECRET_LENGTH] not in str(e.value)


def test_a_short_piece_and_ordinary_text_pass():
    scanner = scanner_for({"HF_TOKEN": SECRET})
    assert scanner.find(("key=" + SECRET[: MIN_SECRET_LENGTH - 1] + "...").encode()) == []
    blob = base64.encodebytes(b"nothing secret here " * 20)
    assert scanner.find(blob + b"\n" + json.dumps({"text": "line\nbreaks"}).encode()) == []

"""Scan bytes for live secret values (raw, base64 at any alignment and wrapped into lines, URL-encoded,
JSON-escaped, hex), and for long pieces of each of these forms (a value cut by a length limit).

Matches are reported by the secret's *label* (an environment variable name) and the encoding,
never by value, so an error message can be shown and logged safely.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, quote_plus

# Every variable whose value is a credential the harness or the SDK sends: the SDK adds the
# Cloudflare Access pair as CF-Access-Client-Id/-Secret headers to every request (and to telemetry).
SECRET_ENV_VARS = (
    "TINKER_API_KEY",
    "MODAL_PROXY_TOKEN_ID",
    "MODAL_PROXY_TOKEN_SECRET",
    "RUNS_PROXY_TOKEN_ID",
    "RUNS_PROXY_TOKEN_SECRET",
    "CLOUDFLARE_ACCESS_CLIENT_ID",
    "CLOUDFLARE_ACCESS_CLIENT_SECRET",
)
# Any other variable named like a credential (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...) is
# scanned for too when its value is long enough to scan safely; it is not the harness's to refuse.
_CREDENTIAL_WORDS = frozenset({"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"})
_NOT_A_VALUE = frozenset({"FILE", "PATH", "DIR", "SOCK"})  # names of where a credential lives, not of it

# Shorter values cannot be scanned for safely: they occur in ordinary text (a placeholder such
# as "unused" is in the vendored data and the golden file's notes), so the scan would block
# honest evidence minutes into a run. Real Tinker API keys and Modal tokens are far longer.
MIN_SECRET_LENGTH = 16


class SecretLeakError(RuntimeError):
    """Bytes about to leave memory contain a live secret. The message never holds the value."""


@dataclass(frozen=True)
class SecretMatch:
    label: str
    encoding: str


def is_credential_name(name: str) -> bool:
    """A variable named like a credential: a word KEY, TOKEN, SECRET, PASSWORD... in its name,
    not a location (`..._FILE`, `..._PATH`)."""
    words = name.upper().split("_")
    return bool(_CREDENTIAL_WORDS & set(words)) and words[-1] not in _NOT_A_VALUE


def without_credentials(env: Mapping[str, str], keep: Iterable[str] = ()) -> dict[str, str]:
    """`env` without any credential the harness sends or credential-named variable (those in `keep`
    excepted): the environment of a child process that needs none of them."""
    kept = set(keep)
    return {k: v for k, v in env.items() if k in kept or not (k in SECRET_ENV_VARS or is_credential_name(k))}


def held_secret_items(env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(variable name, value) for each credential the harness or the SDK sends, set in env."""
    env = os.environ if env is None else env
    return [(name, env[name]) for name in SECRET_ENV_VARS if env.get(name)]


def live_secret_items(env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """What the evidence must never contain: the credentials the harness sends, and the value of
    every other credential-named variable long enough to scan for (shorter ones would match ordinary text)."""
    env = os.environ if env is None else env
    held = held_secret_items(env)
    named = [
        (name, value)
        for name, value in sorted(env.items())
        if name not in SECRET_ENV_VARS and is_credential_name(name) and len(value.strip()) >= MIN_SECRET_LENGTH
    ]
    return held + named


def _b64_fragments(raw: bytes) -> dict[str, bytes]:
    """Base64 text that must appear if `raw` sits at any offset inside base64-encoded data.

    With s = offset mod 3 leading unknown bytes, only the characters whose 6 bits come entirely
    from `raw` are fixed: from ceil(8s/6) up to floor(8(s+n)/6).
    """
    out: dict[str, bytes] = {}
    n = len(raw)
    for s in range(3):
        enc = base64.b64encode(b"\0" * s + raw + b"\0\0\0")
        start, stop = -(-8 * s // 6), (8 * (s + n)) // 6
        frag = enc[start:stop]
        if len(frag) >= 4:
            out[f"base64@{s}"] = frag
            out[f"base64url@{s}"] = frag.replace(b"+", b"-").replace(b"/", b"_")
    return out


# Text is cut (`[:500]`, `[-500:]`) wherever a limit falls, so a leak may hold only part of a value:
# each encoded form's first and last PIECE bytes, and the pieces at every multiple of PIECE, so that
# any cut keeping at least PIECE bytes from one end (or 2 * PIECE - 1 from inside) holds one of them.
PIECE = 16
_WHOLE_FORMS = ("raw", "json_escaped", "url", "url_plus", "base64", "base64url", "hex")


def _pieces(variants: Mapping[str, bytes]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name in _WHOLE_FORMS:
        pat = variants.get(name, b"")
        if len(pat) <= PIECE:
            continue
        starts = sorted({*range(0, len(pat) - PIECE + 1, PIECE), len(pat) - PIECE})
        for at in starts:
            out[f"{name}_piece@{at}"] = pat[at : at + PIECE]
    return out


# Base64 is wrapped into lines (MIME every 76 characters, PEM every 64), and the line breaks may
# themselves be JSON-escaped: the base64 forms are also looked for with every line break removed.
_LINE_BREAKS = re.compile(rb"\r|\n|\\r|\\n")


def encoded_variants(value: str) -> dict[str, bytes]:
    """encoding name -> byte pattern, for one secret value."""
    raw = value.encode("utf-8")
    variants: dict[str, bytes] = {"raw": raw}
    stripped = value.strip().encode("utf-8")
    if stripped and stripped != raw:
        variants["raw_stripped"] = stripped
    variants["json_escaped"] = json.dumps(value)[1:-1].encode("ascii")
    for name, enc in (("url", quote(value, safe="")), ("url_plus", quote_plus(value, safe=""))):
        variants[name] = enc.encode("ascii")
        variants[name + "_lower"] = re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), enc).encode("ascii")
    variants["base64"] = base64.b64encode(raw)
    variants["base64url"] = base64.urlsafe_b64encode(raw)
    variants.update(_b64_fragments(raw))
    variants["hex"] = binascii.hexlify(raw)
    variants["hex_upper"] = binascii.hexlify(raw).upper()
    variants.update(_pieces(variants))
    # Deduplicate identical patterns (e.g. a plain alphanumeric value is its own URL form).
    seen: dict[bytes, str] = {}
    for name, pat in variants.items():
        seen.setdefault(pat, name)
    return {name: pat for pat, name in seen.items() if pat}


class SecretScanner:
    def __init__(self, items: Iterable[tuple[str, str]]):
        self._patterns = [(label, enc, pat) for label, v in items if v for enc, pat in encoded_variants(v).items()]

    def find(self, data: bytes) -> list[SecretMatch]:
        found: list[SecretMatch] = []
        joined = _LINE_BREAKS.sub(b"", data)
        for label, enc, pat in self._patterns:
            if pat in data:
                found.append(SecretMatch(label, enc))
            elif len(joined) != len(data) and enc.startswith("base64") and pat in joined:
                found.append(SecretMatch(label, f"{enc} (wrapped)"))
        return found

    def check(self, data: bytes, what: str) -> None:
        """Raise SecretLeakError naming `what`, the variables and encodings (never the value)."""
        matches = self.find(data)
        if matches:
            desc = ", ".join(sorted({f"{m.label} ({m.encoding})" for m in matches}))
            raise SecretLeakError(f"{what} blocked: it contains the live value of {desc}")


def scanner_for(env: Mapping[str, str] | None = None) -> SecretScanner:
    return SecretScanner(live_secret_items(env))


def unsafe_credentials(env: Mapping[str, str] | None, files: Iterable[Path], *, root: Path | None = None) -> list[str]:
    """One line per credential value that would make the evidence scan fail or mean nothing (named by
    variable, never by value): shorter than MIN_SECRET_LENGTH, or present (in any encoding the scan
    looks for) in one of `files`, the harness's own files, which reach the evidence as plans, patches,
    copies and the code archive. Each file is read once; `root` shortens the file named."""
    held, refused, long_enough = held_secret_items(env), {}, []
    short = f"shorter than {MIN_SECRET_LENGTH} characters, too short to scan the evidence for (set the real credential)"
    for name, value in held:
        if len(value.strip()) < MIN_SECRET_LENGTH:
            refused[name] = short
        else:
            long_enough.append((name, value))
    scanner = SecretScanner(long_enough)
    for path in map(Path, files if long_enough else ()):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        shown = path.relative_to(root) if root and Path(root) in path.parents else path.name
        for m in scanner.find(data):
            refused.setdefault(
                m.label,
                f"its value occurs in the harness's own files ({shown}), so the evidence scan would block them "
                "(a placeholder? set the real credential)",
            )
        if len(refused) == len(held):
            break
    return [f"{name}: credential value refused: {refused[name]}" for name in SECRET_ENV_VARS if name in refused]

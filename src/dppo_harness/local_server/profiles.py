"""Server profiles: `default` (the open local stand-in) and `spindle` (behaves like the shared
Spindle service where a client can tell: credentials on every request, the plan's base
model by name, no optimizer echo beyond what the SDK types carry).

Expected credential values come from the server's own environment at start and live only in a
`Profile` (excluded from its repr); errors name the header or variable, never a value.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from dppo_harness import constants

PROFILES = ("default", "spindle")
# (request header, environment variable holding its expected value). The stock SDK sends the API
# key as `X-API-Key` (tinker/lib/_auth_token_provider.py); the Modal proxy headers come from
# `default_headers_overrides`.
SPINDLE_CREDENTIALS = (
    ("X-API-Key", "TINKER_API_KEY"),
    ("Modal-Key", "MODAL_PROXY_TOKEN_ID"),
    ("Modal-Secret", "MODAL_PROXY_TOKEN_SECRET"),
)
# optim_step metrics that only echo the requested optimizer config; Spindle does not send them.
OPTIMIZER_ECHO_KEYS = frozenset(
    {"optim/learning_rate", "optim/beta1", "optim/beta2", "optim/eps", "optim/weight_decay", "optim/grad_clip_norm"}
)


class MissingCredential(ValueError):
    """A credential variable the spindle profile needs is unset; the message names it."""


@dataclass(frozen=True)
class Profile:
    name: str = "default"
    credentials: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)  # (header, expected value)

    def auth_error(self, headers: Mapping[str, str]) -> str | None:
        """None when the request may pass, else a message naming the first bad header (no value)."""
        for header, expected in self.credentials:
            value = headers.get(header)
            if not value:
                return f"missing header {header}"
            if not hmac.compare_digest(value.encode("utf-8", "surrogateescape"), expected):
                return f"invalid credentials in header {header}"
        return None

    def served_models(self, engine_models: list[str], stand_in: str) -> list[str]:
        """Model names this server answers to: Spindle serves the plan's base model by name only."""
        if self.name == "spindle":
            return [constants.BASE_MODEL]
        return list(engine_models) or [constants.BASE_MODEL, stand_in]

    def optim_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
        if self.name == "spindle":
            return {k: float(v) for k, v in metrics.items() if k not in OPTIMIZER_ECHO_KEYS}
        return {k: float(v) for k, v in metrics.items()}


def make_profile(name: str, env: Mapping[str, str]) -> Profile:
    """The profile `name`, reading the spindle credentials from `env`; MissingCredential if unset."""
    if name not in PROFILES:
        raise ValueError(f"--profile must be one of {PROFILES}, got {name!r}")
    if name == "default":
        return Profile()
    creds = []
    for header, var in SPINDLE_CREDENTIALS:
        value = env.get(var)
        if not value:
            raise MissingCredential(
                f"--profile spindle needs {var} in the server's environment (expected value of header {header}); "
                f"it is unset"
            )
        creds.append((header, value.encode("utf-8", "surrogateescape")))
    return Profile("spindle", tuple(creds))


def client_auth_headers(env: Mapping[str, str]) -> dict[str, str]:
    """The spindle headers a client sends, read from `env` (for the process helper's own probes)."""
    return {header: env[var] for header, var in SPINDLE_CREDENTIALS if env.get(var)}

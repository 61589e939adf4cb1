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
from dppo_harness.json_types import JsonObject

PROFILES = ("default", "spindle")
# (request header, environment variable holding its expected value). The stock SDK sends the API
# key as `X-API-Key` (tinker/lib/_auth_token_provider.py); the Modal proxy headers come from the
# ServiceClient's `default_headers` (tinker/lib/public_interfaces/service_client.py).
SPINDLE_CREDENTIALS = (
    ("X-API-Key", "TINKER_API_KEY"),
    ("Modal-Key", "MODAL_PROXY_TOKEN_ID"),
    ("Modal-Secret", "MODAL_PROXY_TOKEN_SECRET"),
)
# optim_step metrics that only echo the requested optimizer config; Spindle does not send them.
OPTIMIZER_ECHO_KEYS = frozenset(
    {"optim/learning_rate", "optim/beta1", "optim/beta2", "optim/eps", "optim/weight_decay", "optim/grad_clip_norm"}
)

# `POST client/config` (SDK 0.25 reads it into tinker/types/client_config_response.py, ignoring keys
# it does not know). Both profiles: API-key auth (no JWT exchange), fwd/bwd chunks sent in parallel.
_CLIENT_CONFIG_COMMON: JsonObject = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "parallel_fwdbwd_chunks": True,
}
# Spindle's answer: zstd-compressed protobuf fwd/bwd bodies (`Content-Encoding: zstd`,
# tinker/resources/training.py), create_training_client_from_state* as one create-from-state
# load_weights (tinker/lib/public_interfaces/service_client.py), httpx's own transport.
# `proto_write_fwdbwd` is Spindle's own flag; SDK 0.25 has no field for it (it always sends protobuf).
SPINDLE_CLIENT_CONFIG: JsonObject = _CLIENT_CONFIG_COMMON | {
    "proto_write_fwdbwd": True,
    "use_pyqwest_transport": False,
    "create_model_via_load_weights": True,
    "proto_compress_fwdbwd": True,
}
# The open stand-in: uncompressed protobuf, a restore as weights_info + create_model + load_weights,
# and the SDK's default transport (pyqwest, tinker/_base_client.py), which serves loopback plain HTTP.
DEFAULT_CLIENT_CONFIG: JsonObject = _CLIENT_CONFIG_COMMON | {
    "use_pyqwest_transport": True,
    "create_model_via_load_weights": False,
    "proto_compress_fwdbwd": False,
}


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

    def client_config(self) -> JsonObject:
        """The body of `POST client/config` for this profile."""
        return dict(SPINDLE_CLIENT_CONFIG if self.name == "spindle" else DEFAULT_CLIENT_CONFIG)

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

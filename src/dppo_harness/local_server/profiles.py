"""Server profiles: `default` (the open local stand-in) and `spindle` (Spindle, Modal's
Tinker-compatible service, as its source `modal-projects/spindle` shows it: docs/local-server.md
"Spindle profile"). Expected credential values come from the server's own environment at start and
live only in a `Profile` (excluded from its repr); errors name the header or variable, never a value.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from dppo_harness import constants
from dppo_harness.json_types import JsonObject

PROFILES = ("default", "spindle")
# The research exchange's front door in front of Spindle: (request header, environment variable
# holding its expected value). The ServiceClient sends them as `default_headers`
# (tinker/lib/public_interfaces/service_client.py).
FRONT_DOOR_CREDENTIALS = (
    ("Modal-Key", "MODAL_PROXY_TOKEN_ID"),
    ("Modal-Secret", "MODAL_PROXY_TOKEN_SECRET"),
)
# Spindle's own key: the stock SDK sends the API key as `X-API-Key` (tinker/lib/_auth_token_provider.py).
API_KEY_CREDENTIAL = ("X-API-Key", "TINKER_API_KEY")
# Every credential the spindle profile reads (the process helper keeps these in the child's env).
SPINDLE_CREDENTIALS = (API_KEY_CREDENTIAL, *FRONT_DOOR_CREDENTIALS)

# `POST client/config` (SDK 0.25 reads it into tinker/types/client_config_response.py, ignoring keys
# it does not know). Both profiles: API-key auth (no JWT exchange), fwd/bwd chunks sent in parallel.
_CLIENT_CONFIG_COMMON: JsonObject = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "parallel_fwdbwd_chunks": True,
}
# Spindle's answer (src/spindle/control_plane/http.py, `client_config`, the version with
# `proto_compress_fwdbwd`): zstd-compressed protobuf fwd/bwd bodies (`Content-Encoding: zstd`,
# tinker/resources/training.py), create_training_client_from_state* as one create-from-state
# load_weights (tinker/lib/public_interfaces/service_client.py), httpx's own transport.
# `proto_write_fwdbwd` is Spindle's own flag; SDK 0.25 has no field for it (it always sends protobuf).
# No `sample_cancel_enabled`, no session poller flag.
SPINDLE_CLIENT_CONFIG: JsonObject = _CLIENT_CONFIG_COMMON | {
    "proto_write_fwdbwd": True,
    "proto_compress_fwdbwd": True,
    "use_pyqwest_transport": False,
    "create_model_via_load_weights": True,
}
# The open stand-in: uncompressed protobuf, a restore as weights_info + create_model + load_weights,
# and the SDK's default transport (pyqwest, tinker/_base_client.py), which serves loopback plain HTTP.
DEFAULT_CLIENT_CONFIG: JsonObject = _CLIENT_CONFIG_COMMON | {
    "use_pyqwest_transport": True,
    "create_model_via_load_weights": False,
    "proto_compress_fwdbwd": False,
}

# Spindle's deployment-wide Miles LoRA settings (src/spindle/backends/miles_config.py,
# MilesBackendConfig: max_lora_rank 32; target_modules attention + MLP + output layer, i.e.
# train_attn, train_mlp and train_unembed all on).
MAX_LORA_RANK = 32
LORA_TARGETS = (True, True, True)  # (train_attn, train_mlp, train_unembed)
# Spindle's per-trainer LoRA slots on the 9B configs (max_lora_slots 6).
DEFAULT_TRAINER_SLOTS = 6
# Spindle's idle sweep (session_idle_timeout_s 300, sweep_interval_s 300).
DEFAULT_SESSION_IDLE_TIMEOUT_S = 300.0
DEFAULT_SWEEP_INTERVAL_S = 300.0
# The full-fine-tune-only definition the repo's deploy script serves next to the LoRA ones.
FULL_ONLY_MODEL = "Qwen/Qwen3.5-4B"
FULL_ONLY_CONTEXT = 32768


@dataclass(frozen=True)
class Deployment:
    """One deployed definition, as `GET /api/v1/spindle/deployments` lists it
    (src/spindle/control_plane/http.py, `list_deployments`)."""

    name: str
    definition_id: str
    base_model: str
    parameterization: Literal["lora", "full"]
    max_context_length: int | None


def spindle_deployments(max_context_length: int | None) -> tuple[Deployment, ...]:
    """The definitions the spindle profile says it deploys: the plan's base model with LoRA (the
    tiny stand-in computes it, with the engine's context length) and a full-fine-tune-only 4B."""
    return (
        Deployment("qwen3-5-2b-lora", "qwen3-5-2b-lora", constants.BASE_MODEL, "lora", max_context_length),
        Deployment("qwen3-5-4b-full", "qwen3-5-4b-full", FULL_ONLY_MODEL, "full", FULL_ONLY_CONTEXT),
    )


@dataclass(frozen=True)
class SpindleSettings:
    """The spindle profile's capacity and sweep options (see docs/local-server.md)."""

    cold_start_s: float = 0.0  # the first creation stays pending this long (a trainer starting cold)
    trainer_slots: int = DEFAULT_TRAINER_SLOTS  # models holding a LoRA slot at once; 0: every creation waits
    session_idle_timeout_s: float = DEFAULT_SESSION_IDLE_TIMEOUT_S
    sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S

    def __post_init__(self) -> None:
        for name in ("--cold-start-s", "session_idle_timeout_s"):
            value = getattr(self, name.lstrip("-").replace("-", "_"))
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (math.isfinite(self.sweep_interval_s) and self.sweep_interval_s > 0):
            raise ValueError(f"--sweep-interval-s must be a finite number > 0, got {self.sweep_interval_s!r}")
        if self.trainer_slots < 0:
            raise ValueError(f"--trainer-slots must be >= 0, got {self.trainer_slots}")


class MissingCredential(ValueError):
    """A credential variable the spindle profile needs is unset; the message names it."""


def _matches(value: str | None, expected: bytes) -> bool:
    return bool(value) and hmac.compare_digest(str(value).encode("utf-8", "surrogateescape"), expected)


@dataclass(frozen=True)
class Profile:
    name: str = "default"
    # The exchange's front door: (header, expected value), checked on every request.
    front_door: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)
    # Spindle's X-API-Key value; None: not checked (the default profile).
    api_key: bytes | None = field(default=None, repr=False)
    spindle: SpindleSettings = field(default_factory=SpindleSettings)

    @property
    def is_spindle(self) -> bool:
        return self.name == "spindle"

    def auth_error(self, headers: Mapping[str, str]) -> str | None:
        """The exchange front door: None when the request may pass, else a message naming the
        first missing or wrong header (never a value)."""
        for header, expected in self.front_door:
            value = headers.get(header)
            if not value:
                return f"research exchange front door: missing header {header}"
            if not _matches(value, expected):
                return f"research exchange front door: invalid credentials in header {header}"
        return None

    def api_key_ok(self, headers: Mapping[str, str]) -> bool:
        """Spindle's own check: X-API-Key equals TINKER_API_KEY (always true on the default profile)."""
        return self.api_key is None or _matches(headers.get(API_KEY_CREDENTIAL[0]), self.api_key)

    def served_models(self, engine_models: list[str]) -> list[str]:
        """Model names the engine computes for: Spindle serves the plan's base model by name only."""
        return [constants.BASE_MODEL] if self.is_spindle else list(engine_models)

    def client_config(self) -> JsonObject:
        """The body of `POST client/config` for this profile."""
        return dict(SPINDLE_CLIENT_CONFIG if self.is_spindle else DEFAULT_CLIENT_CONFIG)

    def optim_metrics(self, metrics: Mapping[str, float], seconds: float = 0.0) -> dict[str, float]:
        """optim_step metrics. Spindle's Miles backend answers `update_successful:mean`,
        `grad_norm:mean` (or `skipped_nonfinite:sum`) and `timing/*` only, no optimizer echo
        (src/spindle/backends/miles_lora.py, `optim_step`)."""
        if not self.is_spindle:
            return {k: float(v) for k, v in metrics.items()}
        grad_norm = float(metrics.get("optim/grad_norm", float("nan")))
        step = float(metrics.get("optim/step", 1.0))
        out = {
            "update_successful:mean": 1.0 if math.isfinite(grad_norm) else 0.0,
            "timing/optimizer_step": max(step - 1.0, 0.0),  # the step index before this update
            "timing/optim_step": float(seconds),
        }
        if math.isfinite(grad_norm):
            out["grad_norm:mean"] = grad_norm
        else:
            out["skipped_nonfinite:sum"] = 1.0
        return out


def make_profile(name: str, env: Mapping[str, str], spindle: SpindleSettings | None = None) -> Profile:
    """The profile `name`, reading the spindle credentials from `env`; MissingCredential if unset."""
    if name not in PROFILES:
        raise ValueError(f"--profile must be one of {PROFILES}, got {name!r}")
    if name == "default":
        return Profile()
    values: dict[str, bytes] = {}
    for header, var in SPINDLE_CREDENTIALS:
        value = env.get(var)
        if not value:
            raise MissingCredential(
                f"--profile spindle needs {var} in the server's environment (expected value of header {header}); "
                f"it is unset"
            )
        values[header] = value.encode("utf-8", "surrogateescape")
    return Profile(
        "spindle",
        front_door=tuple((header, values[header]) for header, _ in FRONT_DOOR_CREDENTIALS),
        api_key=values[API_KEY_CREDENTIAL[0]],
        spindle=spindle or SpindleSettings(),
    )


def client_auth_headers(env: Mapping[str, str]) -> dict[str, str]:
    """The spindle headers a client sends, read from `env` (for the process helper's own probes)."""
    return {header: env[var] for header, var in SPINDLE_CREDENTIALS if env.get(var)}

"""Service configuration: the ServiceClient's arguments from the environment, the proxy headers and
the SDK's telemetry switch. Credentials come from the environment only and are never logged: errors
name variables, not values.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Literal, TypedDict
from urllib.parse import urlsplit

from dppo_harness import constants
from dppo_harness.plans import BackendKind
from dppo_harness.service.wait.policy import ServiceConfigError

ProxyTokens = Literal["modal", "runs", "none"]


class ClientKwargs(TypedDict, total=False):
    """The ServiceClient keyword arguments for a backend (holds secrets: never log it)."""

    base_url: str
    api_key: str
    # Every header the SDK must send, X-API-Key included: tinker 0.25 also puts TINKER_API_KEY
    # from the environment into its default headers, and these replace them (so a real key in
    # the environment never reaches the embedded server).
    default_headers: dict[str, str]


PROXY_VARS: dict[str, tuple[str, str]] = {
    "modal": ("MODAL_PROXY_TOKEN_ID", "MODAL_PROXY_TOKEN_SECRET"),  # shared Spindle
    "runs": ("RUNS_PROXY_TOKEN_ID", "RUNS_PROXY_TOKEN_SECRET"),  # a Spindle fork in research-exchange-runs
}


def _require(env: Mapping[str, str], name: str, why: str) -> str:
    value = env.get(name)
    if not value:
        raise ServiceConfigError(f"environment variable {name} is not set (needed {why})")
    return value


def redact_url(url: str | None) -> str | None:
    """scheme://host[:port]/path without credentials or query (safe for evidence)."""
    if not url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def client_kwargs(
    backend: BackendKind,
    base_url: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    proxy_tokens: ProxyTokens = "modal",
) -> ClientKwargs:
    """The ServiceClient keyword arguments for a backend (holds secrets: never log the result)."""
    env = os.environ if env is None else env
    if backend == "local":
        if not base_url:
            raise ServiceConfigError("the local backend needs the embedded server's base_url (got none)")
        host = urlsplit(base_url).hostname or ""
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ServiceConfigError(f"the local backend must use a loopback base_url, got host {host!r}")
        return {
            "base_url": base_url,
            "api_key": constants.LOCAL_API_KEY,
            "default_headers": {"X-API-Key": constants.LOCAL_API_KEY},
        }
    if backend != "tinker":
        raise ServiceConfigError(f"unknown backend {backend!r}: expected 'local' or 'tinker'")
    url = base_url or _require(env, "TINKER_BASE_URL", "for the tinker backend")
    api_key = _require(env, "TINKER_API_KEY", "for the tinker backend")
    return {
        "base_url": url,
        "api_key": api_key,
        "default_headers": {"X-API-Key": api_key, **proxy_headers(env, proxy_tokens)},
    }


def proxy_headers(env: Mapping[str, str], proxy_tokens: ProxyTokens = "modal") -> dict[str, str]:
    """Modal-Key/Modal-Secret for a service behind Spindle's Modal proxy (holds secrets). "modal": only
    when MODAL_PROXY_TOKEN_ID/SECRET are set, one without the other an error; "runs": the fork's pair,
    asked for, so required; "none": no headers."""
    if proxy_tokens == "none":
        return {}
    id_var, secret_var = PROXY_VARS[proxy_tokens]
    if proxy_tokens == "modal" and not env.get(id_var) and not env.get(secret_var):
        return {}
    return {
        "Modal-Key": _require(env, id_var, f"for the Modal-Key proxy header ({secret_var} is set)"),
        "Modal-Secret": _require(env, secret_var, f"for the Modal-Secret proxy header ({id_var} is set)"),
    }


TELEMETRY_VAR = "TINKER_TELEMETRY"


def apply_sdk_telemetry(enabled: bool) -> None:
    """Turn the SDK's telemetry on or off for every client this process creates: on fatal transport
    errors (a 401, say) its events carry the request headers unredacted (X-API-Key, Modal-Key,
    Modal-Secret) to the service, so the harness sends none unless asked (`--sdk-telemetry`)."""
    os.environ[TELEMETRY_VAR] = "1" if enabled else "0"


def sdk_versions() -> dict[str, str]:
    """The installed versions of the SDK and the packages it works with ("not installed" if absent)."""
    out = {}
    for pkg in ("tinker", "tinker-cookbook", "tml-renderers", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out

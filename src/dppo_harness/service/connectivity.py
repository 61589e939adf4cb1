"""Connectivity preflight: before any training client exists, check the service can be used.

In order: the variables are set, the URL is reachable, authentication is accepted, the plan's base
model is served (or the closest served model of its family is chosen, a recorded deviation). Each
failure is one actionable line that names the variable, header or URL and never a secret value.

Every request goes the way the SDK's own go (docs/service.md), so a passing check means the SDK
connects: the SDK's HTTP client (`tinker.AsyncTinker`, which honours the proxy and CA settings of
the environment) sends the SDK's first request, `client/config`, once and without retries, for a
clear line on a wrong URL or key; then the SDK builds its client holder as every ServiceClient
does (that config, the auth it asks for, API key or JWT exchange, and the dynamic config); the
capabilities are read through that holder, raw, so the same read also tells whether the service
is the embedded server (its marker header and `embedded_server` key, which the SDK type drops).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypedDict, TypeVar

import tinker
from pydantic import JsonValue
from tinker._client import AsyncTinker
from tinker.lib.internal_client_holder import InternalClientHolder, _get_default_headers

from dppo_harness.constants import EMBEDDED_SERVER_HEADER
from dppo_harness.plans import BackendKind
from dppo_harness.service import identity
from dppo_harness.service.cancels import SetupScope, install_setup_abort
from dppo_harness.service.capacity import error_text
from dppo_harness.service.config import (
    ClientKwargs,
    ProxyTokens,
    apply_sdk_telemetry,
    client_kwargs,
    describe_service,
    redact_url,
)
from dppo_harness.service.identity import EmbeddedMarker, Substitution
from dppo_harness.service.wait.policy import ServiceConfigError

# Which variable feeds which request header (tinker backend, shared Spindle).
HEADER_VARS = {
    "x-api-key": "TINKER_API_KEY",
    "modal-key": "MODAL_PROXY_TOKEN_ID",
    "modal-secret": "MODAL_PROXY_TOKEN_SECRET",
}
# ... and with --proxy-credentials runs (a Spindle fork)
HEADER_VARS_RUNS = {
    "x-api-key": "TINKER_API_KEY",
    "modal-key": "RUNS_PROXY_TOKEN_ID",
    "modal-secret": "RUNS_PROXY_TOKEN_SECRET",
}
CLIENT_CONFIG_PATH = "/api/v1/client/config"
logger = logging.getLogger(__name__)
T = TypeVar("T")
_HEADER_IN_ERROR = re.compile(r"header\s+([A-Za-z][A-Za-z0-9-]*)", re.IGNORECASE)


class CheckRow(TypedDict):
    """One preflight check that passed, as connectivity-preflight.json lists it."""

    check: str
    passed: bool
    detail: str


class ConnectivityEvidence(TypedDict):
    """connectivity-preflight.json, key for key."""

    backend: str
    base_url: str
    requested_model: str
    model: str
    served_models: list[str]
    substitution: Substitution | None
    embedded_server: dict[str, JsonValue] | None
    get_server_capabilities: JsonValue
    checks: list[CheckRow]
    seconds: float


class ConnectivityError(RuntimeError):
    """The service cannot be used. str() is one actionable line without secret values."""

    def __init__(self, check: str, line: str):
        super().__init__(line)
        self.check, self.line = check, line


@dataclass
class ConnectivityReport:
    backend: str
    base_url: str  # redacted (no credentials, no query)
    requested_model: str
    model: str  # the model the run will use
    served_models: list[str]
    substitution: Substitution | None  # a model deviation when model != requested_model
    marker: EmbeddedMarker | None
    capabilities: JsonValue  # the raw capabilities JSON
    checks: list[CheckRow] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def embedded(self) -> bool:
        return self.marker is not None

    def client_base_model(self, requested_model: str) -> str:
        """The base model every stage creates clients with: the preflight's choice for this requested
        model (a served model of the same family when the requested one is not served, recorded as a
        deviation), else the requested model itself. The only place that resolves it."""
        if requested_model == self.requested_model:
            return self.model
        return requested_model  # not the model the preflight checked: nothing to substitute

    def as_evidence(self) -> ConnectivityEvidence:
        return {
            "backend": self.backend,
            "base_url": self.base_url,
            "requested_model": self.requested_model,
            "model": self.model,
            "served_models": self.served_models,
            "substitution": self.substitution,
            "embedded_server": self.marker.as_dict() if self.marker else None,
            "get_server_capabilities": self.capabilities,
            "checks": self.checks,
            "seconds": round(self.seconds, 3),
        }


def auth_failure_line(status: int, payload: JsonValue, url: str, proxy_tokens: ProxyTokens = "modal") -> str:
    """The line for a 401/403: the header the service names (never its value) and its variable."""
    text = str(payload.get("error", "")) if isinstance(payload, Mapping) else ""
    m = _HEADER_IN_ERROR.search(text)
    header = m.group(1) if m else None
    header_vars = HEADER_VARS_RUNS if proxy_tokens == "runs" else HEADER_VARS
    var = header_vars.get(header.lower()) if header else None
    prefix = "RUNS" if proxy_tokens == "runs" else "MODAL"
    what = ("missing" if "missing" in text.lower() else "rejected") if header else "rejected"
    if var == "TINKER_API_KEY":
        hint = "check TINKER_API_KEY (sent as X-API-Key)"
    elif var and what == "missing":  # Modal headers are sent only when both variables are set
        hint = (
            f"the service requires the Modal proxy headers Modal-Key/Modal-Secret; set {prefix}_PROXY_TOKEN_ID and "
            f"{prefix}_PROXY_TOKEN_SECRET"
        )
    elif var:
        hint = f"check {prefix}_PROXY_TOKEN_ID/SECRET ({var} is sent as {header})"
    else:
        hint = f"check {prefix}_PROXY_TOKEN_ID/SECRET (Modal-Key/Modal-Secret headers) and TINKER_API_KEY"
    return f"authentication {what} by {url} (HTTP {status}{f', header {header}' if header else ''}): {hint}"


def _status_line(
    status: int, payload: JsonValue, path: str, var: str, shown: str, proxy_tokens: ProxyTokens
) -> tuple[str, str]:
    """(check, line) for a non-200 answer to `path`."""
    if status in (401, 403):
        return "auth", auth_failure_line(status, payload, shown, proxy_tokens)
    if status == 404:
        return "reachable", f"{var} {shown} answered HTTP 404 for {path}: not a Tinker service root; check the URL"
    return "reachable", f"{var} {shown} answered HTTP {status} for {path}; retry later or check the service"


def first_contact(kwargs: ClientKwargs, timeout_s: float) -> tuple[int, JsonValue] | None:
    """The SDK's first request (POST client/config) with the SDK's HTTP client, once, no retries.

    None when the service answered it; else (HTTP status, JSON body). Raises the SDK's
    APIConnectionError / APITimeoutError when nothing answered.
    """

    async def send() -> tuple[int, JsonValue] | None:
        client = AsyncTinker(
            base_url=str(kwargs["base_url"]),
            api_key=str(kwargs["api_key"]),
            default_headers=_get_default_headers() | dict(kwargs.get("default_headers_overrides") or {}),
            max_retries=0,
            timeout=timeout_s,
        )
        try:
            await client.service.client_config(request=tinker.types.ClientConfigRequest(sdk_version=tinker.__version__))
            return None
        except tinker.APIStatusError as exc:
            return exc.status_code, identity.raw_response(exc.response).json
        finally:
            await client.close()

    return asyncio.run(send())


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """fn() on a daemon thread, so that the SDK's own minutes of retries (and the lifecycle lock
    its holder construction keeps) cannot hold the check: TimeoutError naming `what` after `timeout_s`,
    once the SDK calls fn() still waits on are cancelled (its thread then ends and lets the lock go)."""
    out: dict[str, T] = {}
    failed: list[BaseException] = []
    install_setup_abort()
    scope = SetupScope()

    def run() -> None:
        try:
            with scope:
                out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            failed.append(exc)

    t = threading.Thread(target=run, name=f"connectivity: {what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        scope.abort()
        t.join(timeout_s)
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
    if failed:
        raise failed[0]
    return out["value"]


def sdk_holder(client: tinker.ServiceClient, timeout_s: float) -> InternalClientHolder:
    """The session-less holder the ServiceClient builds for REST reads (config, auth, dynamic
    config), built under `bounded`."""
    return bounded(client._get_rest_holder, timeout_s, "the SDK's client setup")


def close_probe(probe: tinker.ServiceClient, timeout_s: float) -> str | None:
    """Close the probe's ServiceClient within `timeout_s` (close() itself waits on the lock a
    holder still being built keeps); None when closed, else what was seen (the thread is left, a daemon)."""
    try:
        bounded(lambda: probe.close("success").result(timeout_s), timeout_s, "closing the probe client")
    except Exception as exc:
        return f"{type(exc).__name__}: {error_text(exc)}"
    return None


@dataclass(frozen=True)
class _Target:
    """The service as the checks name it: the SDK's client arguments, the URL as shown (redacted)
    and the variable that holds it."""

    kwargs: ClientKwargs
    shown: str
    var: str
    proxy_tokens: ProxyTokens

    def status_error(self, status: int, payload: JsonValue, path: str) -> ConnectivityError:
        return ConnectivityError(*_status_line(status, payload, path, self.var, self.shown, self.proxy_tokens))


def _check_variables(
    backend: BackendKind,
    base_url: str | None,
    env: Mapping[str, str] | None,
    proxy_tokens: ProxyTokens,
    ok: Callable[[str, str], None],
) -> _Target:
    """1. The variables are set (their names only)."""
    try:
        kwargs = client_kwargs(backend, base_url, env, proxy_tokens=proxy_tokens)
    except ServiceConfigError as exc:
        raise ConnectivityError("variables", str(exc)) from None
    url = str(kwargs["base_url"])
    shown = redact_url(url) or url
    var = "TINKER_BASE_URL" if backend == "tinker" else "the embedded server's URL"
    proxy = ", ".join(describe_service(backend, url, proxy_tokens=proxy_tokens, env=env)["proxy_headers"])
    ok(
        "variables",
        f"TINKER_BASE_URL and TINKER_API_KEY are set; proxy headers: {proxy or 'none (no proxy-token variables set)'}"
        if backend == "tinker"
        else "local backend: no credentials needed",
    )
    return _Target(kwargs, shown, var, proxy_tokens)


def _read_capabilities(target: _Target, timeout_s: float, ok: Callable[[str, str], None]) -> identity.RawResponse:
    """2. Reachable (3. auth is judged on the same requests): the SDK's first request, then its
    holder, then the capabilities read through it. Returns the raw capabilities response."""
    shown, var = target.shown, target.var
    try:
        refused = first_contact(target.kwargs, timeout_s)
    except tinker.APITimeoutError:
        raise ConnectivityError("reachable", f"{var} {shown} did not answer within {timeout_s:.0f} s") from None
    except tinker.APIConnectionError:
        raise ConnectivityError(
            "reachable",
            f"cannot connect to {var} {shown}: connection refused or host unknown; "
            "check the URL and that the service is up",
        ) from None
    if refused is not None:
        status, payload = refused
        if status in (401, 403):
            ok("reachable", f"{shown} answered HTTP {status}")
        raise target.status_error(status, payload, CLIENT_CONFIG_PATH)
    probe = tinker.ServiceClient(**target.kwargs)
    try:
        try:
            holder = sdk_holder(probe, timeout_s)
            resp = identity.get_capabilities_raw(holder, timeout_s)
        except tinker.APIStatusError as exc:
            raise target.status_error(
                exc.status_code, identity.raw_response(exc.response).json, CLIENT_CONFIG_PATH
            ) from None
        except (TimeoutError, tinker.APIConnectionError) as exc:
            raise ConnectivityError(
                "reachable",
                f"{var} {shown}: the SDK could not set up its client ({type(exc).__name__}: {error_text(exc)})",
            ) from None
    finally:
        unclosed = close_probe(probe, timeout_s)  # a session-less holder: nothing to finish on the server
    if unclosed is not None:
        logger.warning(
            "the connectivity probe's client did not close (%s); it holds no session on the service", unclosed
        )
    if resp.status != 200:
        if resp.status in (401, 403):
            ok("reachable", f"{shown} answered HTTP {resp.status}")
        raise target.status_error(resp.status, resp.json, identity.CAPABILITIES_PATH)
    ok("reachable", f"{shown} answered {identity.CAPABILITIES_PATH} through the SDK's client")
    return resp


@dataclass(frozen=True)
class _ModelChoice:
    model: str
    served: list[str]
    substitution: Substitution | None


def _choose_base_model(
    requested_model: str, caps: JsonValue, shown: str, ok: Callable[[str, str], None]
) -> _ModelChoice:
    """4. The plan's base model is served, or the closest served model of its family is chosen
    (recorded as a deviation)."""
    models = caps.get("supported_models") if isinstance(caps, Mapping) else None
    if not isinstance(models, list):
        raise ConnectivityError("model", f"{shown} did not answer like a Tinker service (no supported_models list)")
    served = [
        str(m.get("model_name"))
        for m in models
        if isinstance(m, Mapping) and m.get("model_name") and m.get("trainable") is not False
    ]
    choice = identity.choose_model(requested_model, served)
    if choice.model is None:
        raise ConnectivityError(
            "model",
            f"base model {requested_model} is not served by {shown} and no model of its "
            f"family is; served: {', '.join(served) or 'none'}",
        )
    substitution: Substitution | None = None
    if choice.substituted:
        substitution = {
            "field": "model",
            "original": requested_model,
            "effective": choice.model,
            "reason": f"{requested_model} is not served by {shown}; {choice.model} is the closest served "
            f"model of the same family (served: {', '.join(served)})",
        }
    ok("model", f"{choice.model} is served" + (f" (instead of {requested_model})" if choice.substituted else ""))
    return _ModelChoice(choice.model, served, substitution)


def check_connectivity(
    backend: BackendKind,
    base_url: str | None,
    requested_model: str,
    env: Mapping[str, str] | None = None,
    *,
    proxy_tokens: ProxyTokens = "modal",
    timeout_s: float = 10.0,
    sdk_telemetry: bool = False,
) -> ConnectivityReport:
    """Run the four checks; raise ConnectivityError (one line) on the first that fails."""
    t0 = time.monotonic()
    checks: list[CheckRow] = []

    def ok(check: str, detail: str) -> None:
        checks.append(CheckRow(check=check, passed=True, detail=detail))

    target = _check_variables(backend, base_url, env, proxy_tokens, ok)
    apply_sdk_telemetry(sdk_telemetry)
    resp = _read_capabilities(target, timeout_s, ok)
    ok("auth", "credentials accepted" if backend == "tinker" else "no authentication on the local backend")
    caps = resp.json
    model = _choose_base_model(requested_model, caps, target.shown, ok)
    marker = identity.detect_marker(
        headers={EMBEDDED_SERVER_HEADER: resp.marker_header} if resp.marker_header else None,
        capabilities=caps if isinstance(caps, dict) else None,
    )
    return ConnectivityReport(
        backend,
        target.shown,
        requested_model,
        model.model,
        model.served,
        model.substitution,
        marker,
        caps,
        checks,
        time.monotonic() - t0,
    )

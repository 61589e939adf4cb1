"""Connectivity preflight: before any training client exists, check the service can be used.

In order: the variables are set, the URL is reachable, authentication is accepted, the plan's base
model is served (or the closest served model of its family is chosen, a recorded deviation). Each
failure is one actionable line that names the variable, header or URL and never a secret value.
The same single capabilities read also tells whether the service is the embedded server.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from dppo_harness import identity, service
from dppo_harness.constants import EMBEDDED_SERVER_HEADER
from dppo_harness.identity import EmbeddedMarker

# Which variable feeds which request header (tinker backend, shared Spindle).
HEADER_VARS = {"x-api-key": "TINKER_API_KEY", "modal-key": "MODAL_PROXY_TOKEN_ID",
               "modal-secret": "MODAL_PROXY_TOKEN_SECRET"}
_HEADER_IN_ERROR = re.compile(r"header\s+([A-Za-z][A-Za-z0-9-]*)", re.IGNORECASE)


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
    substitution: dict[str, str] | None  # a model deviation when model != requested_model
    marker: EmbeddedMarker | None
    capabilities: Any  # the raw capabilities JSON
    checks: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def embedded(self) -> bool:
        return self.marker is not None

    def as_evidence(self) -> dict[str, Any]:
        return {"backend": self.backend, "base_url": self.base_url, "requested_model": self.requested_model,
                "model": self.model, "served_models": self.served_models, "substitution": self.substitution,
                "embedded_server": self.marker.as_dict() if self.marker else None,
                "get_server_capabilities": self.capabilities, "checks": self.checks,
                "seconds": round(self.seconds, 3)}


def client_base_model(requested_model: str, report: ConnectivityReport) -> str:
    """The base model every stage creates clients with: the preflight's choice for this requested
    model (a served model of the same family when the requested one is not served, recorded as a
    deviation), else the requested model itself. The only place that resolves it."""
    if requested_model == report.requested_model:
        return report.model
    return requested_model  # not the model the preflight checked: nothing to substitute


def auth_failure_line(status: int, payload: Any, url: str) -> str:
    """The line for a 401/403: the header the service names (never its value) and its variable."""
    text = str(payload.get("error", "")) if isinstance(payload, Mapping) else ""
    m = _HEADER_IN_ERROR.search(text)
    header = m.group(1) if m else None
    var = HEADER_VARS.get(header.lower()) if header else None
    what = ("missing" if "missing" in text.lower() else "rejected") if header else "rejected"
    if var == "TINKER_API_KEY":
        hint = "check TINKER_API_KEY (sent as X-API-Key)"
    elif var and what == "missing":  # Modal headers are sent only when both variables are set
        hint = ("the service requires the Modal proxy headers Modal-Key/Modal-Secret; set MODAL_PROXY_TOKEN_ID and "
                "MODAL_PROXY_TOKEN_SECRET")
    elif var:
        hint = f"check MODAL_PROXY_TOKEN_ID/SECRET ({var} is sent as {header})"
    else:
        hint = "check MODAL_PROXY_TOKEN_ID/SECRET (Modal-Key/Modal-Secret headers) and TINKER_API_KEY"
    return f"authentication {what} by {url} (HTTP {status}{f', header {header}' if header else ''}): {hint}"


def check_connectivity(
    backend: service.Backend,
    base_url: str | None,
    requested_model: str,
    env: Mapping[str, str] | None = None,
    *,
    proxy_tokens: service.ProxyTokens = "modal",
    timeout_s: float = 10.0,
) -> ConnectivityReport:
    """Run the four checks; raise ConnectivityError (one line) on the first that fails."""
    t0 = time.monotonic()
    checks: list[dict[str, Any]] = []

    def ok(check: str, detail: str) -> None:
        checks.append({"check": check, "passed": True, "detail": detail})

    # 1. variables (names only)
    try:
        kwargs = service.client_kwargs(backend, base_url, env, proxy_tokens=proxy_tokens)
    except service.ServiceConfigError as exc:
        raise ConnectivityError("variables", str(exc)) from None
    url = str(kwargs["base_url"])
    shown = service.redact_url(url) or url
    var = "TINKER_BASE_URL" if backend == "tinker" else "the embedded server's URL"
    proxy = ("the proxy-token variables are set" if kwargs.get("default_headers_overrides")
             else "no proxy-token variables set: no Modal proxy headers sent")
    ok("variables", f"TINKER_BASE_URL and TINKER_API_KEY are set; {proxy}"
       if backend == "tinker" else "local backend: no credentials needed")

    # 2. reachable (3. auth is judged on the same request)
    headers = identity.auth_headers(kwargs)
    try:
        resp = identity.get_capabilities_raw(url, headers, timeout_s)
    except httpx.ConnectError:
        raise ConnectivityError("reachable", f"cannot connect to {var} {shown}: connection refused or host unknown; "
                                             "check the URL and that the service is up") from None
    except httpx.TimeoutException:
        raise ConnectivityError("reachable", f"{var} {shown} did not answer within {timeout_s:.0f} s") from None
    except httpx.HTTPError as exc:
        raise ConnectivityError("reachable", f"{var} {shown}: request failed ({type(exc).__name__})") from None
    if resp.status in (401, 403):
        ok("reachable", f"{shown} answered HTTP {resp.status}")
        raise ConnectivityError("auth", auth_failure_line(resp.status, resp.json, shown))
    if resp.status == 404:
        raise ConnectivityError("reachable", f"{var} {shown} answered HTTP 404 for {identity.CAPABILITIES_PATH}: "
                                             "not a Tinker service root; check the URL")
    if resp.status != 200:
        raise ConnectivityError("reachable", f"{var} {shown} answered HTTP {resp.status} for "
                                             f"{identity.CAPABILITIES_PATH}; retry later or check the service")
    ok("reachable", f"{shown} answered {identity.CAPABILITIES_PATH}")
    ok("auth", "credentials accepted" if backend == "tinker" else "no authentication on the local backend")

    # 4. the base model
    caps = resp.json
    models = caps.get("supported_models") if isinstance(caps, Mapping) else None
    if not isinstance(models, list):
        raise ConnectivityError("model", f"{shown} did not answer like a Tinker service (no supported_models list)")
    served = [str(m.get("model_name")) for m in models
              if isinstance(m, Mapping) and m.get("model_name") and m.get("trainable") is not False]
    choice = identity.choose_model(requested_model, served)
    if choice.model is None:
        raise ConnectivityError("model", f"base model {requested_model} is not served by {shown} and no model of its "
                                         f"family is; served: {', '.join(served) or 'none'}")
    substitution = None
    if choice.substituted:
        substitution = {"field": "model", "original": requested_model, "effective": choice.model,
                        "reason": f"{requested_model} is not served by {shown}; {choice.model} is the closest served "
                                  f"model of the same family (served: {', '.join(served)})"}
    ok("model", f"{choice.model} is served" + (f" (instead of {requested_model})" if choice.substituted else ""))
    marker = identity.detect_marker(headers={EMBEDDED_SERVER_HEADER: resp.marker_header}
                                    if resp.marker_header else None, capabilities=caps)
    return ConnectivityReport(backend, shown, requested_model, choice.model, served, substitution, marker, caps,
                              checks, time.monotonic() - t0)

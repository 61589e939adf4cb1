"""Connectivity preflight: before any training client exists, check the service can be used.

In order: the variables are set, the URL is reachable, authentication is accepted, the service can
serve the installed SDK, and the plan's base model is served with LoRA (or the closest served LoRA
model of its family is chosen, a recorded deviation). Each failure is one line naming the variable,
header or URL, never a secret value. First contact is read raw (`service.rest`), one attempt each,
and recorded as sent: `client/config` (the SDK's first request), `client/dynamic_config`,
`get_server_capabilities` (raw keeps the embedded server's marker, which the SDK's type drops) and
`spindle/deployments` where served (which models train LoRA: capabilities do not say).
The embedded server's marker (a header and a capabilities key) makes the session's backend block
a rehearsal's (`stages.write.write_connectivity`): which server and profile ran.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypedDict

import httpx
import tinker
from pydantic import JsonValue, ValidationError

from dppo_harness.constants import EMBEDDED_SERVER_MARKER
from dppo_harness.evidence.backend import EMBEDDED_KEY, EmbeddedServer
from dppo_harness.json_types import JsonObject
from dppo_harness.plans import BackendKind
from dppo_harness.service.config import (
    PROXY_VARS,
    ClientKwargs,
    ProxyTokens,
    apply_sdk_telemetry,
    client_kwargs,
    redact_url,
)
from dppo_harness.service.rest import (
    CAPABILITIES_PATH,
    CLIENT_CONFIG_PATH,
    DEPLOYMENTS_PATH,
    DYNAMIC_CONFIG_PATH,
    RawResponse,
    ServiceRest,
    raw_response,
)
from dppo_harness.service.wait.policy import ServiceConfigError
from dppo_harness.service.wait.waiter import run_beside

logger = logging.getLogger(__name__)
_HEADER_IN_ERROR = re.compile(r"header\s+([A-Za-z][A-Za-z0-9-]*)", re.IGNORECASE)


def detect_marker(
    marker_header: str | None = None, capabilities: Mapping[str, JsonValue] | None = None
) -> EmbeddedServer | None:
    """The embedded-server marker from its header's value or capabilities (the evidence's record of
    it), or None (a real service)."""
    sources: list[str] = ["header"] if marker_header == EMBEDDED_SERVER_MARKER else []
    stand_in = profile = None
    caps = (capabilities or {}).get(EMBEDDED_KEY)
    if isinstance(caps, Mapping) and caps.get("marker") == EMBEDDED_SERVER_MARKER:
        sources.append("capabilities")
        stand_in, profile = _text(caps.get("stand_in")), _text(caps.get("profile"))
    if not sources:
        return None
    return EmbeddedServer(marker=EMBEDDED_SERVER_MARKER, stand_in=stand_in, profile=profile, sources=sources)


def _text(value: JsonValue) -> str | None:
    """A name the embedded server sent (a non-empty string), else None."""
    return value if isinstance(value, str) and value else None


class Substitution(TypedDict):
    """A model deviation: the plan's model (`original`) replaced by `effective`, and why."""

    field: str
    original: str
    effective: str
    reason: str


_SIZE_RE = re.compile(r"^(?P<family>.+?)-(?P<size>\d+(?:\.\d+)?)(?P<unit>[BbMm])(?:-(?P<suffix>.*))?$")


def _parse(name: str) -> tuple[str, float, str] | None:
    m = _SIZE_RE.match(name)
    if not m:
        return None
    size = float(m["size"]) * (1.0 if m["unit"] in "Bb" else 1e-3)
    return m["family"], size, (m["suffix"] or "")


def choose_model(requested: str, served: list[str]) -> str | None:
    """The requested model if served, else the closest served model of the same family (None: none).

    Family = the name before the size (`Qwen/Qwen3.5` of `Qwen/Qwen3.5-0.8B`); closest = smallest
    |log size ratio|, same variant suffix preferred, ties to the smaller model.
    """
    want = _parse(requested)
    if requested in served or want is None:
        return requested if requested in served else None
    cands = []
    for n in served:
        p = _parse(n)
        if p and p[0] == want[0] and p[1] > 0 and want[1] > 0:
            cands.append(((p[2] != want[2]), abs(math.log(p[1] / want[1])), p[1], n))
    return min(cands)[3] if cands else None


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
    marker: EmbeddedServer | None
    capabilities: JsonValue  # the raw capabilities JSON
    first_contact: JsonObject = field(default_factory=dict)  # client/config, dynamic_config, deployments as sent
    checks: list[JsonValue] = field(default_factory=list)  # each check that passed: check, passed, detail
    seconds: float = 0.0

    @property
    def embedded(self) -> bool:
        return self.marker is not None

    def client_base_model(self, requested_model: str) -> str:
        """The base model every stage creates clients with: the preflight's choice (possibly a recorded
        substitute) for the model it checked, any other model as it is. The only place that resolves it."""
        return self.model if requested_model == self.requested_model else requested_model


def auth_failure_line(status: int, payload: JsonValue, url: str, proxy_tokens: ProxyTokens = "modal") -> str:
    """The line for a 401/403: the header the service names (never its value) and its variable."""
    text = str(payload.get("error", "")) if isinstance(payload, Mapping) else ""
    m = _HEADER_IN_ERROR.search(text)
    header = m.group(1) if m else None
    id_var, secret_var = PROXY_VARS["runs" if proxy_tokens == "runs" else "modal"]
    var = {"x-api-key": "TINKER_API_KEY", "modal-key": id_var, "modal-secret": secret_var}.get((header or "").lower())
    what = "missing" if header and "missing" in text.lower() else "rejected"
    if var == "TINKER_API_KEY":
        hint = "check TINKER_API_KEY (sent as X-API-Key)"
    elif var and what == "missing":  # Modal headers are sent only when both variables are set
        hint = f"the service requires the Modal proxy headers Modal-Key/Modal-Secret; set {id_var} and {secret_var}"
    elif var:
        hint = f"check {id_var}/SECRET ({var} is sent as {header})"
    else:
        hint = f"check {id_var}/SECRET (Modal-Key/Modal-Secret headers) and TINKER_API_KEY"
    return f"authentication {what} by {url} (HTTP {status}{f', header {header}' if header else ''}): {hint}"


@dataclass(frozen=True)
class _Target:
    """The service as the checks name it: the SDK's client arguments, the URL as shown (redacted)
    and the variable that holds it."""

    kwargs: ClientKwargs
    shown: str
    var: str
    proxy_tokens: ProxyTokens

    def status_error(self, status: int, payload: JsonValue, path: str) -> ConnectivityError:
        """The line for a non-200 answer to `path`."""
        if status in (401, 403):
            return ConnectivityError("auth", auth_failure_line(status, payload, self.shown, self.proxy_tokens))
        where = f"{self.var} {self.shown} answered HTTP {status} for {path}"
        if status == 404:
            return ConnectivityError("reachable", f"{where}: not a Tinker service root; check the URL")
        return ConnectivityError("reachable", f"{where}; retry later or check the service")

    def unreachable(self, what: str) -> ConnectivityError:
        return ConnectivityError("reachable", f"{self.var} {self.shown}{what}")


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
    var = "TINKER_BASE_URL" if backend == "tinker" else "the embedded server's URL"
    sent = [
        (h, v)
        for h, v in zip(("Modal-Key", "Modal-Secret"), PROXY_VARS.get(proxy_tokens, ()))
        if h in kwargs["default_headers"]
    ]
    proxy = ", ".join(f"{h} from {v}" for h, v in sent)
    ok(
        "variables",
        f"TINKER_BASE_URL and TINKER_API_KEY are set; proxy headers: {proxy or 'none (no proxy-token variables set)'}"
        if backend == "tinker"
        else "local backend: no credentials needed",
    )
    return _Target(kwargs, redact_url(url) or url, var, proxy_tokens)


def _row(path: str, r: RawResponse | None) -> JsonObject:
    return {"path": path, "http_status": None if r is None else r.status, "body": None if r is None else r.json}


def _first_contact(
    target: _Target, timeout_s: float, ok: Callable[[str, str], None]
) -> tuple[RawResponse, RawResponse, RawResponse | None, JsonObject]:
    """2. Reachable (3. auth is judged on the same requests): the SDK's first request, client/config,
    once, then what else a client of this service should know before it creates anything:
    (capabilities, client/config, deployments, the first-contact evidence)."""
    shown = target.shown
    rest = ServiceRest(str(target.kwargs["base_url"]), target.kwargs["default_headers"], timeout_s)
    try:
        config = rest.post(CLIENT_CONFIG_PATH, {"sdk_version": tinker.__version__})  # as the SDK sends it
    except httpx.TimeoutException:
        raise target.unreachable(f" did not answer within {timeout_s:.0f} s") from None
    except httpx.HTTPError:
        raise ConnectivityError(
            "reachable",
            f"cannot connect to {target.var} {shown}: connection refused or host unknown; "
            "check the URL and that the service is up",
        ) from None
    if config.status != 200:
        if config.status in (401, 403):
            ok("reachable", f"{shown} answered HTTP {config.status}")
        raise target.status_error(config.status, config.json, CLIENT_CONFIG_PATH)
    try:
        jwt = isinstance(config.json, Mapping) and config.json.get("pjwt_auth_enabled") is True
        caps = _sdk_capabilities(target, timeout_s) if jwt else rest.get(CAPABILITIES_PATH)
    except tinker.APIStatusError as exc:
        raise target.status_error(exc.status_code, raw_response(exc.response).json, CAPABILITIES_PATH) from None
    except (TimeoutError, tinker.APIConnectionError) as exc:
        raise target.unreachable(f": the SDK could not read {CAPABILITIES_PATH} ({type(exc).__name__})") from None
    except httpx.HTTPError as exc:
        raise target.unreachable(f": {CAPABILITIES_PATH} failed ({type(exc).__name__})") from None
    if caps.status != 200:
        raise target.status_error(caps.status, caps.json, CAPABILITIES_PATH)
    ok("reachable", f"{shown} answered {CLIENT_CONFIG_PATH} and {CAPABILITIES_PATH}")
    try:  # the SDK's session setup reads it next: a service that never answers it cannot be used
        dynamic = rest.post(DYNAMIC_CONFIG_PATH, {"sdk_version": tinker.__version__})
    except httpx.HTTPError as exc:
        raise target.unreachable(
            f": {DYNAMIC_CONFIG_PATH} got no answer ({type(exc).__name__}); the SDK's session setup "
            "reads it after client/config"
        ) from None
    try:  # a service may lack it (404) or refuse it
        deployments: RawResponse | None = rest.get(DEPLOYMENTS_PATH)
    except httpx.HTTPError:
        deployments = None
    evidence: JsonObject = {
        "sdk": f"tinker {tinker.__version__}",
        "client_config": _row(CLIENT_CONFIG_PATH, config),
        "client_dynamic_config": _row(DYNAMIC_CONFIG_PATH, dynamic),
        "spindle_deployments": _row(DEPLOYMENTS_PATH, deployments),
    }
    return caps, config, deployments, evidence


def _sdk_capabilities(target: _Target, timeout_s: float) -> RawResponse:
    """Capabilities through the SDK's public call, for a service that asks for its JWT exchange
    (`pjwt_auth_enabled`): a raw read with the API key would be refused. The SDK's type keeps
    only the keys it declares (no embedded-server marker: the embedded server never asks for JWTs)."""
    client = tinker.ServiceClient(**target.kwargs)
    caps = run_beside(client.get_server_capabilities, "get_server_capabilities").result(timeout_s)
    return RawResponse(200, caps.model_dump(mode="json"), None)


def _check_sdk_served(config: RawResponse, shown: str, ok: Callable[[str, str], None]) -> None:
    """The service's client/config is one the installed SDK sets a session up from (its own type)."""
    try:
        parsed = tinker.types.ClientConfigResponse.model_validate(config.json)
    except ValidationError as exc:
        raise ConnectivityError(
            "sdk",
            f"{shown} answered {CLIENT_CONFIG_PATH} with {str(config.json)[:200]!r}, which tinker "
            f"{tinker.__version__} cannot set a session up from ({exc.error_count()} field errors): the service "
            "does not serve this SDK",
        ) from None
    flags = sorted(k for k, v in parsed.model_dump().items() if v is True)
    ok("sdk", f"tinker {tinker.__version__} accepts the service's client/config (on: {', '.join(flags) or 'none'})")


def _lora_models(r: RawResponse | None) -> dict[str, list[str]] | None:
    """Per base model, the parameterizations its deployments offer; None without a deployment list."""
    rows = r.json.get("deployments") if r is not None and r.status == 200 and isinstance(r.json, Mapping) else None
    if not isinstance(rows, list):
        return None
    out: dict[str, list[str]] = {}
    for row in rows:
        if isinstance(row, Mapping) and isinstance(base := row.get("base_model"), str):
            out.setdefault(base, []).append(str(row.get("parameterization")))
    return out


def _choose_base_model(
    requested_model: str,
    caps: JsonValue,
    deployments: dict[str, list[str]] | None,
    shown: str,
    ok: Callable[[str, str], None],
) -> tuple[str, list[str], Substitution | None]:
    """4. The plan's base model is served with LoRA, or the closest served LoRA model of its family is
    chosen (recorded as a deviation): (model, served, substitution). Without a deployment list,
    capabilities name what is served and creation is the first to say whether LoRA is."""
    models = caps.get("supported_models") if isinstance(caps, Mapping) else None
    if not isinstance(models, list):
        raise ConnectivityError("model", f"{shown} did not answer like a Tinker service (no supported_models list)")
    served = [
        str(m.get("model_name"))
        for m in models
        if isinstance(m, Mapping) and m.get("model_name") and m.get("trainable") is not False
    ]
    candidates = served if deployments is None else [m for m in served if "lora" in deployments.get(m, [])]
    choice = choose_model(requested_model, candidates)
    if choice is None:
        if deployments is not None and requested_model in served:
            raise ConnectivityError(
                "model",
                f"base model {requested_model} is served by {shown} for full fine-tuning only "
                f"({DEPLOYMENTS_PATH}: {', '.join(deployments.get(requested_model, []))}), "
                f"and no LoRA model of its family is; LoRA-capable: {', '.join(candidates) or 'none'}",
            )
        raise ConnectivityError(
            "model",
            f"base model {requested_model} is not served{' with LoRA' if deployments is not None else ''} by {shown} "
            f"and no model of its family is; served: {', '.join(served) or 'none'}"
            + (f" (LoRA-capable: {', '.join(candidates) or 'none'})" if deployments is not None else ""),
        )
    substitution: Substitution | None = None
    lora_note = f" with LoRA ({DEPLOYMENTS_PATH})" if deployments is not None else ""
    if choice != requested_model:
        substitution = {
            "field": "model",
            "original": requested_model,
            "effective": choice,
            "reason": f"{requested_model} is not served{lora_note} by {shown}; {choice} is the closest served "
            f"model of the same family (served: {', '.join(candidates)})",
        }
    ok(
        "model",
        f"{choice} is served{lora_note}" + (f" (instead of {requested_model})" if substitution else ""),
    )
    return choice, served, substitution


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
    """Run the checks; raise ConnectivityError (one line) on the first that fails."""
    t0 = time.monotonic()
    checks: list[JsonValue] = []

    def ok(check: str, detail: str) -> None:
        checks.append({"check": check, "passed": True, "detail": detail})

    target = _check_variables(backend, base_url, env, proxy_tokens, ok)
    apply_sdk_telemetry(sdk_telemetry)
    caps, config, deployments, contact = _first_contact(target, timeout_s, ok)
    ok("auth", "credentials accepted" if backend == "tinker" else "no authentication on the local backend")
    _check_sdk_served(config, target.shown, ok)
    model, served, substitution = _choose_base_model(
        requested_model, caps.json, _lora_models(deployments), target.shown, ok
    )
    marker = detect_marker(caps.marker_header, caps.json if isinstance(caps.json, dict) else None)
    seconds = time.monotonic() - t0
    return ConnectivityReport(
        backend, target.shown, requested_model, model, served, substitution, marker, caps.json, contact, checks, seconds
    )

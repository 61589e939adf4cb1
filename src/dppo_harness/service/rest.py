"""Raw requests to the service beside the SDK: what the SDK's public API does not hand back.

The SDK's response types drop undeclared keys (the embedded server's marker, Spindle's deployment
list), tinker 0.25 has no public call for the client config, deployments or a model's release, and
its first request retries for minutes. So `ServiceRest` reads those with plain HTTP to the service's
own URL with the run's own headers (what the SDK sends), one bounded attempt each. The unload body
is the SDK's own `UnloadModelRequest`; its future is polled at `retrieve_future` within the caller's
timeout, a 408 `try_again` meaning the service is still working.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from pydantic import JsonValue

from dppo_harness.constants import EMBEDDED_SERVER_HEADER
from dppo_harness.json_types import JsonObject

CLIENT_CONFIG_PATH = "/api/v1/client/config"
DYNAMIC_CONFIG_PATH = "/api/v1/client/dynamic_config"
CAPABILITIES_PATH = "/api/v1/get_server_capabilities"
DEPLOYMENTS_PATH = "/api/v1/spindle/deployments"
GET_INFO_PATH = "/api/v1/get_info"
UNLOAD_MODEL_PATH = "/api/v1/unload_model"
RETRIEVE_FUTURE_PATH = "/api/v1/retrieve_future"


@dataclass(frozen=True)
class RawResponse:
    status: int
    json: JsonValue  # None when the body is not JSON
    marker_header: str | None  # value of the embedded-server header, if present


def raw_response(resp: httpx.Response) -> RawResponse:
    try:
        payload = resp.json()
    except ValueError:
        payload = None
    return RawResponse(resp.status_code, payload, resp.headers.get(EMBEDDED_SERVER_HEADER))


@dataclass(frozen=True)
class UnloadOutcome:
    """What the service answered to one model's unload: `answered` only when its future resolved
    without an error; `text` is the service's own words (or what was seen instead)."""

    model_id: str
    answered: bool
    text: str
    seconds: float


class ServiceRest:
    """Plain HTTP to one service with the run's headers (holds secrets: never log its headers)."""

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout_s: float = 10.0):
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers)
        self.timeout_s = timeout_s

    def _send(self, method: str, path: str, body: JsonObject | None, timeout_s: float | None) -> RawResponse:
        """One request, no retries; an HTTP error status is returned as it came. Transport failures
        raise httpx's errors (ConnectError, TimeoutException)."""
        with httpx.Client(timeout=timeout_s or self.timeout_s, follow_redirects=False) as client:
            resp = client.request(method, self.base_url + path, headers=self._headers, json=body)
        return raw_response(resp)

    def get(self, path: str, timeout_s: float | None = None) -> RawResponse:
        return self._send("GET", path, None, timeout_s)

    def post(self, path: str, body: JsonObject, timeout_s: float | None = None) -> RawResponse:
        return self._send("POST", path, body, timeout_s)

    def unload(self, model_id: str, timeout_s: float) -> UnloadOutcome:
        """POST unload_model (the body of the SDK's `UnloadModelRequest`), then its future, both
        within `timeout_s`; never raises."""
        from tinker.types import UnloadModelRequest  # the SDK's request type: releases only

        t0 = time.monotonic()

        def outcome(answered: bool, text: str) -> UnloadOutcome:
            return UnloadOutcome(model_id, answered, text, round(time.monotonic() - t0, 3))

        body: JsonObject = UnloadModelRequest(model_id=model_id).model_dump(mode="json")
        try:
            sent = self.post(UNLOAD_MODEL_PATH, body, timeout_s)
            if sent.status != 200 or not isinstance(sent.json, Mapping) or "request_id" not in sent.json:
                return outcome(False, f"unload_model answered HTTP {sent.status}: {_text(sent.json)}")
            request_id = sent.json["request_id"]
            while True:
                left = timeout_s - (time.monotonic() - t0)
                if left <= 0:
                    return outcome(False, f"unload_model's future did not resolve within {timeout_s:g} s")
                polled = self.post(RETRIEVE_FUTURE_PATH, {"request_id": request_id}, max(0.5, min(left, 30.0)))
                pending = polled.status == 408 or (
                    isinstance(polled.json, Mapping) and polled.json.get("type") == "try_again"
                )
                if pending:
                    time.sleep(min(0.2, max(0.0, left)))
                    continue
                if polled.status != 200:
                    return outcome(False, f"retrieve_future answered HTTP {polled.status}: {_text(polled.json)}")
                if isinstance(polled.json, Mapping) and "error" in polled.json:
                    return outcome(False, f"unload_model failed: {_text(polled.json)}")
                return outcome(True, _text(polled.json))
        except httpx.HTTPError as exc:
            return outcome(False, f"unload_model got no answer within {timeout_s:g} s ({type(exc).__name__}: {exc})")


def _text(payload: JsonValue) -> str:
    """The service's own words of an answer: `error`/`message` when it sent them, else the body."""
    if isinstance(payload, Mapping):
        said = [str(payload[k]) for k in ("error", "message", "detail") if k in payload]
        if said:
            return "; ".join(dict.fromkeys(said))
    return str(payload)[:500]

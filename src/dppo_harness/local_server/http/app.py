"""aiohttp app speaking the Tinker SDK 0.25 wire protocol over a local `Engine`.

Protocol (read from the SDK source, see docs/local-server.md "HTTP side"):
- JSON requests are validated into the SDK's own pydantic request types (`tinker.types`) and
  answers are built from its response types, so the server cannot drift from the pinned SDK; a
  request that does not validate gets HTTP 400 naming the field.
- Work endpoints answer at once with an `UntypedAPIFuture` (`{"request_id": ...}`); the SDK then
  long-polls `POST /api/v1/retrieve_future` (tinker/lib/api_future_impl.py). Pending -> HTTP 408
  `{"type": "try_again", ...}` (the SDK re-polls at once); failure -> 200
  `{"error": ..., "category": "user"|"server"}` (the SDK raises `RequestFailedError`); success ->
  JSON, or protobuf for `ForwardBackwardOutput` and `SampleResponse` (SDK 0.25 refuses JSON for
  those two, tinker/proto/response_conv.py PROTO_SUPPORTED_TYPES; the SDK ships no encoder).
- `forward_backward` requests arrive as protobuf (`forward_only` distinguishes `forward`),
  zstd-compressed (`Content-Encoding: zstd`) when client/config says `proto_compress_fwdbwd`.
- Requests on one training model run strictly in `seq_id` order on that model's own worker
  thread; sampling runs on a shared thread pool so concurrent samples overlap.
- Every response carries the embedded-server marker header; one log line per request.
- The `spindle` profile (docs/local-server.md "Spindle profile"): the research exchange's front
  door checks Modal-Key / Modal-Secret on every request (401 naming the header, never a value);
  then, on a route Spindle has, Spindle's own X-API-Key check (401 `{"error": "unauthorized",
  "message": "unauthorized"}`, src/spindle/control_plane/http.py `authorize`); routes Spindle lacks
  are not registered and answer FastAPI's 404 `{"detail": "Not Found"}`; errors are in Spindle's
  `{"error": <code>, "message": <text>}` shape (http/spindle.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time

from aiohttp import web
from aiohttp.typedefs import Handler
from tinker import types

from dppo_harness import constants
from dppo_harness.local_server.errors import SpindleError, UserError
from dppo_harness.local_server.http import spindle
from dppo_harness.local_server.http.codecs import API, ProtocolError, dump, kind_of
from dppo_harness.local_server.http.handlers_futures import cancel_future, retrieve_future
from dppo_harness.local_server.http.handlers_rest import (
    checkpoint_archive,
    get_training_run,
    list_checkpoints,
    list_training_runs,
    list_user_checkpoints,
    weights_info,
)
from dppo_harness.local_server.http.handlers_sampling import asample, create_sampling_session, get_sampler
from dppo_harness.local_server.http.handlers_service import (
    capabilities,
    client_config,
    client_dynamic_config,
    create_session,
    deployments,
    get_session,
    healthz,
    session_heartbeat,
    stats,
    telemetry,
)
from dppo_harness.local_server.http.handlers_training import (
    create_model,
    forward_backward,
    get_info,
    load_weights,
    optim_step,
    save_weights,
    save_weights_for_sampler,
    unload_model,
)
from dppo_harness.local_server.http.state import STATE_KEY, ServerState, state_of
from dppo_harness.local_server.http.work import error_json

request_log = logging.getLogger("dppo_harness.local_server.requests")

FAULT_EXIT_CODE = 75
# On shutdown, in-flight handlers get this long before they are cancelled (aiohttp's default is
# 60 s). The only ones left are long polls of retrieve_future (up to 20 s each) whose clients are
# gone; engine work runs in its own threads and is not waited on here either way.
SHUTDOWN_GRACE_S = 1.0


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[_log_requests, _authenticate, _spindle_gate, _faults_and_errors],
        client_max_size=512 * 1024 * 1024,
    )
    app[STATE_KEY] = state
    app.on_response_prepare.append(_add_marker)
    is_spindle = state.profile.is_spindle
    if is_spindle:
        app.on_startup.append(_start_sweep)
        app.on_cleanup.append(_stop_sweep)
    r = app.router
    r.add_get(f"{API}/healthz", healthz)
    r.add_get(f"{API}/get_server_capabilities", capabilities)
    r.add_post(f"{API}/client/config", client_config)
    r.add_post(f"{API}/client/dynamic_config", client_dynamic_config)
    r.add_post(f"{API}/create_session", create_session)
    r.add_post(f"{API}/session_heartbeat", session_heartbeat)
    r.add_post(f"{API}/telemetry", telemetry)
    if not is_spindle:  # Spindle has no session read (nor a session finish)
        r.add_get(f"{API}/sessions/{{session_id}}", get_session)
    r.add_post(f"{API}/create_model", create_model)
    r.add_post(f"{API}/get_info", get_info)
    r.add_post(f"{API}/unload_model", unload_model)
    r.add_post(f"{API}/forward_backward", forward_backward)
    r.add_post(f"{API}/optim_step", optim_step)
    r.add_post(f"{API}/save_weights", save_weights)
    r.add_post(f"{API}/load_weights", load_weights)
    r.add_post(f"{API}/save_weights_for_sampler", save_weights_for_sampler)
    r.add_post(f"{API}/create_sampling_session", create_sampling_session)
    r.add_get(f"{API}/samplers/{{sampler_id}}", get_sampler)
    r.add_post(f"{API}/asample", asample)
    r.add_post(f"{API}/retrieve_future", retrieve_future)
    if not is_spindle:  # Spindle cannot cancel a request
        r.add_post(f"{API}/cancel_future", cancel_future)
    # REST reads (RestClient; the cookbook's checkpoint_utils)
    r.add_get(f"{API}/training_runs", list_training_runs)
    r.add_get(f"{API}/training_runs/{{model_id}}", get_training_run)
    r.add_get(f"{API}/training_runs/{{model_id}}/checkpoints", list_checkpoints)
    if not is_spindle:  # Spindle lists checkpoints per training run only
        r.add_get(f"{API}/checkpoints", list_user_checkpoints)
    r.add_post(f"{API}/weights_info", weights_info)
    if is_spindle:
        r.add_get(f"{API}/spindle/deployments", deployments)
        r.add_get(f"{API}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:.+}}/archive", checkpoint_archive)
    r.add_get("/_harness/stats", stats)
    return app


async def _add_marker(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[constants.EMBEDDED_SERVER_HEADER] = constants.EMBEDDED_SERVER_MARKER


@web.middleware
async def _log_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One line per request: method, path, status, milliseconds (never headers or bodies)."""
    t0 = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        request_log.info("%s %s %d %.1fms", request.method, request.path, status, (time.perf_counter() - t0) * 1e3)


SWEEP_KEY: web.AppKey[asyncio.Task[None]] = web.AppKey("sweep", asyncio.Task)


async def _start_sweep(app: web.Application) -> None:
    app[SWEEP_KEY] = asyncio.get_running_loop().create_task(spindle.sweep_forever(app[STATE_KEY]))


async def _stop_sweep(app: web.Application) -> None:
    task = app.get(SWEEP_KEY)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@web.middleware
async def _authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The research exchange's front door in front of Spindle (spindle profile): Modal-Key and
    Modal-Secret on every request, before any route is looked at. Not Spindle's own check."""
    problem = state_of(request).profile.auth_error(request.headers)
    if problem is not None:
        return error_json(problem, 401)
    return await handler(request)


@web.middleware
async def _spindle_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Spindle itself (spindle profile): a route it lacks answers FastAPI's 404 before any key check;
    then X-API-Key must equal TINKER_API_KEY (src/spindle/control_plane/http.py, `authorize`)."""
    state = state_of(request)
    if not state.profile.is_spindle:
        return await handler(request)
    unmatched = request.match_info.http_exception
    if unmatched is not None:
        if unmatched.status == 405:
            allowed = getattr(unmatched, "allowed_methods", ())
            return web.json_response(
                spindle.METHOD_NOT_ALLOWED_BODY, status=405, headers={"Allow": ", ".join(sorted(allowed))}
            )
        return web.json_response(spindle.NOT_FOUND_BODY, status=unmatched.status)
    if not state.profile.api_key_ok(request.headers):
        return spindle.error_json(401, "unauthorized", "unauthorized")
    return await handler(request)


@web.middleware
async def _faults_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = state_of(request)
    if request.path.startswith("/_harness/"):
        return await handler(request)
    kind = kind_of(request.path)
    state.headers.record(request.headers)
    decision = state.faults.decide(kind, counts_toward_death=kind != "healthz")
    if decision.die:
        message = (
            f"local server: fault injection: exiting after "
            f"{state.faults.config.die_after} API requests (request {kind})"
        )
        if state.on_die is not None:
            state.on_die(message)
            raise web.HTTPServiceUnavailable(text=message)
        print(message, file=sys.stderr, flush=True)
        if state.stats_path is not None:
            with contextlib.suppress(OSError):
                state.stats_path.write_text(json.dumps(state.stats(), indent=1))
        os._exit(FAULT_EXIT_CODE)
    if decision.latency_s:
        await asyncio.sleep(decision.latency_s)  # non-blocking: concurrent requests overlap
    if decision.reject_status is not None:
        headers = {}
        if state.faults.config.retry_after_ms is not None:
            headers["retry-after-ms"] = str(state.faults.config.retry_after_ms)
        if state.profile.is_spindle:
            response = spindle.injected_rejection(decision.reject_status, decision.reject_reason)
            response.headers.update(headers)
            return response
        rejection = dump(
            types.RequestFailedResponse(error=decision.reject_reason, category=types.RequestErrorCategory.Server)
        )
        return web.json_response(rejection, status=decision.reject_status, headers=headers)
    try:
        return await handler(request)
    except SpindleError as exc:
        return spindle.error_json(exc.status, exc.code, exc.message)
    except (ProtocolError, UserError) as exc:
        if state.profile.is_spindle:  # Spindle's ValueError / RequestValidationError: 400 invalid_request
            return spindle.error_json(400, "invalid_request", f"{kind}: {exc}")
        return error_json(f"{kind}: {exc}", 400)

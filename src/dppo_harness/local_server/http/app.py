"""aiohttp app speaking the Tinker SDK 0.25 wire protocol over a local `Engine` (docs/local-server.md
"HTTP protocol"), and the socket that serves it (`run_server` is the CLI's whole server;
`start_site` serves one in the test process). JSON requests validate into the SDK's own request
types and answers are built from its response types, so the server cannot drift from the pinned SDK.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler
from tinker import types

from dppo_harness import constants
from dppo_harness.local_server.engine.engine import DEFAULT_PRESET, Engine
from dppo_harness.local_server.errors import SpindleError, UserError
from dppo_harness.local_server.faults import FaultConfig, FaultInjector, HeaderRecorder
from dppo_harness.local_server.http import handlers, spindle
from dppo_harness.local_server.http.codecs import API, ProtocolError, dump
from dppo_harness.local_server.http.state import STATE_KEY, ServerState, error_json, log
from dppo_harness.local_server.profiles import Profile

request_log = logging.getLogger("dppo_harness.local_server.requests")

FAULT_EXIT_CODE = 75
STATS_FILE = "server_stats.json"
# On shutdown, in-flight handlers get this long before they are cancelled (aiohttp's default is
# 60 s). The only ones left are long polls of retrieve_future (up to 20 s each) whose clients are
# gone; engine work runs in its own threads and is not waited on here either way.
SHUTDOWN_GRACE_S = 1.0
POSTS = (
    "create_session session_heartbeat telemetry create_model get_info unload_model forward_backward optim_step "
    "save_weights load_weights save_weights_for_sampler create_sampling_session asample retrieve_future weights_info"
)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[_log_requests, _spindle_gate, _faults_and_errors],
        client_max_size=512 * 1024 * 1024,
    )
    app[STATE_KEY] = state
    app.on_response_prepare.append(_add_marker)
    is_spindle = state.profile.is_spindle
    if is_spindle:
        app.cleanup_ctx.append(_idle_sweep)
    # Each route is named for its handler: the name is the request's kind for faults and counters.
    posts = {name: name for name in POSTS.split()} | {
        "client_config": "client/config",
        "client_dynamic_config": "client/dynamic_config",
    }
    gets = {
        "healthz": "healthz",
        "get_server_capabilities": "get_server_capabilities",
        "get_sampler": "samplers/{sampler_id}",
        "get_training_run": "training_runs/{model_id}",
        "list_checkpoints": "training_runs/{model_id}/checkpoints",
    }
    if is_spindle:  # Spindle's own routes
        gets["deployments"] = "spindle/deployments"
        gets["checkpoint_archive"] = "training_runs/{model_id}/checkpoints/{checkpoint_id:.+}/archive"
    for name, path in posts.items():
        app.router.add_post(f"{API}/{path}", getattr(handlers, name), name=name)
    for name, path in gets.items():
        app.router.add_get(f"{API}/{path}", getattr(handlers, name), name=name)
    app.router.add_get("/_harness/stats", handlers.stats)
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


async def _idle_sweep(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.get_running_loop().create_task(spindle.sweep_forever(app[STATE_KEY]))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@web.middleware
async def _spindle_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The spindle profile: first the research exchange's front door (Modal-Key and Modal-Secret on
    every request, before any route is looked at; not Spindle's own check), then Spindle itself: a
    route it lacks answers FastAPI's 404 before any key check; then X-API-Key must equal
    TINKER_API_KEY (src/spindle/control_plane/http.py, `authorize`)."""
    profile = request.app[STATE_KEY].profile
    if not profile.is_spindle:
        return await handler(request)
    problem = profile.auth_error(request.headers)
    if problem is not None:
        return error_json(problem, 401)
    unmatched = request.match_info.http_exception
    if unmatched is not None:
        if unmatched.status == 405:
            allowed = ", ".join(sorted(getattr(unmatched, "allowed_methods", ())))
            return web.json_response(spindle.METHOD_NOT_ALLOWED_BODY, status=405, headers={"Allow": allowed})
        return web.json_response(spindle.NOT_FOUND_BODY, status=unmatched.status)
    if not profile.api_key_ok(request.headers):
        return spindle.error_json(401, "unauthorized", "unauthorized")
    return await handler(request)


@web.middleware
async def _faults_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    if request.path.startswith("/_harness/"):
        return await handler(request)
    kind = request.match_info.route.name or request.path.removeprefix(API).strip("/").replace("/", "_")
    state.headers.record(request.headers)
    decision = state.faults.decide(kind, counts_toward_death=kind != "healthz")
    if decision.die:
        message = f"local server: fault injection: exiting after {state.faults.config.die_after} API requests (request {kind})"
        print(message, file=sys.stderr, flush=True)
        if state.stats_path is not None:
            with contextlib.suppress(OSError):
                state.stats_path.write_text(json.dumps(state.stats(), indent=1))
        os._exit(FAULT_EXIT_CODE)
    if decision.latency_s:
        await asyncio.sleep(decision.latency_s)  # non-blocking: concurrent requests overlap
    if decision.reject_status is not None:
        retry_ms = state.faults.config.retry_after_ms
        headers = {} if retry_ms is None else {"retry-after-ms": str(retry_ms)}
        if state.profile.is_spindle:
            response = spindle.injected_rejection(decision.reject_status, decision.reject_reason)
            response.headers.update(headers)
            return response
        rejection = types.RequestFailedResponse(
            error=decision.reject_reason, category=types.RequestErrorCategory.Server
        )
        return web.json_response(dump(rejection), status=decision.reject_status, headers=headers)
    try:
        return await handler(request)
    except SpindleError as exc:
        return spindle.error_json(exc.status, exc.code, exc.message)
    except (ProtocolError, UserError) as exc:
        if state.profile.is_spindle:  # Spindle's ValueError / RequestValidationError: 400 invalid_request
            return spindle.error_json(400, "invalid_request", f"{kind}: {exc}")
        return error_json(f"{kind}: {exc}", 400)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` (port 0: a free one) and listening."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


async def start_site(state: ServerState, sock: socket.socket) -> web.AppRunner:
    """The app over `state`, serving on the listening `sock`; the runner's cleanup stops it."""
    # auto_decompress=False: request bodies reach the handlers as sent. aiohttp's own parser would
    # inflate a `Content-Encoding: zstd` body only with backports.zstd installed (400 otherwise);
    # forward_backward inflates SDK 0.25's zstd bodies itself (codecs.decode_fwdbwd_request).
    runner = web.AppRunner(
        build_app(state),
        access_log=None,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        auto_decompress=False,
    )
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


async def run_server(args: argparse.Namespace, faults: FaultConfig, run_dir: Path, profile: Profile) -> None:
    """Build the engine, serve it until SIGTERM/SIGINT, then write the stats file and shut down.
    The ready line goes to stdout once the socket accepts connections."""
    t0 = time.perf_counter()
    try:
        engine = await asyncio.to_thread(Engine, run_dir, args.model or DEFAULT_PRESET, num_threads=args.threads)
    except UserError as exc:  # an unknown --model
        raise SystemExit(str(exc)) from None
    state = ServerState(
        engine,
        FaultInjector(faults),
        HeaderRecorder(faults.record_header_values),
        profile=profile,
        stats_path=run_dir / STATS_FILE,
    )
    sock = listening_socket(args.host, args.port)
    runner = await start_site(state, sock)
    host = f"[{args.host}]" if sock.family == socket.AF_INET6 else args.host
    log.info(
        "engine %s ready in %.1fs (warm start: %s); profile %s; run dir %s",
        engine.model_name,
        time.perf_counter() - t0,
        engine.base_info.get("source"),
        profile.name,
        run_dir,
    )
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    (run_dir / STATS_FILE).write_text(json.dumps(state.stats(), indent=1))
    await runner.cleanup()
    state.shutdown()

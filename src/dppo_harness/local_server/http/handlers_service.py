"""Service handlers: health, capabilities, client configuration, sessions (create, heartbeat,
read), telemetry, and the harness's own stats endpoint."""

from __future__ import annotations

import time
import uuid

from aiohttp import web
from pydantic import JsonValue
from tinker import types

from dppo_harness.local_server.http.codecs import dump, parse_request
from dppo_harness.local_server.http.state import SessionEntry, session_of, state_of, str_metadata
from dppo_harness.local_server.http.work import parse_body
from dppo_harness.local_server.profiles import capabilities_of, spindle_deployments

MAX_TELEMETRY_BODIES = 1000


async def healthz(request: web.Request) -> web.Response:
    return web.json_response(dump(types.HealthResponse(status="ok")))


async def stats(request: web.Request) -> web.Response:
    return web.json_response(state_of(request).stats())


async def capabilities(request: web.Request) -> web.Response:
    state = state_of(request)
    max_ctx = state.engine.config.max_position_embeddings
    if state.profile.is_spindle:
        # One entry per deployed base model, no parameterization (src/spindle/control_plane/deployments.py).
        listed: list[JsonValue] = list(capabilities_of(spindle_deployments(max_ctx)))
        return web.json_response(
            state.faults.omit_json(
                "get_server_capabilities", {"supported_models": listed, "embedded_server": state.marker()}
            )
        )
    response = types.GetServerCapabilitiesResponse(
        supported_models=[
            types.SupportedModel(model_name=name, max_context_length=max_ctx) for name in state.served_models()
        ]
    )
    # Extra key (the SDK's type ignores it): who is really answering.
    return web.json_response(
        state.faults.omit_json("get_server_capabilities", dump(response) | {"embedded_server": state.marker()})
    )


async def deployments(request: web.Request) -> web.Response:
    """`GET spindle/deployments` (spindle profile): every deployed definition with its name, id, base
    model, parameterization and context (src/spindle/control_plane/http.py, `list_deployments`)."""
    state = state_of(request)
    listing = [d.listing() for d in spindle_deployments(state.engine.config.max_position_embeddings)]
    return web.json_response({"deployments": listing})


async def client_config(request: web.Request) -> web.Response:
    """The feature flags SDK 0.25 reads once per client (tinker/types/client_config_response.py),
    per profile (`Profile.client_config`); keys its type does not know are ignored by the SDK."""
    return web.json_response(state_of(request).profile.client_config())


async def client_dynamic_config(request: web.Request) -> web.Response:
    # SDK 0.25's dynamic config carries only its own refresh interval.
    return web.json_response(dump(types.ClientDynamicConfigResponse(refresh_interval_sec=300)))


async def create_session(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.CreateSessionRequest)
    session_id = str(uuid.uuid4())
    state.sessions[session_id] = SessionEntry(
        created=time.time(),
        last_heartbeat=time.time(),
        sdk_version=req.sdk_version,
        tags=list(req.tags),
        user_metadata=str_metadata(req.user_metadata),
    )
    return web.json_response(dump(types.CreateSessionResponse(session_id=session_id)))


async def session_heartbeat(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.SessionHeartbeatRequest)
    session = session_of(state, req.session_id)
    session.last_heartbeat = time.time()
    return web.json_response(dump(types.SessionHeartbeatResponse()))


async def telemetry(request: web.Request) -> web.Response:
    raw = await request.read()
    req = parse_request(types.TelemetrySendRequest, raw)
    state = state_of(request)
    state.telemetry_events += len(req.events)
    if len(state.telemetry_bodies) < MAX_TELEMETRY_BODIES:
        state.telemetry_bodies.append(raw)
    return web.json_response(dump(types.TelemetryResponse(status="accepted")))


async def get_session(request: web.Request) -> web.Response:
    state = state_of(request)
    session_id = request.match_info["session_id"]
    session_of(state, session_id)
    return web.json_response(
        dump(
            types.GetSessionResponse(
                training_run_ids=[m for m, e in state.models.items() if e.session_id == session_id],
                sampler_ids=[s for s in state.samplers if s.startswith(session_id)],
            )
        )
    )

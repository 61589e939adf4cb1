"""Service handlers: health, capabilities, client configuration, sessions (create, heartbeat,
finish, read), telemetry, and the harness's own stats endpoint."""

from __future__ import annotations

import time
import uuid

import pydantic
from aiohttp import web
from tinker import types
from tinker.types.session_status import ClientSessionFinishReason

from dppo_harness.local_server.http.codecs import dump, parse_request
from dppo_harness.local_server.http.state import SessionEntry, session_of, state_of, str_metadata
from dppo_harness.local_server.http.work import error_json, parse_body

MAX_TELEMETRY_BODIES = 1000


class FinishSessionRequest(pydantic.BaseModel):
    """Body of `POST sessions/{id}/finish` (the SDK posts it untyped; its parts are SDK types)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    reason: ClientSessionFinishReason
    detail: str | None = None


async def healthz(request: web.Request) -> web.Response:
    return web.json_response(dump(types.HealthResponse(status="ok")))


async def stats(request: web.Request) -> web.Response:
    return web.json_response(state_of(request).stats())


async def capabilities(request: web.Request) -> web.Response:
    state = state_of(request)
    config = getattr(state.engine, "config", None)
    max_ctx = getattr(config, "max_position_embeddings", None)
    response = types.GetServerCapabilitiesResponse(
        supported_models=[
            types.SupportedModel(model_name=name, max_context_length=max_ctx, trainable=True, sampleable=True)
            for name in state.served_models()
        ]
    )
    # Extra key (the SDK's type ignores it): who is really answering.
    return web.json_response(
        state.faults.omit_json("get_server_capabilities", dump(response) | {"embedded_server": state.marker()})
    )


async def client_config(request: web.Request) -> web.Response:
    # API-key auth, httpx transport, uncompressed protobuf, client-side custom losses,
    # per-request retrieve_future polling (unless a fault profile asks for the session poller):
    # the simplest paths of SDK 0.38.
    return web.json_response(
        dump(
            types.ClientConfigResponse(
                pjwt_auth_enabled=False,
                credential_default_source="api_key",
                use_pyqwest_transport=False,
                proto_compress_fwdbwd=False,
                parallel_fwdbwd_chunks=True,
                sample_use_retrieve_futures=state_of(request).faults.config.sample_use_retrieve_futures,
                custom_loss_server_side=False,
                sample_join_sampling_session=False,
            )
        )
    )


async def client_dynamic_config(request: web.Request) -> web.Response:
    # sample_cancel_enabled: the SDK sends cancel_future for a sample whose wait was abandoned
    return web.json_response(
        dump(types.ClientDynamicConfigResponse(refresh_interval_sec=300, sample_cancel_enabled=True))
    )


async def create_session(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.CreateSessionRequest)
    session_id = str(uuid.uuid4())
    state.sessions[session_id] = SessionEntry(
        created=time.time(),
        last_heartbeat=time.time(),
        finished=None,
        sdk_version=req.sdk_version,
        tags=list(req.tags),
        user_metadata=str_metadata(req.user_metadata),
        display_name=req.display_name,
    )
    return web.json_response(dump(types.CreateSessionResponse(session_id=session_id)))


async def session_heartbeat(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.SessionHeartbeatRequest)
    session = session_of(state, req.session_id)
    if session.finished is not None:
        return error_json("session is finished", 410)
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


async def finish_session(request: web.Request) -> web.Response:
    state = state_of(request)
    session = session_of(state, request.match_info["session_id"])
    req = await parse_body(request, FinishSessionRequest)
    if session.finished is None:  # first reason wins
        session.finished = req.reason.type
    drop = getattr(state.engine, "drop_retained", None)
    for entry in list(state.models.values()):
        if drop is not None and entry.session_id == request.match_info["session_id"]:
            drop(entry.engine_id)  # a finished session sends no second pass
    return web.json_response({})


async def get_session(request: web.Request) -> web.Response:
    state = state_of(request)
    session_id = request.match_info["session_id"]
    session = session_of(state, session_id)
    return web.json_response(
        dump(
            types.GetSessionResponse(
                training_run_ids=[m for m, e in state.models.items() if e.session_id == session_id],
                sampler_ids=[s for s in state.samplers if s.startswith(session_id)],
                user_metadata=session.user_metadata,
                display_name=session.display_name,
            )
        )
    )

"""Future handlers: `retrieve_future` long-polls (408 try_again while pending) and `cancel_future`."""

from __future__ import annotations

import asyncio

from aiohttp import web
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from dppo_harness.local_server.errors import SpindleError
from dppo_harness.local_server.http import spindle
from dppo_harness.local_server.http.codecs import dump
from dppo_harness.local_server.http.state import Outcome, state_of
from dppo_harness.local_server.http.work import error_json, parse_body

LONG_POLL_S = 20.0  # the SDK's retrieve_future timeout is 45 s
PAUSED_POLL_S = 1.0  # a paused request's polls are held this long (the SDK re-polls a 408 at once)


async def retrieve_future(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.FutureRetrieveRequest)
    request_id = req.request_id
    fut = state.results.get(request_id)
    if fut is None:
        if state.profile.is_spindle:  # RecordNotFound("future", ...)
            raise SpindleError(404, "not_found", f"future not found: {request_id}")
        return error_json(f"unknown request_id {request_id!r}", 404)
    if state.profile.is_spindle and not fut.done():
        # Every pending poll is 408 try_again, queue_state active, no reason: a cold trainer, a full
        # one and a held request all look alike (src/spindle/control_plane/http.py, retrieve_future).
        window = spindle.CREATION_POLL_S if request_id in state.creation_requests else LONG_POLL_S
        try:
            await asyncio.wait_for(asyncio.shield(fut), window)
        except TimeoutError:
            return web.json_response(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}, status=408
            )
    if not fut.done():
        hold = state.holds.get(fut)
        paused = hold if hold is not None and hold.queue_state != "active" else None
        try:
            await asyncio.wait_for(asyncio.shield(fut), PAUSED_POLL_S if paused is not None else LONG_POLL_S)
        except TimeoutError:
            pending = TryAgainResponse(
                request_id=request_id, queue_state=paused.queue_state if paused is not None else "active"
            )
            # queue_state_reason: sent by the service, read by the SDK, not in its TryAgainResponse type
            reason = paused.poll_reason() if paused is not None else None
            extra = {"queue_state_reason": reason} if reason else {}
            return web.json_response(dump(pending) | extra, status=408)
    outcome: Outcome = fut.result()
    if outcome.kind == "proto":
        return web.Response(body=outcome.payload, content_type="application/x-protobuf")
    if outcome.kind == "error":
        return error_json(str(outcome.payload), 200, outcome.category)
    return web.json_response(outcome.payload)


async def cancel_future(request: web.Request) -> web.Response:
    # Same body shape as retrieve_future ({"request_id"}). A running engine call cannot be
    # interrupted (its result is never fetched); a request a fault still holds ends as cancelled.
    state = state_of(request)
    req = await parse_body(request, types.FutureRetrieveRequest)
    state.cancelled_requests += 1
    fut = state.results.get(req.request_id)
    if fut is not None and not fut.done() and state.holds.pop(fut, None) is not None:
        fut.set_result(Outcome("error", f"request {req.request_id} cancelled by the client", "user"))
    return web.json_response({})

"""What the spindle profile does that the default profile does not, read from Spindle's source
(`modal-projects/spindle`; docs/local-server.md "Spindle profile" lists each rule with its file):
its error shapes, the trainer's cold start and LoRA slots, Miles' refusals at model acceptance and
the idle-session sweep (a trainer that dies is `ServerState.check_lost`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from aiohttp import web
from tinker import types

from dppo_harness.local_server.errors import SpindleError
from dppo_harness.local_server.http.state import Outcome, ServerState, log
from dppo_harness.local_server.profiles import LORA_TARGETS, MAX_LORA_RANK, spindle_deployments

NOT_FOUND_BODY = {"detail": "Not Found"}  # FastAPI's own answers for a route it does not have
METHOD_NOT_ALLOWED_BODY = {"detail": "Method Not Allowed"}  # / a method a route does not take
# Texts Spindle sends (src/spindle/errors.py, control_plane/service.py).
BUFFER_FULL = "engine refused work: operation buffer full"  # EngineSaturated("operation buffer full")
SESSION_CLOSED = "session closed before producing a result"
# A creation's polls are answered at once by Spindle (it re-checks placement per poll); the SDK
# re-polls a 408 at once, so these polls are held this long to keep the client from spinning.
CREATION_POLL_S = 1.0


def error_json(status: int, code: str, message: str) -> web.Response:
    body: dict[str, str] = {"error": code, "message": message}
    if status == 500:  # Spindle's unhandled errors carry an id for its logs
        body["error_id"] = uuid.uuid4().hex
    return web.json_response(body, status=status)


def injected_rejection(status: int, reason: str) -> web.Response:
    """An injected HTTP rejection as Spindle would send it: 429 is a saturated engine (engine/server.py
    `_submit`: "operation buffer full"), 503 an unreachable engine, 401 Spindle's key check."""
    if status == 429:
        return error_json(429, "saturated", BUFFER_FULL)
    if status == 401:
        return error_json(401, "unauthorized", "unauthorized")
    return error_json(status, "engine_unreachable" if status == 503 else "internal", reason)


def lora_refusal(rank: int, seed: int | None, switches: tuple[bool, bool, bool]) -> str | None:
    """Why the Miles backend refuses this LoRA, in its order (rank, seed, targets), or None.
    `switches` are (train_mlp, train_attn, train_unembed) as the SDK names them."""
    if not 0 < rank <= MAX_LORA_RANK:
        return f"accept model: LoRA rank must be between 1 and {MAX_LORA_RANK}"
    if seed is not None:
        return "accept model: Miles multi-LoRA does not support per-model seeds"
    if (switches[1], switches[0], switches[2]) != LORA_TARGETS:
        return (
            "accept model: Miles uses deployment-wide LoRA targets; model train_attn, train_mlp, "
            "and train_unembed must match the deployment"
        )
    return None


def check_creation(req: types.CreateModelRequest) -> None:
    """Spindle's refusals at the create_model POST (control_plane/http.py, create_model): an
    undeployed base model, no lora_config (SDK 0.25 can ask for no other parameterization), and
    LoRA asked of a full-fine-tune-only definition."""
    deployed = spindle_deployments(None)
    if not any(d.base_model == req.base_model for d in deployed):
        raise SpindleError(400, "invalid_request", f"unsupported base_model: {req.base_model}")
    if req.lora_config is None:
        raise SpindleError(400, "invalid_request", "parameterization is required when lora_config is absent")
    if not any(d.base_model == req.base_model and d.parameterization == "lora" for d in deployed):
        raise SpindleError(400, "invalid_request", f"lora parameterization is not available for {req.base_model}")


async def admit_creation(
    state: ServerState, model_id: str, session_id: str, refusal: str | None = None
) -> Outcome | None:
    """Wait (a plainly pending future) until the trainer is up and `model_id` holds one of its LoRA
    slots: None then, or the Outcome the creation fails with (its session reclaimed meanwhile, or
    Miles' `refusal` at acceptance)."""
    settings = state.profile.spindle
    if state.trainer_ready_at is None:  # the first creation starts the trainer
        state.trainer_ready_at = time.monotonic() + settings.cold_start_s
    cold = state.trainer_ready_at - time.monotonic()
    if cold > 0:
        await asyncio.sleep(cold)
    async with state.slot_cond:
        if model_id not in state.slots:
            state.waiting_creations += 1
            try:
                await state.slot_cond.wait_for(lambda: len(state.slots) < settings.trainer_slots)
            finally:
                state.waiting_creations -= 1
            state.slots.add(model_id)
    if session_id not in state.sessions or refusal is not None:
        await state.release_slot(model_id)
        return Outcome("error", SESSION_CLOSED, "server") if refusal is None else Outcome("error", refusal, "user")
    return None


async def reclaim_session(state: ServerState, session_id: str) -> None:
    """Close an idle session: its models are unloaded (slots freed at once), their pending futures
    fail, its samplers and ids are forgotten."""
    state.sessions.pop(session_id, None)
    state.reclaimed_sessions += 1
    for key in [k for k in state.model_requests if k[0] == session_id]:
        state.model_requests.pop(key, None)
    for sampler_id in [s for s in state.samplers if s.startswith(f"{session_id}:")]:
        state.samplers.pop(sampler_id, None)
    entries = [e for e in state.models.values() if e.session_id == session_id]
    for entry in entries:
        state.models.pop(entry.model_id, None)
        state.fail_pending(entry, SESSION_CLOSED)
        await state.release_slot(entry.model_id)
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(entry.executor, state.engine.unload_model, entry.engine_id)
        entry.executor.shutdown(wait=False, cancel_futures=True)
    log.info("idle sweep: session %s reclaimed with %d models", session_id, len(entries))


async def sweep_forever(state: ServerState) -> None:
    """Every sweep interval, reclaim every session not seen for the idle timeout."""
    while True:
        await asyncio.sleep(state.profile.spindle.sweep_interval_s)
        cutoff = time.time() - state.profile.spindle.session_idle_timeout_s
        try:
            for session_id in [sid for sid, seen in state.sessions.items() if seen <= cutoff]:
                await reclaim_session(state, session_id)
        except Exception:
            log.exception("idle sweep failed")

"""What the spindle profile does that the default profile does not, read from Spindle's source
(repository `modal-projects/spindle`; each rule names its file):

- errors in Spindle's shape, `{"error": <code>, "message": <text>}` (control_plane/http.py,
  ERROR_STATUSES and `handle_http_exception`); unknown routes `{"detail": "Not Found"}` (FastAPI);
- the one trainer's cold start and LoRA slots: a creation waits (pending, queue_state active, no
  reason) until the trainer is up and a slot is free (control_plane/service.py `_retrieve_creation`
  / `_place_claimed`; engine/server.py `accept_model` answers False when full);
- Miles multi-LoRA's refusals at model acceptance (backends/miles_lora.py `_validate_job`, wrapped
  as "accept model: ..." by engine/server.py `_run_accept`; a failed future, category user);
- a trainer that dies (control_plane/service.py `engine_for` / `retrieve`): submits answer 410
  model_lost, pending futures fail "engine terminated before producing a result";
- the idle-session sweep (control_plane/service.py `sweep_idle_sessions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from aiohttp import web
from tinker import types

from dppo_harness.local_server.errors import SpindleError
from dppo_harness.local_server.http.state import ModelEntry, Outcome, ServerState
from dppo_harness.local_server.profiles import LORA_TARGETS, MAX_LORA_RANK, spindle_deployments

log = logging.getLogger("dppo_harness.local_server")

# FastAPI's own answers for a route it does not have / a method a route does not take.
NOT_FOUND_BODY = {"detail": "Not Found"}
METHOD_NOT_ALLOWED_BODY = {"detail": "Method Not Allowed"}
# Texts Spindle sends (src/spindle/errors.py, control_plane/service.py).
CAPACITY_REFUSED = "engine refused work: trainer capacity exhausted"  # EngineSaturated("trainer capacity exhausted")
BUFFER_FULL = "engine refused work: operation buffer full"  # EngineSaturated("operation buffer full")
ENGINE_TERMINATED = "engine terminated before producing a result"
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
    if status == 503:
        return error_json(503, "engine_unreachable", reason)
    return error_json(status, "internal", reason)


def model_not_found(model_id: str | None) -> SpindleError:
    return SpindleError(404, "not_found", f"model not found: {model_id}")  # RecordNotFound("model", ...)


# ---- model acceptance (Miles multi-LoRA) --------------------------------------------------------


def lora_refusal(rank: int, seed: int | None, switches: tuple[bool, bool, bool]) -> str | None:
    """Why the Miles backend refuses this LoRA, in its order (rank, seed, targets), or None.
    `switches` are (train_mlp, train_attn, train_unembed) as the SDK names them."""
    if not 0 < rank <= MAX_LORA_RANK:
        return f"accept model: LoRA rank must be between 1 and {MAX_LORA_RANK}"
    if seed is not None:
        return "accept model: Miles multi-LoRA does not support per-model seeds"
    train_mlp, train_attn, train_unembed = switches
    if (train_attn, train_mlp, train_unembed) != LORA_TARGETS:
        return (
            "accept model: Miles uses deployment-wide LoRA targets; model train_attn, train_mlp, "
            "and train_unembed must match the deployment"
        )
    return None


# ---- the trainer: cold start and LoRA slots -----------------------------------------------------


def check_creation(req: types.CreateModelRequest) -> None:
    """Spindle's refusals at the create_model POST (src/spindle/control_plane/http.py, create_model):
    an undeployed base model, no lora_config (SDK 0.25 can ask for no other parameterization), and
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
    """Wait until the trainer is up and `model_id` holds one of its LoRA slots: None then, or the
    Outcome the creation fails with: the trainer full (--fault-trainer-full-refuse), the session
    reclaimed meanwhile, or Miles' `refusal` at acceptance (`lora_refusal`). Meanwhile the
    creation's future is plainly pending, so its polls say queue_state active with no reason."""
    settings = state.profile.spindle
    if state.trainer_ready_at is None:  # the first creation starts the trainer
        state.trainer_ready_at = time.monotonic() + settings.cold_start_s
    cold = state.trainer_ready_at - time.monotonic()
    if cold > 0:
        await asyncio.sleep(cold)
    async with state.slot_cond:
        if model_id not in state.slots:
            if len(state.slots) >= settings.trainer_slots and state.faults.config.trainer_full_refuse:
                state.faults.injected["create_model:trainer_full_refuse"] += 1
                return Outcome("error", CAPACITY_REFUSED, "server")
            state.waiting_creations += 1
            try:
                await state.slot_cond.wait_for(lambda: len(state.slots) < settings.trainer_slots)
            finally:
                state.waiting_creations -= 1
            state.slots.add(model_id)
    if session_id not in state.sessions:
        await release_slot(state, model_id)
        return Outcome("error", SESSION_CLOSED, "server")
    if refusal is not None:
        await release_slot(state, model_id)
        return Outcome("error", refusal, "user")
    return None


async def release_slot(state: ServerState, model_id: str) -> None:
    async with state.slot_cond:
        state.slots.discard(model_id)
        state.slot_cond.notify_all()


def release_slot_soon(state: ServerState, model_id: str) -> None:
    task = asyncio.get_running_loop().create_task(release_slot(state, model_id))
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)


# ---- a trainer that dies ------------------------------------------------------------------------


def _fail_pending(state: ServerState, entry: ModelEntry, message: str) -> int:
    failed = 0
    for request_id in entry.requests_by_seq.values():
        fut = state.results.get(request_id)
        if fut is not None and not fut.done():
            state.holds.pop(fut, None)
            fut.set_result(Outcome("error", message, "server"))
            failed += 1
    return failed


def check_submit(state: ServerState, entry: ModelEntry, label: str) -> None:
    """Before a submit on `entry` is accepted: 410 model_lost once the model's trainer is gone
    (--fault-model-lost decides when; control_plane/service.py `engine_for` raises ModelLost)."""
    if not entry.lost and state.faults.model_lost_now(label):
        entry.lost = True
        failed = _fail_pending(state, entry, ENGINE_TERMINATED)
        release_slot_soon(state, entry.model_id)
        log.info("fault: trainer of model %s lost at %s (%d pending futures failed)", entry.model_id, label, failed)
    if entry.lost:
        raise SpindleError(410, "model_lost", f"engine owning model {entry.model_id} terminated")


# ---- the idle-session sweep ---------------------------------------------------------------------


def touch_session(state: ServerState, session_id: str) -> None:
    """Spindle counts any request on a session's models as the session being seen (`_touch_session`)."""
    session = state.sessions.get(session_id)
    if session is not None:
        session.last_heartbeat = time.time()


async def reclaim_session(state: ServerState, session_id: str) -> list[str]:
    """Close an idle session: its models are unloaded (slots freed at once), their pending futures
    fail, its samplers and ids are forgotten. Returns the reclaimed model ids."""
    state.sessions.pop(session_id, None)
    state.reclaimed_sessions += 1
    for key in [k for k in state.model_requests if k[0] == session_id]:
        state.model_requests.pop(key, None)
    for sampler_id in [s for s in state.samplers if s.startswith(f"{session_id}:")]:
        state.samplers.pop(sampler_id, None)
    reclaimed = []
    for entry in [e for e in state.models.values() if e.session_id == session_id]:
        state.models.pop(entry.model_id, None)
        _fail_pending(state, entry, SESSION_CLOSED)
        await release_slot(state, entry.model_id)
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(entry.executor, state.engine.unload_model, entry.engine_id)
        entry.executor.shutdown(wait=False, cancel_futures=True)
        reclaimed.append(entry.model_id)
    log.info("idle sweep: session %s reclaimed with %d models", session_id, len(reclaimed))
    return reclaimed


async def sweep_once(state: ServerState) -> list[str]:
    """Reclaim every session not seen for the idle timeout; returns their ids."""
    cutoff = time.time() - state.profile.spindle.session_idle_timeout_s
    idle = [sid for sid, s in state.sessions.items() if s.last_heartbeat <= cutoff]
    for session_id in idle:
        await reclaim_session(state, session_id)
    return idle


async def sweep_forever(state: ServerState) -> None:
    while True:
        await asyncio.sleep(state.profile.spindle.sweep_interval_s)
        try:
            await sweep_once(state)
        except Exception:
            log.exception("idle sweep failed")

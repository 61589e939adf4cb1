"""Work execution: engine calls on worker threads (timed into the stats), background futures,
per-model `seq_id` ordering, and the JSON answers shared by the handlers."""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from aiohttp import web
from tinker import types

from dppo_harness.local_server.errors import SpindleError, UserError
from dppo_harness.local_server.faults import CAPACITY_EXHAUSTED_TEXT
from dppo_harness.local_server.http import spindle
from dppo_harness.local_server.http.codecs import RequestT, dump, parse_request
from dppo_harness.local_server.http.state import ModelEntry, Outcome, ServerState, utc_now

log = logging.getLogger("dppo_harness.local_server")
# One line per engine call: what ran, its wall and process CPU seconds (benchmarks read them).
engine_log = logging.getLogger("dppo_harness.local_server.engine")

T = TypeVar("T")

SEQ_GAP_TIMEOUT_S = 900.0  # a missing earlier seq_id fails the waiting request after this


def error_json(message: str, status: int, category: str = "user") -> web.Response:
    return web.json_response(
        dump(types.RequestFailedResponse(error=message, category=types.RequestErrorCategory(category))), status=status
    )


def future_json(request_id: str, model_id: str | None = None) -> web.Response:
    return web.json_response(dump(types.UntypedAPIFuture(request_id=request_id, model_id=model_id)))


async def parse_body(request: web.Request, model: type[RequestT]) -> RequestT:
    return parse_request(model, await request.read())


async def run_engine(
    state: ServerState, executor: ThreadPoolExecutor, label: str, fn: Callable[[], T], detail: str = ""
) -> T:
    loop = asyncio.get_running_loop()
    t0, c0 = time.perf_counter(), time.process_time()
    state.inflight += 1
    try:
        return await loop.run_in_executor(executor, fn)
    finally:
        state.inflight -= 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        state.engine_seconds[label] = state.engine_seconds.get(label, 0.0) + wall
        state.engine_cpu_seconds[label] = state.engine_cpu_seconds.get(label, 0.0) + cpu
        state.engine_calls[label] = state.engine_calls.get(label, 0) + 1
        engine_log.info(
            "engine %s %.3fs wall %.3fs cpu (process %.2fs cpu)%s",
            label,
            wall,
            cpu,
            time.process_time(),
            f" {detail}" if detail else "",
        )


def _outcome_of_exception(exc: BaseException, label: str) -> Outcome:
    if isinstance(exc, UserError):
        return Outcome("error", str(exc), "user")
    log.error("engine error in %s:\n%s", label, "".join(traceback.format_exception(exc)))
    return Outcome("error", f"{label} failed on the local server: {type(exc).__name__}: {exc}", "server")


def spawn(
    state: ServerState, fut: asyncio.Future[Outcome], label: str, coro_fn: Callable[[], Awaitable[Outcome]]
) -> None:
    """Run `coro_fn()` in the background and resolve `fut` with its Outcome."""

    async def runner() -> None:
        try:
            hold = state.faults.take_hold(label)
            if hold is not None:  # a queue pause or a request that never completes (fault injection)
                state.holds[fut] = hold
                wait_s = hold.remaining(time.monotonic())
                if wait_s is None:  # held forever
                    await asyncio.Event().wait()
                else:
                    await asyncio.sleep(wait_s)
                state.holds.pop(fut, None)
            outcome = await coro_fn()
        except Exception as exc:
            outcome = _outcome_of_exception(exc, label)
        if outcome.kind == "json" and isinstance(outcome.payload, dict):  # --fault-omit-field: optional
            outcome.payload = state.faults.omit_json(label, outcome.payload)  # fields the service may leave out
        if not fut.done():
            fut.set_result(outcome)

    task = asyncio.get_running_loop().create_task(runner())
    state.tasks.add(task)  # the loop keeps only weak references
    task.add_done_callback(state.tasks.discard)


async def _in_seq_order(
    state: ServerState, entry: ModelEntry, seq_id: int | None, label: str, fn: Callable[[], T], detail: str = ""
) -> T:
    """Run `fn` on the model's worker once every earlier seq_id of the model has finished."""
    if seq_id is None:
        return await run_engine(state, entry.executor, label, fn, detail)
    async with entry.cond:
        try:
            await asyncio.wait_for(entry.cond.wait_for(lambda: entry.next_seq >= seq_id), SEQ_GAP_TIMEOUT_S)
        except TimeoutError:
            raise UserError(
                f"{label}: seq_id {seq_id} waited {SEQ_GAP_TIMEOUT_S:.0f}s for seq_id {entry.next_seq} "
                f"of model {entry.model_id}, which never arrived"
            ) from None
    try:
        return await run_engine(state, entry.executor, label, fn, detail)
    finally:
        async with entry.cond:
            entry.next_seq = max(entry.next_seq, seq_id + 1)
            entry.cond.notify_all()


def submit_ordered(
    state: ServerState, entry: ModelEntry, seq_id: int | None, label: str, fn: Callable[[], Outcome], detail: str = ""
) -> web.Response:
    entry.last_request_time = utc_now()
    if state.profile.is_spindle:
        spindle.check_submit(state, entry, label)  # 410 model_lost once the model's trainer is gone
    if seq_id is not None:
        if seq_id in entry.requests_by_seq:  # a resent request: same future
            return future_json(entry.requests_by_seq[seq_id], entry.model_id)
        if seq_id < entry.next_seq:
            return error_json(
                f"{label}: seq_id {seq_id} of model {entry.model_id} is older than the next expected "
                f"seq_id {entry.next_seq}",
                400,
            )
    request_id, fut = state.new_future()
    if seq_id is not None:
        entry.requests_by_seq[seq_id] = request_id
    detail = f"model {entry.model_id}" + (f" {detail}" if detail else "")

    def checked() -> Outcome:  # in seq order, so the injected failure hits a definite request
        if entry.lost:  # its trainer died while this request waited (spindle --fault-model-lost)
            return Outcome("error", spindle.ENGINE_TERMINATED, "server")
        if state.faults.take_call_capacity_failure(label):
            return Outcome("error", f"{CAPACITY_EXHAUSTED_TEXT}: no trainer available for {label}", "server")
        return fn()

    async def work() -> Outcome:
        try:
            return await _in_seq_order(state, entry, seq_id, label, checked, detail)
        finally:
            async with entry.cond:
                entry.pending -= 1
                entry.cond.notify_all()

    entry.pending += 1
    spawn(state, fut, label, work)
    return future_json(request_id, entry.model_id)


def model_entry(state: ServerState, model_id: str | None) -> ModelEntry:
    if model_id is None or model_id not in state.models:
        if state.profile.is_spindle:  # Spindle's RecordNotFound("model", ...): 404 not_found
            raise spindle.model_not_found(model_id)
        raise UserError(f"unknown model_id {model_id!r}: create it with create_model or load_weights first")
    entry = state.models[model_id]
    if state.profile.is_spindle:
        spindle.touch_session(state, entry.session_id)
    return entry


def new_entry(
    state: ServerState,
    model_id: str,
    engine_id: str,
    base_model: str,
    session_id: str,
    *,
    lora_rank: int | None,
    user_metadata: dict[str, str] | None,
    lora_switches: tuple[bool, bool, bool] = (True, True, True),
) -> ModelEntry:
    entry = ModelEntry(
        model_id=model_id,
        engine_id=engine_id,
        base_model=base_model,
        session_id=session_id,
        executor=ThreadPoolExecutor(1, thread_name_prefix=f"model-{len(state.models)}"),
        cond=asyncio.Condition(),
        lora_rank=lora_rank,
        user_metadata=user_metadata,
        lora_switches=lora_switches,
    )
    state.models[model_id] = entry
    return entry


def check_served(state: ServerState, base_model: str) -> None:
    if base_model not in state.served_models():
        if state.profile.is_spindle:  # control_plane/http.py create_sampling_session / create_model
            raise SpindleError(400, "invalid_request", f"unsupported base_model: {base_model}")
        raise UserError(
            f"base model {base_model!r} is not served by the local server; served models: {state.served_models()}"
        )

"""State of one embedded server (sessions, models, samplers, checkpoints, pending futures, the
counters `/_harness/stats` reports) and how work runs: engine calls on worker threads, timed into
the stats; background futures; per-model `seq_id` order."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web
from pydantic import JsonValue
from tinker import types

from dppo_harness import constants
from dppo_harness.json_types import JsonObject
from dppo_harness.local_server.errors import SpindleError, UserError
from dppo_harness.local_server.faults import CAPACITY_EXHAUSTED_TEXT, FaultInjector, HeaderRecorder, Hold
from dppo_harness.local_server.http.codecs import RequestT, dump, parse_request
from dppo_harness.local_server.profiles import Profile

if TYPE_CHECKING:
    from dppo_harness.local_server.engine.engine import Engine

log = logging.getLogger("dppo_harness.local_server")
# One line per engine call: what ran, its wall and process CPU seconds (benchmarks read them).
engine_log = logging.getLogger("dppo_harness.local_server.engine")
T = TypeVar("T")

MAX_KEPT_RESULTS = 20000
SAMPLE_WORKERS = 64  # threads running sample requests (each blocks on the engine's batching sampler)
SEQ_GAP_TIMEOUT_S = 900.0  # a missing earlier seq_id fails the waiting request after this
ENGINE_TERMINATED = "engine terminated before producing a result"  # Spindle's text for a dead trainer


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Outcome:
    kind: str  # "json" | "proto" | "error"
    payload: JsonObject | bytes | str  # json: the object; proto: the encoded message; error: the message
    category: str = "server"


@dataclass
class ModelEntry:
    model_id: str  # the id the SDK uses
    engine_id: str
    base_model: str
    session_id: str
    lora_rank: int | None = None
    user_metadata: dict[str, str] | None = None
    # the model's ordered requests run one at a time on its own worker, in seq_id order (cond)
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="model"))
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    next_seq: int = 1
    requests_by_seq: dict[int, str] = field(default_factory=dict)
    pending: int = 0  # accepted ordered requests not finished yet (unload_model waits for them)
    last_request_time: datetime = field(default_factory=utc_now)
    lost: bool = False  # spindle: the model's trainer is gone (every later submit answers 410 model_lost)


def str_metadata(meta: Mapping[str, JsonValue] | None) -> dict[str, str] | None:
    """TrainingRun/Checkpoint carry `dict[str, str]`; creation requests allow any JSON values."""
    if meta is None:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


@dataclass
class ServerState:
    engine: Engine
    faults: FaultInjector
    headers: HeaderRecorder
    profile: Profile = field(default_factory=Profile)
    stats_path: Path | None = None  # written when the process exits on purpose (fault die, SIGTERM)

    def __post_init__(self) -> None:
        self.sessions: dict[str, float] = {}  # session id -> when it was last seen (time.time())
        self.models: dict[str, ModelEntry] = {}
        self.samplers: dict[str, types.GetSamplerResponse] = {}  # what GET samplers/<id> answers
        self.checkpoints: dict[str, types.Checkpoint] = {}  # tinker path -> saved through this server, in order
        self.results: OrderedDict[str, asyncio.Future[Outcome]] = OrderedDict()
        self.model_requests: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> request
        self.sample_pool = ThreadPoolExecutor(SAMPLE_WORKERS, thread_name_prefix="sample")
        self.misc_pool = ThreadPoolExecutor(2, thread_name_prefix="misc")
        self._ids = itertools.count(1)
        self.engine_calls: dict[str, int] = {}
        # Telemetry request bodies as received, in memory only (never in stats, logs or files): tests
        # scan them for credential values (the SDK's fatal-error events carry request headers).
        self.telemetry_bodies: list[bytes] = []
        self.tasks: set[asyncio.Task] = set()  # the loop keeps only weak references
        self.holds: dict[asyncio.Future[Outcome], Hold] = {}  # queued requests a fault holds
        # spindle: the one trainer's LoRA slots (model ids holding one), its cold start, and the
        # creations waiting for either (http/spindle.py)
        self.slots: set[str] = set()
        self.slot_cond = asyncio.Condition()
        self.trainer_ready_at: float | None = None  # time.monotonic() when the cold trainer is up
        self.waiting_creations = 0
        self.creation_requests: set[str] = set()  # request ids of model creations (their polls)
        self.reclaimed_sessions = 0

    def new_future(self) -> tuple[str, asyncio.Future[Outcome]]:
        request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.results[request_id] = fut
        while len(self.results) > MAX_KEPT_RESULTS:
            old_id, old = next(iter(self.results.items()))
            if not old.done():
                break
            self.results.pop(old_id)
        return request_id, fut

    def marker(self) -> JsonObject:
        return {
            "marker": constants.EMBEDDED_SERVER_MARKER,
            "stand_in": self.engine.served_model_name,
            "profile": self.profile.name,
        }

    def record_checkpoint(self, path: str) -> None:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
        checkpoint = types.Checkpoint(
            checkpoint_id=parsed.checkpoint_id,
            checkpoint_type=parsed.checkpoint_type,
            time=utc_now(),
            tinker_path=path,
        )
        self.checkpoints.pop(path, None)  # an overwrite moves to the end
        self.checkpoints[path] = checkpoint

    def checkpoints_of(self, model_id: str) -> list[types.Checkpoint]:
        return [c for path, c in self.checkpoints.items() if path.startswith(f"tinker://{model_id}/")]

    def training_run(self, entry: ModelEntry) -> types.TrainingRun:
        mine = self.checkpoints_of(entry.model_id)
        last = {
            kind: next((c for c in reversed(mine) if c.checkpoint_type == kind), None)
            for kind in ("training", "sampler")
        }
        return types.TrainingRun(
            training_run_id=entry.model_id,
            base_model=entry.base_model,
            model_owner="local",  # the embedded server has no accounts
            is_lora=True,
            lora_rank=entry.lora_rank,
            last_request_time=entry.last_request_time,
            last_checkpoint=last["training"],
            last_sampler_checkpoint=last["sampler"],
            user_metadata=entry.user_metadata,
        )

    def stats(self) -> JsonObject:
        times = os.times()
        return {
            "process_cpu_seconds": times.user + times.system,
            "served_model": self.engine.served_model_name,
            "profile": self.profile.name,
            "faults": self.faults.snapshot(),
            "headers": self.headers.snapshot(),
            "sessions": len(self.sessions),
            "trainer_slots_held": len(self.slots),
            "waiting_creations": self.waiting_creations,
            "reclaimed_sessions": self.reclaimed_sessions,
            "models": {m: e.engine_id for m, e in self.models.items()},
            "checkpoints": len(self.checkpoints),
            "held_requests": len(self.holds),
            "engine_calls": dict(self.engine_calls),
            "retained_forwards": dict(self.engine.retained_stats),
        }

    def shutdown(self) -> None:
        for entry in self.models.values():
            entry.executor.shutdown(wait=False, cancel_futures=True)
        self.sample_pool.shutdown(wait=False, cancel_futures=True)
        self.misc_pool.shutdown(wait=False, cancel_futures=True)

    # -- lookups: Spindle answers an unknown record 404 not_found (RecordNotFound), the default profile a user error
    def missing(self, what: str, ident: object, default_text: str) -> Exception:
        if self.profile.is_spindle:
            return SpindleError(404, "not_found", f"{what} not found: {ident}")
        return UserError(default_text)

    def session(self, session_id: str, *, heartbeat: bool = False) -> None:
        """Refuses an unknown session; marks it seen on a heartbeat (and on the spindle profile, on
        any request: Spindle's _touch_session)."""
        if session_id not in self.sessions:
            raise self.missing("session", session_id, f"unknown session_id {session_id!r}")
        if heartbeat or self.profile.is_spindle:
            self.sessions[session_id] = time.time()

    def model(self, model_id: str | None) -> ModelEntry:
        entry = self.models.get(model_id or "")
        if entry is None:
            raise self.missing(
                "model", model_id, f"unknown model_id {model_id!r}: create it with create_model or load_weights first"
            )
        if self.profile.is_spindle and entry.session_id in self.sessions:
            self.sessions[entry.session_id] = time.time()
        return entry

    def check_served(self, base_model: str) -> None:
        served = self.profile.served_models(self.engine.served_models)
        if base_model not in served:
            if self.profile.is_spindle:  # control_plane/http.py create_sampling_session / create_model
                raise SpindleError(400, "invalid_request", f"unsupported base_model: {base_model}")
            raise UserError(f"base model {base_model!r} is not served by the local server; served models: {served}")

    def new_sampler(self, session_id: str, seq: int, base_model: str, model_path: str | None) -> str:
        sampler_id = f"{session_id}:sample:{seq}"
        self.samplers[sampler_id] = types.GetSamplerResponse(
            sampler_id=sampler_id, base_model=base_model, model_path=model_path
        )
        return sampler_id

    # -- spindle: the trainer's LoRA slots, a trainer that dies (control_plane/service.py `engine_for` / `retrieve`)
    async def release_slot(self, model_id: str) -> None:
        async with self.slot_cond:
            self.slots.discard(model_id)
            self.slot_cond.notify_all()

    def fail_pending(self, entry: ModelEntry, message: str) -> int:
        failed = 0
        for request_id in entry.requests_by_seq.values():
            fut = self.results.get(request_id)
            if fut is not None and not fut.done():
                self.holds.pop(fut, None)
                fut.set_result(Outcome("error", message, "server"))
                failed += 1
        return failed

    def check_lost(self, entry: ModelEntry, label: str) -> None:
        """Before a submit on `entry` is accepted: 410 model_lost once the model's trainer is gone
        (--fault-model-lost decides when); its pending futures fail and its slot frees."""
        if not entry.lost and self.faults.model_lost_now(label):
            entry.lost = True
            failed = self.fail_pending(entry, ENGINE_TERMINATED)
            task = asyncio.get_running_loop().create_task(self.release_slot(entry.model_id))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            log.info("fault: trainer of model %s lost at %s (%d pending futures failed)", entry.model_id, label, failed)
        if entry.lost:
            raise SpindleError(410, "model_lost", f"engine owning model {entry.model_id} terminated")

    # -- work
    async def run_engine(self, executor: ThreadPoolExecutor, label: str, fn: Callable[[], T], detail: str = "") -> T:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn)
        finally:
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            self.engine_calls[label] = self.engine_calls.get(label, 0) + 1
            engine_log.info(
                "engine %s %.3fs wall %.3fs cpu (process %.2fs cpu)%s",
                label,
                wall,
                cpu,
                time.process_time(),
                f" {detail}" if detail else "",
            )

    def spawn(self, label: str, coro_fn: Callable[[], Awaitable[Outcome]], fut: asyncio.Future[Outcome]) -> None:
        """Run `coro_fn()` in the background (after any fault hold) and resolve `fut` with its Outcome."""

        async def runner() -> None:
            try:
                hold = self.faults.take_hold(label)
                if hold is not None:  # a queue pause or a request that never completes (fault injection)
                    self.holds[fut] = hold
                    wait_s = hold.remaining(time.monotonic())
                    await (asyncio.Event().wait() if wait_s is None else asyncio.sleep(wait_s))
                    self.holds.pop(fut, None)
                outcome = await coro_fn()
            except Exception as exc:
                if isinstance(exc, UserError):
                    outcome = Outcome("error", str(exc), "user")
                else:
                    log.error("engine error in %s:\n%s", label, "".join(traceback.format_exception(exc)))
                    text = f"{label} failed on the local server: {type(exc).__name__}: {exc}"
                    outcome = Outcome("error", text, "server")
            if outcome.kind == "json" and isinstance(outcome.payload, dict):  # --fault-omit-field
                outcome.payload = self.faults.omit_json(label, outcome.payload)
            if not fut.done():
                fut.set_result(outcome)

        task = asyncio.get_running_loop().create_task(runner())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def submit(
        self, label: str, coro_fn: Callable[[], Awaitable[Outcome]], model_id: str | None = None
    ) -> web.Response:
        """A new future running `coro_fn` in the background; its id answered at once."""
        request_id, fut = self.new_future()
        self.spawn(label, coro_fn, fut)
        return future_json(request_id, model_id)

    def submit_ordered(
        self, entry: ModelEntry, seq_id: int | None, label: str, fn: Callable[[], Outcome], detail: str = ""
    ) -> web.Response:
        """`fn` on the model's worker once every earlier seq_id of the model has finished."""
        entry.last_request_time = utc_now()
        if self.profile.is_spindle:
            self.check_lost(entry, label)
        if seq_id is not None:
            if seq_id in entry.requests_by_seq:  # a resent request: same future
                return future_json(entry.requests_by_seq[seq_id], entry.model_id)
            if seq_id < entry.next_seq:
                return error_json(
                    f"{label}: seq_id {seq_id} of model {entry.model_id} is older than the next expected "
                    f"seq_id {entry.next_seq}",
                    400,
                )
        request_id, fut = self.new_future()
        if seq_id is not None:
            entry.requests_by_seq[seq_id] = request_id
        detail = f"model {entry.model_id}" + (f" {detail}" if detail else "")

        def checked() -> Outcome:  # in seq order, so the injected failure hits a definite request
            if entry.lost:  # its trainer died while this request waited (spindle --fault-model-lost)
                return Outcome("error", ENGINE_TERMINATED, "server")
            if self.faults.take_call_capacity_failure(label):
                return Outcome("error", f"{CAPACITY_EXHAUSTED_TEXT}: no trainer available for {label}", "server")
            return fn()

        async def work() -> Outcome:
            try:
                if seq_id is not None:
                    async with entry.cond:
                        try:
                            await asyncio.wait_for(
                                entry.cond.wait_for(lambda: entry.next_seq >= seq_id), SEQ_GAP_TIMEOUT_S
                            )
                        except TimeoutError:
                            raise UserError(
                                f"{label}: seq_id {seq_id} waited {SEQ_GAP_TIMEOUT_S:.0f}s for seq_id "
                                f"{entry.next_seq} of model {entry.model_id}, which never arrived"
                            ) from None
                try:
                    return await self.run_engine(entry.executor, label, checked, detail)
                finally:
                    if seq_id is not None:
                        async with entry.cond:
                            entry.next_seq = max(entry.next_seq, seq_id + 1)
                            entry.cond.notify_all()
            finally:
                async with entry.cond:
                    entry.pending -= 1
                    entry.cond.notify_all()

        entry.pending += 1
        self.spawn(label, work, fut)
        return future_json(request_id, entry.model_id)


STATE_KEY: web.AppKey[ServerState] = web.AppKey("state", ServerState)


def error_json(message: str, status: int, category: str = "user") -> web.Response:
    return web.json_response(
        dump(types.RequestFailedResponse(error=message, category=types.RequestErrorCategory(category))), status=status
    )


def future_json(request_id: str, model_id: str | None = None) -> web.Response:
    return web.json_response(dump(types.UntypedAPIFuture(request_id=request_id, model_id=model_id)))


async def parse_body(request: web.Request, model: type[RequestT]) -> RequestT:
    return parse_request(model, await request.read())

"""State of one embedded server: sessions, training models, samplers, saved checkpoints, pending
futures and the engine-call counters `/_harness/stats` reports."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import JsonValue
from tinker import types

from dppo_harness import constants
from dppo_harness.json_types import JsonObject
from dppo_harness.local_server.errors import SpindleError, UserError
from dppo_harness.local_server.faults import FaultInjector, HeaderRecorder, Hold
from dppo_harness.local_server.profiles import Profile

if TYPE_CHECKING:
    from dppo_harness.local_server.engine.engine import Engine

MAX_KEPT_RESULTS = 20000
MODEL_OWNER = "local"  # TrainingRun.model_owner: the embedded server has no accounts
SAMPLE_WORKERS = 64  # threads running sample requests (each blocks on the engine's batching sampler)


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
    executor: ThreadPoolExecutor
    cond: asyncio.Condition
    lora_rank: int | None = None
    user_metadata: dict[str, str] | None = None
    # Tinker's LoRA switches (train_mlp, train_attn, train_unembed), as created.
    lora_switches: tuple[bool, bool, bool] = (True, True, True)
    next_seq: int = 1
    requests_by_seq: dict[int, str] = field(default_factory=dict)
    pending: int = 0  # accepted ordered requests not finished yet (unload_model waits for them)
    last_request_time: datetime = field(default_factory=utc_now)
    # spindle profile: whether the model's trainer is gone (every later submit answers 410 model_lost)
    lost: bool = False


@dataclass
class SessionEntry:
    """A session created through this server."""

    created: float
    last_heartbeat: float
    sdk_version: str
    tags: list[str]
    user_metadata: dict[str, str] | None


@dataclass
class SamplerEntry:
    sampler_id: str
    base_model: str
    model_path: str | None


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint saved through this server, for the REST reads (listing, weights info)."""

    model_id: str
    checkpoint: types.Checkpoint
    base_model: str
    lora_rank: int | None
    lora_switches: tuple[bool, bool, bool] = (True, True, True)  # train_mlp, train_attn, train_unembed


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
    started: float = field(default_factory=time.time)
    on_die: Callable[[str], None] | None = None  # called instead of os._exit in-process
    stats_path: Path | None = None  # written when the process exits on purpose (fault die, SIGTERM)

    def __post_init__(self) -> None:
        self.sessions: dict[str, SessionEntry] = {}
        self.models: dict[str, ModelEntry] = {}
        self.samplers: dict[str, SamplerEntry] = {}
        self.checkpoints: dict[str, CheckpointRecord] = {}  # tinker path -> record, in save order
        self.results: OrderedDict[str, asyncio.Future[Outcome]] = OrderedDict()
        self.model_requests: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> request
        self.sample_pool = ThreadPoolExecutor(SAMPLE_WORKERS, thread_name_prefix="sample")
        self.misc_pool = ThreadPoolExecutor(2, thread_name_prefix="misc")
        self._ids = itertools.count(1)
        self.engine_seconds: dict[str, float] = {}
        self.engine_cpu_seconds: dict[str, float] = {}  # process CPU while the call ran (concurrent calls overlap)
        self.engine_calls: dict[str, int] = {}
        self.inflight = 0
        self.telemetry_events = 0
        # Telemetry request bodies as received, in memory only (never in stats, logs or files): tests
        # scan them for credential values (the SDK's fatal-error events carry request headers).
        self.telemetry_bodies: list[bytes] = []
        self.tasks: set[asyncio.Task] = set()
        self.holds: dict[asyncio.Future[Outcome], Hold] = {}  # queued requests a fault holds
        self.cancelled_requests = 0  # cancel_future calls received
        # spindle profile: the one trainer's LoRA slots (model ids holding one), its cold start, and
        # the creations waiting for either (see http/spindle.py)
        self.slots: set[str] = set()
        self.slot_cond = asyncio.Condition()
        self.trainer_ready_at: float | None = None  # time.monotonic() when the cold trainer is up
        self.waiting_creations = 0
        self.creation_requests: set[str] = set()  # request ids of model creations (their polls)
        self.reclaimed_sessions = 0

    # -- futures
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

    def engine_model_id(self, model_id: str) -> str:
        """The engine's id for an SDK model id (tests read gradients through it)."""
        return self.models[model_id].engine_id

    def default_stop_ids(self) -> list[int]:
        ids = getattr(self.engine, "default_stop_token_ids", None)
        return list(ids) if ids else [constants.STOP_TOKEN_ID]

    @property
    def stand_in(self) -> str:
        """The identity of the model really computing (e.g. `local/tiny-qwen3-gsm8k`)."""
        return str(self.engine.served_model_name)

    def served_models(self) -> list[str]:
        return self.profile.served_models(list(getattr(self.engine, "served_models", [])), self.stand_in)

    def marker(self) -> JsonObject:
        return {"marker": constants.EMBEDDED_SERVER_MARKER, "stand_in": self.stand_in, "profile": self.profile.name}

    def record_checkpoint(self, entry: ModelEntry, path: str) -> None:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
        checkpoint = types.Checkpoint(
            checkpoint_id=parsed.checkpoint_id,
            checkpoint_type=parsed.checkpoint_type,
            time=utc_now(),
            tinker_path=path,
        )
        self.checkpoints.pop(path, None)  # an overwrite moves to the end
        self.checkpoints[path] = CheckpointRecord(
            entry.model_id, checkpoint, entry.base_model, entry.lora_rank, entry.lora_switches
        )

    def training_run(self, entry: ModelEntry) -> types.TrainingRun:
        mine = [r.checkpoint for r in self.checkpoints.values() if r.model_id == entry.model_id]
        last = {
            kind: next((c for c in reversed(mine) if c.checkpoint_type == kind), None)
            for kind in ("training", "sampler")
        }
        return types.TrainingRun(
            training_run_id=entry.model_id,
            base_model=entry.base_model,
            model_owner=MODEL_OWNER,
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
            "uptime_s": time.time() - self.started,
            "process_cpu_seconds": times.user + times.system,
            "served_model": self.stand_in,
            "profile": self.profile.name,
            "faults": self.faults.snapshot(),
            "headers": self.headers.snapshot(),
            "sessions": len(self.sessions),
            "cancelled_requests": self.cancelled_requests,
            "trainer_slots_held": len(self.slots),
            "waiting_creations": self.waiting_creations,
            "reclaimed_sessions": self.reclaimed_sessions,
            "models": {m: e.engine_id for m, e in self.models.items()},
            "samplers": len(self.samplers),
            "checkpoints": len(self.checkpoints),
            "inflight": self.inflight,
            "telemetry_events": self.telemetry_events,
            "telemetry_posts": len(self.telemetry_bodies),
            "held_requests": len(self.holds),
            "engine_seconds": dict(self.engine_seconds),
            "engine_cpu_seconds": dict(self.engine_cpu_seconds),
            "engine_calls": dict(self.engine_calls),
            "retained_forwards": dict(getattr(self.engine, "retained_stats", {}) or {}),
        }

    def shutdown(self) -> None:
        for entry in self.models.values():
            entry.executor.shutdown(wait=False, cancel_futures=True)
        self.sample_pool.shutdown(wait=False, cancel_futures=True)
        self.misc_pool.shutdown(wait=False, cancel_futures=True)


STATE_KEY: web.AppKey[ServerState] = web.AppKey("state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]


def session_of(state: ServerState, session_id: str) -> SessionEntry:
    if session_id not in state.sessions:
        if state.profile.is_spindle:  # Spindle's RecordNotFound("session", ...): 404 not_found
            raise SpindleError(404, "not_found", f"session not found: {session_id}")
        raise UserError(f"unknown session_id {session_id!r}")
    session = state.sessions[session_id]
    if state.profile.is_spindle:  # any request on a session counts as it being seen (Spindle's _touch_session)
        session.last_heartbeat = time.time()
    return session


def new_sampler(state: ServerState, session_id: str, seq: int, base_model: str, model_path: str | None) -> str:
    sampler_id = f"{session_id}:sample:{seq}"
    state.samplers[sampler_id] = SamplerEntry(sampler_id, base_model, model_path)
    return sampler_id

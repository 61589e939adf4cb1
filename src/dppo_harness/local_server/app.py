"""aiohttp app speaking the Tinker SDK 0.38 wire protocol over a local `Engine`.

Protocol (read from the SDK source, see docs/local-server.md "HTTP side"):
- JSON requests are validated into the SDK's own pydantic request types (`tinker.types`) and
  answers are built from its response types, so the server cannot drift from the pinned SDK; a
  request that does not validate gets HTTP 400 naming the field.
- Work endpoints answer at once with an `UntypedAPIFuture` (`{"request_id": ...}`); the SDK then
  long-polls `POST /api/v1/retrieve_future`. Pending -> HTTP 408 `{"type": "try_again", ...}`
  (the SDK re-polls at once); failure -> 200 `{"error": ..., "category": "user"|"server"}`
  (the SDK raises `RequestFailedError`); success -> JSON, or protobuf for `ForwardBackwardOutput`
  and `SampleResponse` (SDK 0.38 refuses JSON for those two; the SDK ships no encoder).
- `forward_backward` requests arrive as protobuf (`forward_only` distinguishes `forward`).
- Requests on one training model run strictly in `seq_id` order on that model's own worker
  thread; sampling runs on a shared thread pool so concurrent samples overlap.
- Every response carries the embedded-server marker header; the `spindle` profile checks the
  credential headers first (401 naming the header, never a value); one log line per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import sys
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import numpy as np
import pydantic
from aiohttp import web
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types._pydantic_types.save_weights_for_sampler_response import SaveWeightsForSamplerResponseInternal
from tinker.types.session_status import ClientSessionFinishReason
from tinker.types.try_again_response import TryAgainResponse

from dppo_harness import constants
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.faults import CAPACITY_EXHAUSTED_TEXT, FaultInjector, HeaderRecorder
from dppo_harness.local_server.loss_fns import get_loss
from dppo_harness.local_server.profiles import Profile

log = logging.getLogger("dppo_harness.local_server")
request_log = logging.getLogger("dppo_harness.local_server.requests")
# One line per engine call: what ran, its wall and process CPU seconds (benchmarks read them).
engine_log = logging.getLogger("dppo_harness.local_server.engine")

API = "/api/v1"
LONG_POLL_S = 20.0  # the SDK's retrieve_future timeout is 45 s
PAUSED_POLL_S = 1.0  # a paused request's polls are held this long (the SDK re-polls a 408 at once)
MAX_TELEMETRY_BODIES = 1000
SEQ_GAP_TIMEOUT_S = 900.0  # a missing earlier seq_id fails the waiting request after this
MAX_KEPT_RESULTS = 20000
FAULT_EXIT_CODE = 75
MODEL_OWNER = "local"  # TrainingRun.model_owner: the embedded server has no accounts

RequestT = TypeVar("RequestT", bound=pydantic.BaseModel)

_PB_TO_NP = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_INT64: np.int64,
    pb.DTYPE_INT32: np.int32,
}


class ProtocolError(Exception):
    """A request the server cannot parse: answered with HTTP 400 and a message naming the field."""


class FinishSessionRequest(pydantic.BaseModel):
    """Body of `POST sessions/{id}/finish` (the SDK posts it untyped; its parts are SDK types)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    reason: ClientSessionFinishReason
    detail: str | None = None


# ---- request/response codecs (pure) ------------------------------------------------------------


def kind_of(path: str) -> str:
    """Endpoint name used for fault rules and counters (`/api/v1/create_model` → `create_model`)."""
    if not path.startswith(API + "/"):
        return path.strip("/").replace("/", "_") or "root"
    rest = path[len(API) + 1 :]
    if rest.startswith("sessions/") and rest.endswith("/finish"):
        return "session_finish"
    if rest.startswith("sessions/"):
        return "get_session"
    if rest.startswith("samplers/"):
        return "get_sampler"
    if rest.startswith("training_runs/"):
        return "list_checkpoints" if rest.endswith("/checkpoints") else "get_training_run"
    if rest == "training_runs":
        return "list_training_runs"
    return rest.replace("/", "_")


def decode_tensor(msg: pb.Tensor) -> np.ndarray:
    if msg.dtype == pb.DTYPE_BFLOAT16:
        raw = msg.sparse_csr.values if msg.HasField("sparse_csr") else msg.dense
        values = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif msg.dtype in _PB_TO_NP:
        raw = msg.sparse_csr.values if msg.HasField("sparse_csr") else msg.dense
        values = np.frombuffer(raw, dtype=_PB_TO_NP[msg.dtype])
    else:
        raise ProtocolError(f"unsupported tensor dtype enum {msg.dtype}")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise ProtocolError(f"sparse CSR tensor needs a 2-D shape, got {shape}")
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        dense = np.zeros(shape, dtype=values.dtype)
        for row in range(shape[0]):
            lo, hi = int(crow[row]), int(crow[row + 1])
            dense[row, col[lo:hi]] = values[lo:hi]
        return dense
    arr = values.copy()
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise ProtocolError(f"tensor shape {shape} does not match its {arr.size} elements")
        arr = arr.reshape(shape)
    return arr


def decode_fwdbwd_request(body: bytes, content_encoding: str | None) -> dict[str, Any]:
    """The protobuf `ForwardBackwardRequest` as plain Python: model_id, seq_id, data, loss_fn, ..."""
    if content_encoding and content_encoding.lower() != "identity":
        # client/config answers proto_compress_fwdbwd=false, so the stock SDK never compresses.
        raise ProtocolError(f"Content-Encoding {content_encoding!r} is not supported; send uncompressed protobuf")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise ProtocolError(f"forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            which = chunk.WhichOneof("chunk")
            if which != "encoded_text":
                raise UserError(f"datum {i}: model_input chunk type {which!r} is not supported (tokens only)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: decode_tensor(t) for name, t in datum.loss_fn_inputs.items()}
        data.append((tokens, inputs))
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return {
        "model_id": msg.model_id,
        "seq_id": msg.seq_id,
        "data": data,
        "loss_fn": msg.loss_fn,
        "loss_fn_config": config or None,
        "forward_only": msg.forward_only,
    }


def _pb_dtype(arr: np.ndarray) -> tuple[int, np.dtype]:
    if np.issubdtype(arr.dtype, np.floating):
        return pb.DTYPE_FLOAT32, np.dtype(np.float32)
    if np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        return pb.DTYPE_INT64, np.dtype(np.int64)
    raise ValueError(f"cannot encode output dtype {arr.dtype}")


def check_metric_names(metrics: dict[str, float]) -> dict[str, float]:
    """The SDK splits each key on ':' into name and reduction; refuse keys it would crash on."""
    for key in metrics:
        if key.count(":") != 1:
            raise ValueError(f"metric key {key!r} must look like 'name:reduction'")
    return {k: float(v) for k, v in metrics.items()}


def encode_fwdbwd_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in check_metric_names(metrics).items():
        msg.metrics[key] = value
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    names = list(outputs[0].keys()) if outputs else []
    for i, out in enumerate(outputs):
        if list(out.keys()) != names:
            raise ValueError(f"output {i} has fields {list(out)}, output 0 has {names}")
    for name in names:
        arrays = [np.asarray(out[name]) for out in outputs]
        dtype_enum, np_dtype = _pb_dtype(arrays[0])
        arrays = [a.astype(np_dtype, copy=False) for a in arrays]
        trailing = arrays[0].shape[1:]
        if any(a.ndim == 0 or a.shape[1:] != trailing for a in arrays):
            raise ValueError(f"output field {name!r}: per-datum arrays need equal trailing shapes")
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field_msg = record.fields[name]
        field_msg.data = b"".join(a.tobytes() for a in arrays)
        field_msg.offsets = offsets.tobytes()
        field_msg.dtype = dtype_enum
        field_msg.trailing_shape.extend(trailing)
    return msg.SerializeToString()


def _seq_attr(seq: Any, name: str, default: Any = None) -> Any:
    if isinstance(seq, dict):
        return seq.get(name, default)
    return getattr(seq, name, default)


def encode_sample_response(seqs: list[Any], prompt_logprobs: list[float | None] | None, *,
                           omit_logprobs: bool = False) -> bytes:
    """`omit_logprobs`: leave every sequence's (optional) logprobs out, as a service may."""
    msg = pb.SampleResponse()
    for seq in seqs:
        out = msg.sequences.add()
        reason = _seq_attr(seq, "stop_reason")
        if reason not in ("stop", "length"):
            raise ValueError(f"stop_reason must be 'stop' or 'length', got {reason!r}")
        out.stop_reason = pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH
        tokens = np.asarray(_seq_attr(seq, "tokens"), dtype=np.int32)
        logprobs = np.asarray(_seq_attr(seq, "logprobs"), dtype=np.float32)
        if logprobs.shape != tokens.shape:
            raise ValueError(f"{tokens.size} sampled tokens but {logprobs.size} logprobs")
        out.tokens = tokens.tobytes()
        if not omit_logprobs:
            out.logprobs = logprobs.tobytes()
    if prompt_logprobs is not None:
        values = [math.nan if v is None else float(v) for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()


def parse_stop(stop: str | Sequence[str] | Sequence[int] | None, default_ids: list[int]) -> tuple[list[int], list[str]]:
    """SamplingParams.stop: None -> the model's EOS; [] -> nothing; str / [str] / [int]."""
    if stop is None:
        return list(default_ids), []
    if isinstance(stop, str):
        return [], [stop]
    items = list(stop)
    if all(isinstance(s, str) for s in items):
        return [], [str(s) for s in items]
    return [int(s) for s in items], []


def prompt_tokens_of(model_input: types.ModelInput) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise UserError(f"prompt chunk {i} has type {chunk.type!r}; only token chunks are supported")
        tokens.extend(int(t) for t in chunk.tokens)
    return tokens


def validation_message(exc: pydantic.ValidationError) -> str:
    """A pydantic error as one line naming each bad field (`field lora_config.rank: ...`)."""
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        if err["type"] == "missing":
            parts.append(f"missing field {loc}")
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown field {loc}")
        else:
            parts.append(f"field {loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def parse_request(model: type[RequestT], raw: bytes) -> RequestT:
    """The JSON body validated into the SDK's own request type; ProtocolError names the field."""
    if not raw:
        raise ProtocolError(f"empty body; expected a {model.__name__} JSON object")
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise ProtocolError(f"request body is not JSON ({model.__name__} expected)") from None
        raise ProtocolError(f"{model.__name__}: {validation_message(exc)}") from None


def dump(response: pydantic.BaseModel) -> dict[str, Any]:
    """An SDK response model as wire JSON."""
    return response.model_dump(mode="json", exclude_none=True)


# ---- server state ------------------------------------------------------------------------------


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class _Outcome:
    kind: str  # "json" | "proto" | "error"
    payload: Any
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
    last_request_time: datetime = field(default_factory=_now)


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


def _str_metadata(meta: dict[str, Any] | None) -> dict[str, str] | None:
    """TrainingRun/Checkpoint carry `dict[str, str]`; creation requests allow any JSON values."""
    if meta is None:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


@dataclass
class ServerState:
    engine: Any
    faults: FaultInjector
    headers: HeaderRecorder
    sample_workers: int = 64
    profile: Profile = field(default_factory=Profile)
    started: float = field(default_factory=time.time)
    on_die: Callable[[str], None] | None = None  # called instead of os._exit in-process
    stats_path: Any = None  # written when the process exits on purpose (fault die, SIGTERM)

    def __post_init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.models: dict[str, ModelEntry] = {}
        self.samplers: dict[str, SamplerEntry] = {}
        self.checkpoints: dict[str, CheckpointRecord] = {}  # tinker path -> record, in save order
        self.results: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.model_requests: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> request
        self.sample_pool = ThreadPoolExecutor(self.sample_workers, thread_name_prefix="sample")
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
        self.holds: dict[asyncio.Future, Any] = {}  # queued requests a fault holds (faults.Hold)

    # -- futures
    def new_future(self) -> tuple[str, asyncio.Future]:
        request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
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

    def marker(self) -> dict[str, str]:
        return {"marker": constants.EMBEDDED_SERVER_MARKER, "stand_in": self.stand_in, "profile": self.profile.name}

    def record_checkpoint(self, entry: ModelEntry, path: str, user_metadata: dict[str, str] | None) -> None:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
        checkpoint = types.Checkpoint(checkpoint_id=parsed.checkpoint_id, checkpoint_type=parsed.checkpoint_type,
                                      time=_now(), tinker_path=path, user_metadata=user_metadata)
        self.checkpoints.pop(path, None)  # an overwrite moves to the end
        self.checkpoints[path] = CheckpointRecord(entry.model_id, checkpoint, entry.base_model, entry.lora_rank,
                                                 entry.lora_switches)

    def training_run(self, entry: ModelEntry) -> types.TrainingRun:
        mine = [r.checkpoint for r in self.checkpoints.values() if r.model_id == entry.model_id]
        last = {kind: next((c for c in reversed(mine) if c.checkpoint_type == kind), None)
                for kind in ("training", "sampler")}
        return types.TrainingRun(
            training_run_id=entry.model_id, base_model=entry.base_model, model_owner=MODEL_OWNER, is_lora=True,
            lora_rank=entry.lora_rank, last_request_time=entry.last_request_time,
            last_checkpoint=last["training"], last_sampler_checkpoint=last["sampler"],
            user_metadata=entry.user_metadata,
        )

    def stats(self) -> dict[str, Any]:
        times = os.times()
        return {
            "uptime_s": time.time() - self.started,
            "process_cpu_seconds": times.user + times.system,
            "served_model": self.stand_in,
            "profile": self.profile.name,
            "faults": self.faults.snapshot(),
            "headers": self.headers.snapshot(),
            "sessions": len(self.sessions),
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
            "kernels": getattr(self.engine, "kernels", None),  # implementation per layer type
        }

    def shutdown(self) -> None:
        for entry in self.models.values():
            entry.executor.shutdown(wait=False, cancel_futures=True)
        self.sample_pool.shutdown(wait=False, cancel_futures=True)
        self.misc_pool.shutdown(wait=False, cancel_futures=True)


def _error_json(message: str, status: int, category: str = "user") -> web.Response:
    return web.json_response(dump(types.RequestFailedResponse(error=message, category=category)), status=status)


def _future_json(request_id: str, model_id: str | None = None, sample_sequence_ids: list[str] | None = None
                 ) -> web.Response:
    return web.json_response(dump(types.UntypedAPIFuture(request_id=request_id, model_id=model_id,
                                                         sample_sequence_ids=sample_sequence_ids)))


async def _parse(request: web.Request, model: type[RequestT]) -> RequestT:
    return parse_request(model, await request.read())


# ---- work execution ----------------------------------------------------------------------------


async def _run_engine(state: ServerState, executor: ThreadPoolExecutor, label: str, fn: Callable[[], Any],
                      detail: str = "") -> Any:
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
        engine_log.info("engine %s %.3fs wall %.3fs cpu (process %.2fs cpu)%s", label, wall, cpu, time.process_time(),
                        f" {detail}" if detail else "")


def _outcome_of_exception(exc: BaseException, label: str) -> _Outcome:
    if isinstance(exc, UserError):
        return _Outcome("error", str(exc), "user")
    log.error("engine error in %s:\n%s", label, "".join(traceback.format_exception(exc)))
    return _Outcome("error", f"{label} failed on the local server: {type(exc).__name__}: {exc}", "server")


def _spawn(state: ServerState, fut: asyncio.Future, label: str, coro_fn: Callable[[], Any]) -> None:
    """Run `coro_fn()` in the background and resolve `fut` with its _Outcome."""

    async def runner() -> None:
        try:
            hold = state.faults.take_hold(label)
            if hold is not None:  # a queue pause or a request that never completes (fault injection)
                state.holds[fut] = hold
                if hold.until is None:
                    await asyncio.Event().wait()
                await asyncio.sleep(hold.remaining(time.monotonic()))
                state.holds.pop(fut, None)
            outcome = await coro_fn()
        except Exception as exc:
            outcome = _outcome_of_exception(exc, label)
        if outcome.kind == "json":  # --fault-omit-field: optional fields the service may leave out
            outcome.payload = state.faults.omit_json(label, outcome.payload)
        if not fut.done():
            fut.set_result(outcome)

    task = asyncio.get_running_loop().create_task(runner())
    state.tasks.add(task)  # the loop keeps only weak references
    task.add_done_callback(state.tasks.discard)


async def _in_seq_order(state: ServerState, entry: ModelEntry, seq_id: int | None, label: str, fn: Callable[[], Any],
                        detail: str = "") -> Any:
    """Run `fn` on the model's worker once every earlier seq_id of the model has finished."""
    if seq_id is None:
        return await _run_engine(state, entry.executor, label, fn, detail)
    async with entry.cond:
        try:
            await asyncio.wait_for(entry.cond.wait_for(lambda: entry.next_seq >= seq_id), SEQ_GAP_TIMEOUT_S)
        except TimeoutError:
            raise UserError(
                f"{label}: seq_id {seq_id} waited {SEQ_GAP_TIMEOUT_S:.0f}s for seq_id {entry.next_seq} "
                f"of model {entry.model_id}, which never arrived"
            ) from None
    try:
        return await _run_engine(state, entry.executor, label, fn, detail)
    finally:
        async with entry.cond:
            entry.next_seq = max(entry.next_seq, seq_id + 1)
            entry.cond.notify_all()


def _submit_ordered(state: ServerState, entry: ModelEntry, seq_id: int | None, label: str,
                    fn: Callable[[], _Outcome], detail: str = "") -> web.Response:
    entry.last_request_time = _now()
    if seq_id is not None:
        if seq_id in entry.requests_by_seq:  # a resent request: same future
            return _future_json(entry.requests_by_seq[seq_id], entry.model_id)
        if seq_id < entry.next_seq:
            return _error_json(
                f"{label}: seq_id {seq_id} of model {entry.model_id} is older than the next expected "
                f"seq_id {entry.next_seq}", 400)
    request_id, fut = state.new_future()
    if seq_id is not None:
        entry.requests_by_seq[seq_id] = request_id
    detail = f"model {entry.model_id}" + (f" {detail}" if detail else "")

    def checked() -> _Outcome:  # in seq order, so the injected failure hits a definite request
        if state.faults.take_call_capacity_failure(label):
            return _Outcome("error", f"{CAPACITY_EXHAUSTED_TEXT}: no trainer available for {label}", "server")
        return fn()

    async def work() -> _Outcome:
        return await _in_seq_order(state, entry, seq_id, label, checked, detail)

    _spawn(state, fut, label, work)
    return _future_json(request_id, entry.model_id)


def _model(state: ServerState, model_id: str | None) -> ModelEntry:
    if model_id is None or model_id not in state.models:
        raise UserError(f"unknown model_id {model_id!r}: create it with create_model or load_weights first")
    return state.models[model_id]


def _new_entry(state: ServerState, model_id: str, engine_id: str, base_model: str, session_id: str, *,
               lora_rank: int | None, user_metadata: dict[str, str] | None,
               lora_switches: tuple[bool, bool, bool] = (True, True, True)) -> ModelEntry:
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


def _check_optimizer(config: types.OptimizerConfig | None) -> None:
    kind = getattr(config, "type", "adamw") if config is not None else "adamw"
    if kind != "adamw":
        raise UserError(f"optimizer {kind!r} is not supported; only 'adamw'")


def _check_served(state: ServerState, base_model: str) -> None:
    if base_model not in state.served_models():
        raise UserError(f"base model {base_model!r} is not served by the local server; served models: "
                        f"{state.served_models()}")


# ---- app, middlewares --------------------------------------------------------------------------


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_log_requests, _authenticate, _faults_and_errors],
                          client_max_size=512 * 1024 * 1024)
    app["state"] = state
    app.on_response_prepare.append(_add_marker)
    r = app.router
    r.add_get(f"{API}/healthz", _healthz)
    r.add_get(f"{API}/get_server_capabilities", _capabilities)
    r.add_post(f"{API}/client/config", _client_config)
    r.add_post(f"{API}/client/dynamic_config", _client_dynamic_config)
    r.add_post(f"{API}/create_session", _create_session)
    r.add_post(f"{API}/session_heartbeat", _session_heartbeat)
    r.add_post(f"{API}/telemetry", _telemetry)
    r.add_post(f"{API}/sessions/{{session_id}}/finish", _finish_session)
    r.add_get(f"{API}/sessions/{{session_id}}", _get_session)
    r.add_post(f"{API}/create_model", _create_model)
    r.add_post(f"{API}/get_info", _get_info)
    r.add_post(f"{API}/forward_backward", _forward_backward)
    r.add_post(f"{API}/optim_step", _optim_step)
    r.add_post(f"{API}/save_weights", _save_weights)
    r.add_post(f"{API}/load_weights", _load_weights)
    r.add_post(f"{API}/save_weights_for_sampler", _save_weights_for_sampler)
    r.add_post(f"{API}/create_sampling_session", _create_sampling_session)
    r.add_get(f"{API}/samplers/{{sampler_id}}", _get_sampler)
    r.add_post(f"{API}/asample", _asample)
    r.add_post(f"{API}/retrieve_future", _retrieve_future)
    r.add_post(f"{API}/cancel_future", _cancel_future)
    # REST reads (RestClient; the cookbook's checkpoint_utils)
    r.add_get(f"{API}/training_runs", _list_training_runs)
    r.add_get(f"{API}/training_runs/{{model_id}}", _get_training_run)
    r.add_get(f"{API}/training_runs/{{model_id}}/checkpoints", _list_checkpoints)
    r.add_get(f"{API}/checkpoints", _list_user_checkpoints)
    r.add_post(f"{API}/weights_info", _weights_info)
    r.add_get("/_harness/stats", _stats)
    return app


def _state(request: web.Request) -> ServerState:
    return request.app["state"]


async def _add_marker(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[constants.EMBEDDED_SERVER_HEADER] = constants.EMBEDDED_SERVER_MARKER


@web.middleware
async def _log_requests(request: web.Request, handler):
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


@web.middleware
async def _authenticate(request: web.Request, handler):
    problem = _state(request).profile.auth_error(request.headers)
    if problem is not None:
        return _error_json(problem, 401)
    return await handler(request)


@web.middleware
async def _faults_and_errors(request: web.Request, handler):
    state = _state(request)
    if request.path.startswith("/_harness/"):
        return await handler(request)
    kind = kind_of(request.path)
    state.headers.record(request.headers)
    decision = state.faults.decide(kind, counts_toward_death=kind != "healthz")
    if decision.die:
        message = (f"local server: fault injection: exiting after "
                   f"{state.faults.config.die_after} API requests (request {kind})")
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
        rejection = dump(types.RequestFailedResponse(error=decision.reject_reason, category="server"))
        return web.json_response(rejection, status=decision.reject_status, headers=headers)
    try:
        return await handler(request)
    except (ProtocolError, UserError) as exc:
        return _error_json(f"{kind}: {exc}", 400)


# ---- handlers: service -------------------------------------------------------------------------


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response(dump(types.HealthResponse(status="ok")))


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(_state(request).stats())


async def _capabilities(request: web.Request) -> web.Response:
    state = _state(request)
    config = getattr(state.engine, "config", None)
    max_ctx = getattr(config, "max_position_embeddings", None)
    response = types.GetServerCapabilitiesResponse(supported_models=[
        types.SupportedModel(model_name=name, max_context_length=max_ctx, trainable=True, sampleable=True)
        for name in state.served_models()
    ])
    # Extra key (the SDK's type ignores it): who is really answering.
    return web.json_response(state.faults.omit_json("get_server_capabilities",
                                                    dump(response) | {"embedded_server": state.marker()}))


async def _client_config(request: web.Request) -> web.Response:
    # API-key auth, httpx transport, uncompressed protobuf, client-side custom losses,
    # per-request retrieve_future polling: the simplest paths of SDK 0.38.
    return web.json_response(dump(types.ClientConfigResponse(
        pjwt_auth_enabled=False,
        credential_default_source="api_key",
        use_pyqwest_transport=False,
        proto_compress_fwdbwd=False,
        parallel_fwdbwd_chunks=True,
        sample_use_retrieve_futures=False,
        custom_loss_server_side=False,
        sample_join_sampling_session=False,
    )))


async def _client_dynamic_config(request: web.Request) -> web.Response:
    return web.json_response(dump(types.ClientDynamicConfigResponse(refresh_interval_sec=300,
                                                                    sample_cancel_enabled=False)))


async def _create_session(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.CreateSessionRequest)
    session_id = str(uuid.uuid4())
    state.sessions[session_id] = {
        "created": time.time(),
        "last_heartbeat": time.time(),
        "finished": None,
        "sdk_version": req.sdk_version,
        "tags": list(req.tags),
        "user_metadata": _str_metadata(req.user_metadata),
        "display_name": req.display_name,
    }
    return web.json_response(dump(types.CreateSessionResponse(session_id=session_id)))


def _session(state: ServerState, session_id: str) -> dict[str, Any]:
    if session_id not in state.sessions:
        raise UserError(f"unknown session_id {session_id!r}")
    return state.sessions[session_id]


async def _session_heartbeat(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.SessionHeartbeatRequest)
    session = _session(state, req.session_id)
    if session["finished"] is not None:
        return _error_json("session is finished", 410)
    session["last_heartbeat"] = time.time()
    return web.json_response(dump(types.SessionHeartbeatResponse()))


async def _telemetry(request: web.Request) -> web.Response:
    raw = await request.read()
    req = parse_request(types.TelemetrySendRequest, raw)
    state = _state(request)
    state.telemetry_events += len(req.events)
    if len(state.telemetry_bodies) < MAX_TELEMETRY_BODIES:
        state.telemetry_bodies.append(raw)
    return web.json_response(dump(types.TelemetryResponse(status="accepted")))


async def _finish_session(request: web.Request) -> web.Response:
    state = _state(request)
    session = _session(state, request.match_info["session_id"])
    req = await _parse(request, FinishSessionRequest)
    if session["finished"] is None:  # first reason wins
        session["finished"] = req.reason.type
    drop = getattr(state.engine, "drop_retained", None)
    for entry in list(state.models.values()):
        if drop is not None and entry.session_id == request.match_info["session_id"]:
            drop(entry.engine_id)  # a finished session sends no second pass
    return web.json_response({})


async def _get_session(request: web.Request) -> web.Response:
    state = _state(request)
    session_id = request.match_info["session_id"]
    session = _session(state, session_id)
    return web.json_response(dump(types.GetSessionResponse(
        training_run_ids=[m for m, e in state.models.items() if e.session_id == session_id],
        sampler_ids=[s for s in state.samplers if s.startswith(session_id)],
        user_metadata=session["user_metadata"],
        display_name=session["display_name"],
    )))


# ---- handlers: training ------------------------------------------------------------------------


async def _create_model(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.CreateModelRequest)
    key = (req.session_id, req.model_seq_id)
    if key in state.model_requests:  # resent request
        return _future_json(state.model_requests[key])
    _session(state, req.session_id)
    lora = req.lora_config
    if lora is None:
        raise UserError("lora_config is required: the local server trains LoRA adapters only")
    switches = (lora.train_mlp, lora.train_attn, lora.train_unembed)
    request_id, fut = state.new_future()
    state.model_requests[key] = request_id
    model_id = f"{req.session_id}:train:{req.model_seq_id}"

    async def work() -> _Outcome:
        if state.faults.take_capacity_failure():
            state.model_requests.pop(key, None)  # a retry is a new creation attempt
            return _Outcome("error", f"{CAPACITY_EXHAUSTED_TEXT}: no trainer available for {req.base_model}", "server")
        _check_optimizer(req.optimizer_config)
        _check_served(state, req.base_model)
        engine_id = await _run_engine(
            state, state.misc_pool, "create_model",
            lambda: state.engine.create_model(req.base_model, lora.rank, lora.seed, model_id=model_id,
                                              train_mlp=switches[0], train_attn=switches[1],
                                              train_unembed=switches[2]),
        )
        _new_entry(state, model_id, engine_id, req.base_model, req.session_id, lora_rank=lora.rank,
                   user_metadata=_str_metadata(req.user_metadata), lora_switches=switches)
        return _Outcome("json", dump(types.CreateModelResponse(model_id=model_id)))

    _spawn(state, fut, "create_model", work)
    return _future_json(request_id)


def _model_data(state: ServerState, entry: ModelEntry) -> dict[str, Any]:
    # The SDK reuses model_data.model_name as the base model of its sampling sessions, so it is the
    # requested name; `arch` names the stand-in really computing, plus the marker (extra key).
    data = types.ModelData(arch=state.stand_in, model_name=entry.base_model, tokenizer_id=entry.base_model)
    return dump(data) | {"embedded_server": constants.EMBEDDED_SERVER_MARKER}


async def _get_info(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.GetInfoRequest)
    entry = _model(state, req.model_id)
    info = state.engine.get_info(entry.engine_id)
    response = types.GetInfoResponse(
        type="get_info", model_data=types.ModelData(), model_id=entry.model_id,
        optimizer_config=types.AdamOptimizerConfig(), is_lora=bool(info.get("is_lora", True)),
        lora_rank=info.get("lora_rank"), model_name=entry.base_model,
    )
    return web.json_response(state.faults.omit_json("get_info", dump(response) | {"model_data": _model_data(state, entry)}))


async def _forward_backward(request: web.Request) -> web.Response:
    state = _state(request)
    body = await request.read()
    req = decode_fwdbwd_request(body, request.headers.get("Content-Encoding"))
    entry = _model(state, req["model_id"] or None)
    forward_only = req["forward_only"]
    label = "forward" if forward_only else "forward_backward"
    get_loss(req["loss_fn"])  # UserError naming the supported losses
    if not req["data"]:
        raise UserError(f"{label} without data")
    engine_call = state.engine.forward if forward_only else state.engine.forward_backward

    def fn() -> _Outcome:
        outputs, metrics = engine_call(entry.engine_id, req["data"], req["loss_fn"], req["loss_fn_config"])
        if "loss:sum" not in metrics:
            raise RuntimeError("engine returned no 'loss:sum' metric")
        omit = state.faults.omitted_fields(label)
        if omit:  # --fault-omit-field: output keys / metrics a service may leave out
            outputs = [{k: v for k, v in out.items() if k not in omit} for out in outputs]
            metrics = {} if "metrics" in omit else metrics
        return _Outcome("proto", encode_fwdbwd_output(outputs, metrics))

    detail = f"{len(req['data'])} datums {sum(len(tokens) for tokens, _ in req['data'])} tokens"
    return _submit_ordered(state, entry, req["seq_id"] or None, label, fn, detail)


async def _optim_step(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.OptimStepRequest)
    entry = _model(state, req.model_id)
    if not isinstance(req.optim_params, types.AdamParams):
        raise UserError(f"optimizer {req.optim_params.type!r} is not supported; only AdamW (adam_params)")
    adam = req.optim_params.model_dump()  # every field, SDK defaults filled in

    def fn() -> _Outcome:
        metrics = state.engine.optim_step(entry.engine_id, adam)
        return _Outcome("json", dump(types.OptimStepResponse(metrics=state.profile.optim_metrics(metrics))))

    return _submit_ordered(state, entry, req.seq_id, "optim_step", fn)


async def _save_weights(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.SaveWeightsRequest)
    entry = _model(state, req.model_id)
    name = req.path or f"checkpoint-seq{req.seq_id}"

    def fn() -> _Outcome:
        path = state.engine.save_state(entry.engine_id, name, overwrite=req.overwrite)
        state.record_checkpoint(entry, path, req.user_metadata)
        return _Outcome("json", dump(types.SaveWeightsResponse(path=path, type="save_weights")))

    return _submit_ordered(state, entry, req.seq_id, "save_weights", fn)


def _new_sampler(state: ServerState, session_id: str, seq: int, base_model: str, model_path: str | None) -> str:
    sampler_id = f"{session_id}:sample:{seq}"
    state.samplers[sampler_id] = SamplerEntry(sampler_id, base_model, model_path)
    return sampler_id


async def _save_weights_for_sampler(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.SaveWeightsForSamplerRequest)
    entry = _model(state, req.model_id)
    if req.path is None and req.sampling_session_seq_id is None:
        raise ProtocolError("save_weights_for_sampler needs 'path' or 'sampling_session_seq_id'")
    if req.kind != "snapshot":
        raise UserError(f"sampler weights kind {req.kind!r} is not supported by the local server; only 'snapshot'")

    def fn() -> _Outcome:
        path = state.engine.save_for_sampler(entry.engine_id, req.path)
        state.record_checkpoint(entry, path, req.user_metadata)
        sampler_id = None
        if req.path is None:
            sampler_id = _new_sampler(state, entry.session_id, int(req.sampling_session_seq_id), entry.base_model, path)
        return _Outcome("json", dump(SaveWeightsForSamplerResponseInternal(
            path=path, sampling_session_id=sampler_id, type="save_weights_for_sampler")))

    return _submit_ordered(state, entry, req.seq_id, "save_weights_for_sampler", fn)


async def _load_weights(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.LoadWeightsRequest)
    path = req.path
    if req.model_id is not None:  # form 1: load into an existing model, in seq order
        entry = _model(state, req.model_id)

        def fn() -> _Outcome:
            state.engine.load_state(entry.engine_id, path, req.optimizer)
            return _Outcome("json", dump(types.LoadWeightsResponse(path=path, model_id=entry.model_id,
                                                                   type="load_weights")))

        return _submit_ordered(state, entry, req.seq_id, "load_weights", fn)

    # form 2: create-via-load; the SDK derives the model id "{session_id}:train:{model_seq_id}"
    if req.session_id is None or req.model_seq_id is None:
        raise ProtocolError("LoadWeightsRequest: needs model_id, or session_id with model_seq_id")
    session_id, model_seq_id = req.session_id, req.model_seq_id
    _session(state, session_id)
    key = (session_id, model_seq_id)
    if key in state.model_requests:
        return _future_json(state.model_requests[key])
    model_id = f"{session_id}:train:{model_seq_id}"
    request_id, fut = state.new_future()
    state.model_requests[key] = request_id

    async def work() -> _Outcome:
        _check_optimizer(req.optimizer_config)
        engine_id = await _run_engine(
            state, state.misc_pool, "load_weights",
            lambda: state.engine.create_model_from_state(path, req.optimizer, model_id=model_id),
        )
        info = await _run_engine(state, state.misc_pool, "get_info", lambda: state.engine.get_info(engine_id))
        saved = state.checkpoints.get(path)
        base_model = (req.base_model or info.get("requested_base_model")
                      or (saved.base_model if saved else None) or constants.BASE_MODEL)
        _new_entry(state, model_id, engine_id, base_model, session_id, lora_rank=info.get("lora_rank"),
                   user_metadata=_str_metadata(req.user_metadata))
        return _Outcome("json", dump(types.LoadWeightsResponse(path=path, model_id=model_id, type="load_weights")))

    _spawn(state, fut, "load_weights", work)
    return _future_json(request_id, model_id)


# ---- handlers: sampling ------------------------------------------------------------------------


async def _create_sampling_session(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.CreateSamplingSessionRequest)
    _session(state, req.session_id)
    base_model = req.base_model
    if req.model_path is None:
        if base_model is None:
            raise UserError("create_sampling_session needs model_path or base_model")
        _check_served(state, base_model)
    else:
        if not req.model_path.startswith("tinker://"):
            raise UserError(f"model_path must start with tinker://, got {req.model_path!r}")
        saved = state.checkpoints.get(req.model_path)
        base_model = base_model or (saved.base_model if saved else None) or constants.BASE_MODEL
    sampler_id = _new_sampler(state, req.session_id, req.sampling_session_seq_id, base_model, req.model_path)
    return web.json_response(dump(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)))


async def _get_sampler(request: web.Request) -> web.Response:
    state = _state(request)
    sampler_id = request.match_info["sampler_id"]
    if sampler_id not in state.samplers:
        return _error_json(f"unknown sampler {sampler_id!r}", 404)
    s = state.samplers[sampler_id]
    return web.json_response(dump(types.GetSamplerResponse(sampler_id=s.sampler_id, base_model=s.base_model,
                                                           model_path=s.model_path)))


def _unsupported_sample_fields(req: types.SampleRequest) -> list[str]:
    return [name for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k",
                              "target_prompt_logprobs", "record_stability_info") if getattr(req, name)]


async def _asample(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.SampleRequest)
    unsupported = _unsupported_sample_fields(req)
    if unsupported:
        raise UserError(f"asample: {', '.join(unsupported)} not supported by the local server")
    if req.sampling_session_id is not None:
        if req.sampling_session_id not in state.samplers:
            raise UserError(f"asample: unknown sampling_session_id {req.sampling_session_id!r}")
        sampler = state.samplers[req.sampling_session_id]
        target = sampler.model_path or sampler.base_model
    else:
        target = req.model_path or req.base_model
        if not target:
            raise UserError("asample needs sampling_session_id, model_path or base_model")
        if req.model_path is None:
            _check_served(state, target)
    prompt = prompt_tokens_of(req.prompt)
    if not prompt:
        raise UserError("asample: empty prompt")
    if req.num_samples < 1:
        raise UserError(f"asample: num_samples must be >= 1, got {req.num_samples}")
    params = req.sampling_params
    if params.max_tokens is None or params.max_tokens < 1:
        raise UserError(f"asample: sampling_params.max_tokens must be a positive integer, got {params.max_tokens!r}")
    stop_ids, stop_strings = parse_stop(params.stop, state.default_stop_ids())
    want_prompt_lp = bool(req.prompt_logprobs)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not (want_prompt_lp and 1 <= last_n <= len(prompt) - 1):
        raise UserError(f"asample: prompt_logprobs_last_n must be in [1, {len(prompt) - 1}] with prompt_logprobs")
    num_samples = req.num_samples
    request_id, fut = state.new_future()
    sequence_ids = [f"{request_id}:{i}" for i in range(num_samples)]

    def fn() -> _Outcome:
        seqs = state.engine.sample(
            target, prompt, num_samples, params.max_tokens, float(params.temperature), int(params.top_k),
            float(params.top_p), stop_ids, stop_strings, params.seed, want_prompt_lp,
        )
        if len(seqs) != num_samples:
            raise RuntimeError(f"engine returned {len(seqs)} sequences for {num_samples} samples")
        prompt_lp = None
        if want_prompt_lp:
            prompt_lp = _prompt_logprobs_of(seqs, len(prompt))
            if last_n is not None:
                cut = len(prompt) - last_n
                prompt_lp = [None] * cut + prompt_lp[cut:]
        omit = state.faults.omitted_fields("asample")
        return _Outcome("proto", encode_sample_response(seqs, prompt_lp, omit_logprobs="logprobs" in omit))

    async def work() -> _Outcome:
        return await _run_engine(state, state.sample_pool, "asample", fn)

    _spawn(state, fut, "asample", work)
    return _future_json(request_id, sample_sequence_ids=sequence_ids)


def _prompt_logprobs_of(seqs: list[Any], prompt_len: int) -> list[float | None]:
    lp = _seq_attr(seqs[0], "prompt_logprobs")
    if lp is None:
        raise RuntimeError("engine returned no prompt_logprobs although they were requested")
    lp = [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in lp]
    if len(lp) == prompt_len - 1:  # engine scored positions 1..n-1 only
        lp = [None] + lp
    if len(lp) != prompt_len:
        raise RuntimeError(f"engine returned {len(lp)} prompt logprobs for a {prompt_len}-token prompt")
    lp[0] = None
    return lp


# ---- handlers: futures -------------------------------------------------------------------------


async def _retrieve_future(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, types.FutureRetrieveRequest)
    request_id = req.request_id
    fut = state.results.get(request_id)
    if fut is None:
        return _error_json(f"unknown request_id {request_id!r}", 404)
    if not fut.done():
        hold = state.holds.get(fut)
        paused = hold is not None and hold.queue_state != "active"
        try:
            await asyncio.wait_for(asyncio.shield(fut), PAUSED_POLL_S if paused else LONG_POLL_S)
        except TimeoutError:
            pending = TryAgainResponse(request_id=request_id, queue_state=hold.queue_state if paused else "active")
            # queue_state_reason: sent by the service, read by the SDK, not in its TryAgainResponse type
            extra = {"queue_state_reason": hold.reason} if paused and hold.reason else {}
            return web.json_response(dump(pending) | extra, status=408)
    outcome: _Outcome = fut.result()
    if outcome.kind == "proto":
        return web.Response(body=outcome.payload, content_type="application/x-protobuf")
    if outcome.kind == "error":
        return _error_json(outcome.payload, 200, outcome.category)
    return web.json_response(outcome.payload)


async def _cancel_future(request: web.Request) -> web.Response:
    # Same body shape as retrieve_future ({"request_id"}). Engine calls cannot be interrupted;
    # the result is simply never fetched.
    await _parse(request, types.FutureRetrieveRequest)
    return web.json_response({})


# ---- handlers: REST reads (RestClient, cookbook checkpoint_utils) --------------------------------


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ProtocolError(f"query parameter {name} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ProtocolError(f"query parameter {name} must be >= 0, got {value}")
    return value


def _page(request: web.Request, total: int) -> tuple[int, int]:
    limit = _int_query(request, "limit", 20)
    offset = _int_query(request, "offset", 0)
    return offset, offset + limit if limit else total


async def _get_training_run(request: web.Request) -> web.Response:
    state = _state(request)
    model_id = request.match_info["model_id"]
    if model_id not in state.models:
        return _error_json(f"unknown training run {model_id!r}", 404)
    return web.json_response(dump(state.training_run(state.models[model_id])))


async def _list_training_runs(request: web.Request) -> web.Response:
    state = _state(request)
    runs = [state.training_run(e) for e in state.models.values()]
    lo, hi = _page(request, len(runs))
    cursor = types.Cursor(offset=lo, limit=hi - lo, total_count=len(runs))
    return web.json_response(dump(types.TrainingRunsResponse(training_runs=runs[lo:hi], cursor=cursor)))


async def _list_checkpoints(request: web.Request) -> web.Response:
    state = _state(request)
    model_id = request.match_info["model_id"]
    if model_id not in state.models:
        return _error_json(f"unknown training run {model_id!r}", 404)
    mine = [r.checkpoint for r in state.checkpoints.values() if r.model_id == model_id]
    return web.json_response(dump(types.CheckpointsListResponse(checkpoints=mine)))


async def _list_user_checkpoints(request: web.Request) -> web.Response:
    state = _state(request)
    every = [r.checkpoint for r in state.checkpoints.values()]
    lo, hi = _page(request, len(every))
    cursor = types.Cursor(offset=lo, limit=hi - lo, total_count=len(every))
    return web.json_response(dump(types.CheckpointsListResponse(checkpoints=every[lo:hi], cursor=cursor)))


class WeightsInfoRequest(pydantic.BaseModel):
    """Body of `POST weights_info` (RestClient.get_weights_info_by_tinker_path posts it untyped)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    tinker_path: str


async def _weights_info(request: web.Request) -> web.Response:
    state = _state(request)
    req = await _parse(request, WeightsInfoRequest)
    saved = state.checkpoints.get(req.tinker_path)
    if saved is None:
        return _error_json(f"unknown checkpoint {req.tinker_path!r} (not saved through this server)", 404)
    return web.json_response(dump(types.WeightsInfoResponse(
        base_model=saved.base_model, optimizer_config=types.AdamOptimizerConfig(), is_lora=True,
        lora_rank=saved.lora_rank, train_mlp=saved.lora_switches[0], train_attn=saved.lora_switches[1],
        train_unembed=saved.lora_switches[2],
    )))

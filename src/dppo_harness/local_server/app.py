"""aiohttp app speaking the Tinker SDK 0.38 wire protocol over a local `Engine`.

Protocol (read from the SDK source, see docs/local-server.md "HTTP side"):
- Work endpoints answer at once with an `UntypedAPIFuture` (`{"request_id": ...}`); the SDK then
  long-polls `POST /api/v1/retrieve_future`. Pending → HTTP 408 `{"type": "try_again", ...}`
  (the SDK re-polls at once); failure → 200 `{"error": ..., "category": "user"|"server"}`
  (the SDK raises `RequestFailedError`); success → JSON, or protobuf for `ForwardBackwardOutput`
  and `SampleResponse` (SDK 0.38 refuses JSON for those two).
- `forward_backward` requests arrive as protobuf (`forward_only` distinguishes `forward`).
- Requests on one training model run strictly in `seq_id` order on that model's own worker
  thread; sampling runs on a shared thread pool so concurrent samples overlap.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from aiohttp import web

from dppo_harness import constants
from dppo_harness.local_server.faults import CAPACITY_EXHAUSTED_TEXT, FaultInjector, HeaderRecorder

try:  # the Engine contract's user-facing error; fall back so this module imports on its own
    from dppo_harness.local_server.engine import UserError
except ImportError:  # pragma: no cover - only while engine.py is absent

    class UserError(Exception):  # type: ignore[no-redef]
        pass


from tinker.proto import tinker_public_pb2 as pb

log = logging.getLogger("dppo_harness.local_server")

API = "/api/v1"
LONG_POLL_S = 20.0  # the SDK's retrieve_future timeout is 45 s
SEQ_GAP_TIMEOUT_S = 900.0  # a missing earlier seq_id fails the waiting request after this
MAX_KEPT_RESULTS = 20000
FAULT_EXIT_CODE = 75
SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo")

_PB_TO_NP = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_INT64: np.int64,
    pb.DTYPE_INT32: np.int32,
}


class ProtocolError(Exception):
    """A request the server cannot parse: answered with HTTP 400 and a message naming the field."""


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
    if content_encoding and "zstd" in content_encoding.lower():
        import zstandard

        body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError subclasses
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


def encode_sample_response(seqs: list[Any], prompt_logprobs: list[float | None] | None) -> bytes:
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
        out.logprobs = logprobs.tobytes()
    if prompt_logprobs is not None:
        values = [math.nan if v is None else float(v) for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()


def parse_stop(stop: Any, default_ids: list[int]) -> tuple[list[int], list[str]]:
    """SamplingParams.stop: None → the model's EOS; [] → nothing; str / [str] / [int]."""
    if stop is None:
        return list(default_ids), []
    if isinstance(stop, str):
        return [], [stop]
    if not isinstance(stop, list):
        raise UserError(f"sampling_params.stop must be a string or a list, got {type(stop).__name__}")
    if all(isinstance(s, str) for s in stop):
        return [], list(stop)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return list(stop), []
    raise UserError("sampling_params.stop must be all strings or all token ids")


def prompt_tokens_of(model_input: dict) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.get("chunks", [])):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"prompt chunk {i} has type {chunk.get('type')!r}; only token chunks are supported")
        tokens.extend(int(t) for t in chunk["tokens"])
    return tokens


# ---- server state ------------------------------------------------------------------------------


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
    next_seq: int = 1
    requests_by_seq: dict[int, str] = field(default_factory=dict)


@dataclass
class SamplerEntry:
    sampler_id: str
    base_model: str
    model_path: str | None


@dataclass
class ServerState:
    engine: Any
    faults: FaultInjector
    headers: HeaderRecorder
    sample_workers: int = 64
    started: float = field(default_factory=time.time)
    on_die: Callable[[str], None] | None = None  # called instead of os._exit in-process
    stats_path: Any = None  # written when the process exits on purpose (fault die, SIGTERM)

    def __post_init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.models: dict[str, ModelEntry] = {}
        self.samplers: dict[str, SamplerEntry] = {}
        self.path_base_model: dict[str, str] = {}
        self.results: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.model_requests: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> request
        self.sample_pool = ThreadPoolExecutor(self.sample_workers, thread_name_prefix="sample")
        self.misc_pool = ThreadPoolExecutor(2, thread_name_prefix="misc")
        self._ids = itertools.count(1)
        self.engine_seconds: dict[str, float] = {}
        self.inflight = 0
        self.telemetry_events = 0
        self.tasks: set[asyncio.Task] = set()

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

    def served_models(self) -> list[str]:
        return list(getattr(self.engine, "served_models", [constants.BASE_MODEL]))

    def stats(self) -> dict[str, Any]:
        return {
            "uptime_s": time.time() - self.started,
            "served_model": self.engine.served_model_name,
            "faults": self.faults.snapshot(),
            "headers": self.headers.snapshot(),
            "sessions": len(self.sessions),
            "models": {m: e.engine_id for m, e in self.models.items()},
            "samplers": len(self.samplers),
            "inflight": self.inflight,
            "telemetry_events": self.telemetry_events,
            "engine_seconds": dict(self.engine_seconds),
        }

    def shutdown(self) -> None:
        for entry in self.models.values():
            entry.executor.shutdown(wait=False, cancel_futures=True)
        self.sample_pool.shutdown(wait=False, cancel_futures=True)
        self.misc_pool.shutdown(wait=False, cancel_futures=True)


def _error_json(message: str, status: int, category: str = "user") -> web.Response:
    return web.json_response({"error": message, "category": category}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    return body


def _require(body: dict, name: str, typ: type | tuple[type, ...]) -> Any:
    if name not in body or body[name] is None:
        raise ProtocolError(f"missing field {name!r}")
    if not isinstance(body[name], typ):
        raise ProtocolError(f"field {name!r} has type {type(body[name]).__name__}")
    return body[name]


# ---- work execution ----------------------------------------------------------------------------


async def _run_engine(state: ServerState, executor: ThreadPoolExecutor, label: str, fn: Callable[[], Any]) -> Any:
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    state.inflight += 1
    try:
        return await loop.run_in_executor(executor, fn)
    finally:
        state.inflight -= 1
        state.engine_seconds[label] = state.engine_seconds.get(label, 0.0) + time.perf_counter() - t0


def _outcome_of_exception(exc: BaseException, label: str) -> _Outcome:
    if isinstance(exc, UserError):
        return _Outcome("error", str(exc), "user")
    log.error("engine error in %s:\n%s", label, "".join(traceback.format_exception(exc)))
    return _Outcome("error", f"{label} failed on the local server: {type(exc).__name__}: {exc}", "server")


def _spawn(state: ServerState, fut: asyncio.Future, label: str, coro_fn: Callable[[], Any]) -> None:
    """Run `coro_fn()` in the background and resolve `fut` with its _Outcome."""

    async def runner() -> None:
        try:
            outcome = await coro_fn()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a failed future
            outcome = _outcome_of_exception(exc, label)
        if not fut.done():
            fut.set_result(outcome)

    task = asyncio.get_running_loop().create_task(runner())
    state.tasks.add(task)  # the loop keeps only weak references
    task.add_done_callback(state.tasks.discard)


async def _in_seq_order(state: ServerState, entry: ModelEntry, seq_id: int | None, label: str, fn: Callable[[], Any]) -> Any:
    """Run `fn` on the model's worker once every earlier seq_id of the model has finished."""
    if seq_id is None:
        return await _run_engine(state, entry.executor, label, fn)
    async with entry.cond:
        try:
            await asyncio.wait_for(entry.cond.wait_for(lambda: entry.next_seq >= seq_id), SEQ_GAP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise UserError(
                f"{label}: seq_id {seq_id} waited {SEQ_GAP_TIMEOUT_S:.0f}s for seq_id {entry.next_seq} "
                f"of model {entry.model_id}, which never arrived"
            ) from None
    try:
        return await _run_engine(state, entry.executor, label, fn)
    finally:
        async with entry.cond:
            entry.next_seq = max(entry.next_seq, seq_id + 1)
            entry.cond.notify_all()


def _submit_ordered(state: ServerState, entry: ModelEntry, seq_id: int | None, label: str,
                    fn: Callable[[], _Outcome]) -> web.Response:
    if seq_id is not None:
        if seq_id in entry.requests_by_seq:  # a resent request: same future
            return web.json_response({"request_id": entry.requests_by_seq[seq_id], "model_id": entry.model_id})
        if seq_id < entry.next_seq:
            return _error_json(
                f"{label}: seq_id {seq_id} of model {entry.model_id} is older than the next expected "
                f"seq_id {entry.next_seq}", 400)
    request_id, fut = state.new_future()
    if seq_id is not None:
        entry.requests_by_seq[seq_id] = request_id

    async def work() -> _Outcome:
        return await _in_seq_order(state, entry, seq_id, label, fn)

    _spawn(state, fut, label, work)
    return web.json_response({"request_id": request_id, "model_id": entry.model_id})


def _model(state: ServerState, model_id: Any) -> ModelEntry:
    if not isinstance(model_id, str) or model_id not in state.models:
        raise UserError(f"unknown model_id {model_id!r}: create it with create_model or load_weights first")
    return state.models[model_id]


def _new_entry(state: ServerState, model_id: str, engine_id: str, base_model: str, session_id: str,
               next_seq: int = 1) -> ModelEntry:
    entry = ModelEntry(
        model_id=model_id,
        engine_id=engine_id,
        base_model=base_model,
        session_id=session_id,
        executor=ThreadPoolExecutor(1, thread_name_prefix=f"model-{len(state.models)}"),
        cond=asyncio.Condition(),
        next_seq=next_seq,
    )
    state.models[model_id] = entry
    return entry


# ---- handlers ----------------------------------------------------------------------------------


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_middleware(state)], client_max_size=512 * 1024 * 1024)
    app["state"] = state
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
    r.add_get("/_harness/stats", _stats)
    return app


def _state(request: web.Request) -> ServerState:
    return request.app["state"]


def _middleware(state: ServerState):
    @web.middleware
    async def middleware(request: web.Request, handler):
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
            body = {"error": decision.reject_reason, "category": "server"}
            return web.json_response(body, status=decision.reject_status, headers=headers)
        try:
            return await handler(request)
        except ProtocolError as exc:
            return _error_json(f"{kind}: {exc}", 400)
        except UserError as exc:
            return _error_json(f"{kind}: {exc}", 400)

    return middleware


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(_state(request).stats())


async def _capabilities(request: web.Request) -> web.Response:
    state = _state(request)
    config = getattr(state.engine, "config", None)
    max_ctx = getattr(config, "max_position_embeddings", None)
    models = [
        {"model_name": name, "max_context_length": max_ctx, "trainable": True, "sampleable": True}
        for name in state.served_models()
    ]
    return web.json_response({"supported_models": models})


async def _client_config(request: web.Request) -> web.Response:
    # API-key auth, httpx transport, uncompressed protobuf, client-side custom losses,
    # per-request retrieve_future polling: the simplest paths of SDK 0.38.
    return web.json_response(
        {
            "pjwt_auth_enabled": False,
            "credential_default_source": "api_key",
            "use_pyqwest_transport": False,
            "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": True,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }
    )


async def _client_dynamic_config(request: web.Request) -> web.Response:
    return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})


async def _create_session(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    session_id = str(uuid.uuid4())
    state.sessions[session_id] = {
        "created": time.time(),
        "last_heartbeat": time.time(),
        "finished": None,
        "sdk_version": body.get("sdk_version"),
        "tags": body.get("tags", []),
    }
    return web.json_response({"type": "create_session", "session_id": session_id})


def _session(state: ServerState, session_id: Any) -> dict[str, Any]:
    if not isinstance(session_id, str) or session_id not in state.sessions:
        raise UserError(f"unknown session_id {session_id!r}")
    return state.sessions[session_id]


async def _session_heartbeat(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    session = _session(state, body.get("session_id"))
    if session["finished"] is not None:
        return _error_json("session is finished", 410)
    session["last_heartbeat"] = time.time()
    return web.json_response({"type": "session_heartbeat"})


async def _telemetry(request: web.Request) -> web.Response:
    body = await _json_body(request)
    _state(request).telemetry_events += len(body.get("events", []))
    return web.json_response({"status": "accepted"})


async def _finish_session(request: web.Request) -> web.Response:
    state = _state(request)
    session = _session(state, request.match_info["session_id"])
    body = await _json_body(request)
    if session["finished"] is None:  # first reason wins
        session["finished"] = (body.get("reason") or {}).get("type", "unknown")
    return web.json_response({})


async def _get_session(request: web.Request) -> web.Response:
    state = _state(request)
    session_id = request.match_info["session_id"]
    session = _session(state, session_id)
    models = [m for m, e in state.models.items() if e.session_id == session_id]
    samplers = [s for s in state.samplers if s.startswith(session_id)]
    return web.json_response({"training_run_ids": models, "sampler_ids": samplers,
                              "finished": session["finished"]})


async def _create_model(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    session_id = _require(body, "session_id", str)
    model_seq_id = _require(body, "model_seq_id", int)
    base_model = _require(body, "base_model", str)
    key = (session_id, model_seq_id)
    if key in state.model_requests:  # resent request
        return web.json_response({"request_id": state.model_requests[key]})
    _session(state, session_id)
    lora = body.get("lora_config") or {}
    optimizer = body.get("optimizer_config") or {"type": "adamw"}
    request_id, fut = state.new_future()
    state.model_requests[key] = request_id
    model_id = f"{session_id}:train:{model_seq_id}"

    async def work() -> _Outcome:
        if state.faults.take_capacity_failure():
            state.model_requests.pop(key, None)  # a retry is a new creation attempt
            return _Outcome("error", f"{CAPACITY_EXHAUSTED_TEXT}: no trainer available for {base_model}", "server")
        if optimizer.get("type", "adamw") != "adamw":
            raise UserError(f"optimizer {optimizer.get('type')!r} is not supported; only 'adamw'")
        if base_model not in state.served_models():
            raise UserError(
                f"base model {base_model!r} is not served by the local server; served models: "
                f"{state.served_models()}"
            )
        rank = lora.get("rank")
        if not isinstance(rank, int) or rank <= 0:
            raise UserError(f"lora_config.rank must be a positive integer, got {rank!r}")
        engine_id = await _run_engine(
            state, state.misc_pool, "create_model",
            lambda: state.engine.create_model(base_model, rank, lora.get("seed"), model_id=model_id),
        )
        _new_entry(state, model_id, engine_id, base_model, session_id)
        return _Outcome("json", {"model_id": model_id, "type": "create_model"})

    _spawn(state, fut, "create_model", work)
    return web.json_response({"request_id": request_id})


async def _get_info(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    entry = _model(state, body.get("model_id"))
    info = state.engine.get_info(entry.engine_id)
    optimizer = info.get("optimizer_config") or {"type": "adamw"}
    if not isinstance(optimizer, dict) or optimizer.get("type") != "adamw":
        optimizer = {"type": "adamw"}
    return web.json_response(
        {
            "type": "get_info",
            "model_data": {
                "arch": str(info.get("model_name") or ""),
                "model_name": entry.base_model,
                "tokenizer_id": entry.base_model,
            },
            "model_id": entry.model_id,
            "optimizer_config": optimizer,
            "is_lora": bool(info.get("is_lora", True)),
            "lora_rank": info.get("lora_rank"),
            "model_name": entry.base_model,
        }
    )


async def _forward_backward(request: web.Request) -> web.Response:
    state = _state(request)
    body = await request.read()
    req = decode_fwdbwd_request(body, request.headers.get("Content-Encoding"))
    entry = _model(state, req["model_id"])
    loss_fn = req["loss_fn"]
    forward_only = req["forward_only"]
    label = "forward" if forward_only else "forward_backward"
    if loss_fn not in SUPPORTED_LOSSES:
        raise UserError(f"{label} with loss_fn {loss_fn!r} is not supported; use one of {SUPPORTED_LOSSES}")
    if not req["data"]:
        raise UserError(f"{label} without data")
    engine_call = state.engine.forward if forward_only else state.engine.forward_backward

    def fn() -> _Outcome:
        outputs, metrics = engine_call(entry.engine_id, req["data"], loss_fn, req["loss_fn_config"])
        if "loss:sum" not in metrics:
            raise RuntimeError("engine returned no 'loss:sum' metric")
        return _Outcome("proto", encode_fwdbwd_output(outputs, metrics))

    return _submit_ordered(state, entry, req["seq_id"] or None, label, fn)


async def _optim_step(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    entry = _model(state, body.get("model_id"))
    params = body.get("adam_params")
    if params is None:
        other = body.get("optimizer_params") or {}
        raise UserError(f"optim_step: optimizer {other.get('type')!r} is not supported; only AdamW (adam_params)")
    if not isinstance(params, dict):
        raise ProtocolError("adam_params must be an object")
    adam = {
        "learning_rate": float(params.get("learning_rate", 1e-4)),
        "beta1": float(params.get("beta1", 0.9)),
        "beta2": float(params.get("beta2", 0.95)),
        "eps": float(params.get("eps", 1e-12)),
        "weight_decay": float(params.get("weight_decay", 0.0)),
        "grad_clip_norm": float(params.get("grad_clip_norm", 0.0)),
    }

    def fn() -> _Outcome:
        metrics = state.engine.optim_step(entry.engine_id, adam)
        return _Outcome("json", {"metrics": {k: float(v) for k, v in metrics.items()}})

    return _submit_ordered(state, entry, body.get("seq_id"), "optim_step", fn)


async def _save_weights(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    entry = _model(state, body.get("model_id"))
    seq_id = body.get("seq_id")
    name = body.get("path") or f"checkpoint-seq{seq_id}"
    overwrite = bool(body.get("overwrite", False))

    def fn() -> _Outcome:
        path = state.engine.save_state(entry.engine_id, name, overwrite=overwrite)
        state.path_base_model[path] = entry.base_model
        return _Outcome("json", {"path": path, "type": "save_weights"})

    return _submit_ordered(state, entry, seq_id, "save_weights", fn)


def _new_sampler(state: ServerState, session_id: str, seq: int, base_model: str, model_path: str | None) -> str:
    sampler_id = f"{session_id}:sample:{seq}"
    state.samplers[sampler_id] = SamplerEntry(sampler_id, base_model, model_path)
    return sampler_id


async def _save_weights_for_sampler(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    entry = _model(state, body.get("model_id"))
    name = body.get("path")
    sampling_seq = body.get("sampling_session_seq_id")
    if name is None and sampling_seq is None:
        raise ProtocolError("save_weights_for_sampler needs 'path' or 'sampling_session_seq_id'")

    def fn() -> _Outcome:
        path = state.engine.save_for_sampler(entry.engine_id, name)
        state.path_base_model[path] = entry.base_model
        result: dict[str, Any] = {"path": path, "type": "save_weights_for_sampler"}
        if name is None:
            result["sampling_session_id"] = _new_sampler(state, entry.session_id, int(sampling_seq), entry.base_model, path)
        return _Outcome("json", result)

    return _submit_ordered(state, entry, body.get("seq_id"), "save_weights_for_sampler", fn)


async def _load_weights(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    path = _require(body, "path", str)
    with_optimizer = bool(body.get("optimizer", False))
    if body.get("model_id") is not None:  # form 1: load into an existing model, in seq order
        entry = _model(state, body["model_id"])

        def fn() -> _Outcome:
            state.engine.load_state(entry.engine_id, path, with_optimizer)
            return _Outcome("json", {"path": path, "model_id": entry.model_id, "type": "load_weights"})

        return _submit_ordered(state, entry, body.get("seq_id"), "load_weights", fn)

    # form 2: create-via-load; the SDK derives the model id "{session_id}:train:{model_seq_id}"
    session_id = _require(body, "session_id", str)
    model_seq_id = _require(body, "model_seq_id", int)
    _session(state, session_id)
    key = (session_id, model_seq_id)
    if key in state.model_requests:
        return web.json_response({"request_id": state.model_requests[key]})
    model_id = f"{session_id}:train:{model_seq_id}"
    optimizer = body.get("optimizer_config") or {"type": "adamw"}
    request_id, fut = state.new_future()
    state.model_requests[key] = request_id

    async def work() -> _Outcome:
        if optimizer.get("type", "adamw") != "adamw":
            raise UserError(f"optimizer {optimizer.get('type')!r} is not supported; only 'adamw'")
        engine_id = await _run_engine(
            state, state.misc_pool, "load_weights",
            lambda: state.engine.create_model_from_state(path, with_optimizer, model_id=model_id),
        )
        info = await _run_engine(state, state.misc_pool, "get_info", lambda: state.engine.get_info(engine_id))
        base_model = (body.get("base_model") or info.get("requested_base_model")
                      or state.path_base_model.get(path) or constants.BASE_MODEL)
        _new_entry(state, model_id, engine_id, base_model, session_id)
        return _Outcome("json", {"path": path, "model_id": model_id, "type": "load_weights"})

    _spawn(state, fut, "load_weights", work)
    return web.json_response({"request_id": request_id, "model_id": model_id})


async def _create_sampling_session(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    session_id = _require(body, "session_id", str)
    seq = _require(body, "sampling_session_seq_id", int)
    _session(state, session_id)
    model_path = body.get("model_path")
    base_model = body.get("base_model")
    if model_path is None:
        if base_model is None:
            raise UserError("create_sampling_session needs model_path or base_model")
        if base_model not in state.served_models():
            raise UserError(f"base model {base_model!r} is not served; served models: {state.served_models()}")
    else:
        if not model_path.startswith("tinker://"):
            raise UserError(f"model_path must start with tinker://, got {model_path!r}")
        base_model = base_model or state.path_base_model.get(model_path) or constants.BASE_MODEL
    sampler_id = _new_sampler(state, session_id, seq, base_model, model_path)
    return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})


async def _get_sampler(request: web.Request) -> web.Response:
    state = _state(request)
    sampler_id = request.match_info["sampler_id"]
    if sampler_id not in state.samplers:
        return _error_json(f"unknown sampler {sampler_id!r}", 404)
    s = state.samplers[sampler_id]
    return web.json_response({"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path})


_UNSUPPORTED_SAMPLE_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


async def _asample(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    for name in _UNSUPPORTED_SAMPLE_FIELDS:
        if body.get(name):
            raise UserError(f"asample: {name} is not supported by the local server")
    if body.get("target_prompt_logprobs") is not None:
        raise UserError("asample: target_prompt_logprobs is not supported by the local server")
    sampler_id = body.get("sampling_session_id")
    if sampler_id is not None:
        if sampler_id not in state.samplers:
            raise UserError(f"asample: unknown sampling_session_id {sampler_id!r}")
        sampler = state.samplers[sampler_id]
        target = sampler.model_path or sampler.base_model
    else:
        target = body.get("model_path") or body.get("base_model")
        if not target:
            raise UserError("asample needs sampling_session_id, model_path or base_model")
    prompt = prompt_tokens_of(_require(body, "prompt", dict))
    if not prompt:
        raise UserError("asample: empty prompt")
    params = _require(body, "sampling_params", dict)
    num_samples = int(body.get("num_samples", 1))
    if num_samples < 1:
        raise UserError(f"asample: num_samples must be >= 1, got {num_samples}")
    max_tokens = params.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"asample: sampling_params.max_tokens must be a positive integer, got {max_tokens!r}")
    stop_ids, stop_strings = parse_stop(params.get("stop"), state.default_stop_ids())
    want_prompt_lp = bool(body.get("prompt_logprobs"))
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None and not (want_prompt_lp and 1 <= int(last_n) <= len(prompt) - 1):
        raise UserError(f"asample: prompt_logprobs_last_n must be in [1, {len(prompt) - 1}] with prompt_logprobs")
    request_id, fut = state.new_future()
    sequence_ids = [f"{request_id}:{i}" for i in range(num_samples)]

    def fn() -> _Outcome:
        seqs = state.engine.sample(
            target, prompt, num_samples, max_tokens,
            float(params.get("temperature", 1.0)), int(params.get("top_k", -1)),
            float(params.get("top_p", 1.0)), stop_ids, stop_strings, params.get("seed"), want_prompt_lp,
        )
        if len(seqs) != num_samples:
            raise RuntimeError(f"engine returned {len(seqs)} sequences for {num_samples} samples")
        prompt_lp = None
        if want_prompt_lp:
            prompt_lp = _prompt_logprobs_of(seqs, len(prompt))
            if last_n is not None:
                cut = len(prompt) - int(last_n)
                prompt_lp = [None] * cut + prompt_lp[cut:]
        return _Outcome("proto", encode_sample_response(seqs, prompt_lp))

    async def work() -> _Outcome:
        return await _run_engine(state, state.sample_pool, "asample", fn)

    _spawn(state, fut, "asample", work)
    return web.json_response({"request_id": request_id, "sample_sequence_ids": sequence_ids})


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


async def _retrieve_future(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    request_id = _require(body, "request_id", str)
    fut = state.results.get(request_id)
    if fut is None:
        return _error_json(f"unknown request_id {request_id!r}", 404)
    if not fut.done():
        try:
            await asyncio.wait_for(asyncio.shield(fut), LONG_POLL_S)
        except asyncio.TimeoutError:
            return web.json_response(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}, status=408
            )
    outcome: _Outcome = fut.result()
    if outcome.kind == "proto":
        return web.Response(body=outcome.payload, content_type="application/x-protobuf")
    if outcome.kind == "error":
        return web.json_response({"error": outcome.payload, "category": outcome.category})
    return web.json_response(outcome.payload)


async def _cancel_future(request: web.Request) -> web.Response:
    # Engine calls cannot be interrupted; the result is simply never fetched.
    await _json_body(request)
    return web.json_response({})

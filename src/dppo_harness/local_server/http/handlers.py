"""The routes' handlers: service (health, capabilities, client config, sessions, telemetry),
training (create_model, get_info, forward(_backward), optim_step, save/load weights, unload_model;
work on one model runs in its `seq_id` order), sampling, futures and the REST reads."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable

import pydantic
from aiohttp import web
from pydantic import JsonValue
from tinker import types

from dppo_harness import constants
from dppo_harness.json_types import JsonObject
from dppo_harness.local_server.errors import SpindleError, UserError
from dppo_harness.local_server.faults import CAPACITY_REFUSED
from dppo_harness.local_server.http import spindle
from dppo_harness.local_server.http.codecs import (
    ProtocolError,
    decode_fwdbwd_request,
    dump,
    encode_fwdbwd_output,
    encode_sample_response,
    parse_request,
    parse_stop,
    prompt_tokens_of,
)
from dppo_harness.local_server.http.state import (
    STATE_KEY,
    ModelEntry,
    Outcome,
    ServerState,
    error_json,
    future_json,
    parse_body,
    str_metadata,
)
from dppo_harness.local_server.profiles import spindle_deployments

MAX_TELEMETRY_BODIES = 1000
LONG_POLL_S = 20.0  # the SDK's retrieve_future timeout is 45 s
PAUSED_POLL_S = 1.0  # a paused request's polls are held this long (the SDK re-polls a 408 at once)
UNLOAD_DRAIN_S = 10.0  # how long an unload waits for the model's accepted requests
CHECKPOINT_VOLUME = "spindle-checkpoints"  # Spindle's default checkpoint volume name


def ok(response: pydantic.BaseModel | JsonObject) -> web.Response:
    return web.json_response(dump(response) if isinstance(response, pydantic.BaseModel) else response)


# ---- service --------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return ok(types.HealthResponse(status="ok"))


async def stats(request: web.Request) -> web.Response:
    return ok(request.app[STATE_KEY].stats())


async def get_server_capabilities(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    max_ctx = state.engine.config.max_position_embeddings
    if state.profile.is_spindle:  # one entry per deployed base model, no parameterization (deployments.py)
        served = [(d.base_model, d.max_context_length) for d in spindle_deployments(max_ctx)]
    else:
        served = [(name, max_ctx) for name in state.profile.served_models(state.engine.served_models)]
    listed: list[JsonValue] = [dump(types.SupportedModel(model_name=n, max_context_length=c)) for n, c in served]
    # Extra key (the SDK's type ignores it): who is really answering.
    body: JsonObject = {"supported_models": listed, "embedded_server": state.marker()}
    return ok(state.faults.omit_json("get_server_capabilities", body))


async def deployments(request: web.Request) -> web.Response:
    """`GET spindle/deployments`: every deployed definition (control_plane/http.py, `list_deployments`)."""
    max_ctx = request.app[STATE_KEY].engine.config.max_position_embeddings
    return ok({"deployments": [dataclasses.asdict(d) for d in spindle_deployments(max_ctx)]})


async def client_config(request: web.Request) -> web.Response:
    """The feature flags SDK 0.25 reads once per client (tinker/types/client_config_response.py)."""
    return ok(request.app[STATE_KEY].profile.client_config())


async def client_dynamic_config(request: web.Request) -> web.Response:
    return ok(types.ClientDynamicConfigResponse(refresh_interval_sec=300))


async def create_session(request: web.Request) -> web.Response:
    await parse_body(request, types.CreateSessionRequest)
    session_id = str(uuid.uuid4())
    request.app[STATE_KEY].sessions[session_id] = time.time()
    return ok(types.CreateSessionResponse(session_id=session_id))


async def session_heartbeat(request: web.Request) -> web.Response:
    req = await parse_body(request, types.SessionHeartbeatRequest)
    request.app[STATE_KEY].session(req.session_id, heartbeat=True)
    return ok(types.SessionHeartbeatResponse())


async def telemetry(request: web.Request) -> web.Response:
    raw = await request.read()
    parse_request(types.TelemetrySendRequest, raw)
    state = request.app[STATE_KEY]
    if len(state.telemetry_bodies) < MAX_TELEMETRY_BODIES:
        state.telemetry_bodies.append(raw)
    return ok(types.TelemetryResponse(status="accepted"))


# ---- training -------------------------------------------------------------------------------------


def _creation(
    state: ServerState, session_id: str, seq: int, label: str, build: Callable[[str], Awaitable[Outcome]]
) -> web.Response:
    """A model creation (create_model, or load_weights creating from state): one future per
    (session, model_seq_id), a resend answers the same one. Spindle answers the model id with it."""
    state.session(session_id)
    model_id = f"{session_id}:train:{seq}"
    answered_id = model_id if state.profile.is_spindle or label == "load_weights" else None
    key = (session_id, seq)
    if key in state.model_requests:  # resent request
        return future_json(state.model_requests[key], answered_id)
    request_id, fut = state.new_future()
    state.model_requests[key] = request_id
    state.creation_requests.add(request_id)
    state.spawn(label, lambda: build(model_id), fut)
    return future_json(request_id, answered_id)


async def create_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.CreateModelRequest)
    if state.profile.is_spindle:
        spindle.check_creation(req)
    state.session(req.session_id)
    lora = req.lora_config
    if lora is None:
        raise UserError("lora_config is required: the local server trains LoRA adapters only")

    async def build(model_id: str) -> Outcome:
        assert lora is not None  # refused above
        if state.faults.take_capacity_failure():
            state.model_requests.pop((req.session_id, req.model_seq_id), None)  # a retry is a new creation attempt
            return Outcome("error", CAPACITY_REFUSED, "server")
        if state.profile.is_spindle:  # the trainer's cold start, a LoRA slot, then Miles' checks
            refusal = spindle.lora_refusal(lora.rank, lora.seed, (lora.train_mlp, lora.train_attn, lora.train_unembed))
            refused = await spindle.admit_creation(state, model_id, req.session_id, refusal)
            if refused is not None:
                return refused
        engine_id = await state.run_engine(
            state.misc_pool,
            "create_model",
            lambda: state.engine.create_model(
                req.base_model,
                lora.rank,
                lora.seed,
                model_id=model_id,
                train_mlp=lora.train_mlp,
                train_attn=lora.train_attn,
                train_unembed=lora.train_unembed,
            ),
        )
        state.models[model_id] = ModelEntry(
            model_id, engine_id, req.base_model, req.session_id, lora.rank, str_metadata(req.user_metadata)
        )
        return Outcome("json", dump(types.CreateModelResponse(model_id=model_id)))

    return _creation(state, req.session_id, req.model_seq_id, "create_model", build)


async def get_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.GetInfoRequest)
    entry = state.model(req.model_id)
    spindle_profile, served = state.profile.is_spindle, state.engine.served_model_name
    response = types.GetInfoResponse(
        type="get_info",
        # its own model's name, as a service names what computes (the requested name is an alias);
        # Spindle sends no architecture, tokenizer id or optimizer config (control_plane/http.py, get_info)
        model_data=types.ModelData(model_name=served, tokenizer_id=None if spindle_profile else entry.base_model),
        model_id=entry.model_id,
        is_lora=True,
        lora_rank=entry.lora_rank,
        model_name=served,
    )
    info = dump(response) | ({"parameterization": {"type": "lora"}} if spindle_profile else {})
    return ok(state.faults.omit_json("get_info", info))


async def forward_backward(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = decode_fwdbwd_request(await request.read(), request.headers.get("Content-Encoding"))
    entry = state.model(req.model_id or None)
    label = "forward" if req.forward_only else "forward_backward"
    engine_call = state.engine.forward if req.forward_only else state.engine.forward_backward

    def fn() -> Outcome:
        outputs, metrics = engine_call(entry.engine_id, req.data, req.loss_fn, req.loss_fn_config)
        omit = state.faults.omitted_fields(label)
        if omit:  # --fault-omit-field: output keys / metrics a service may leave out
            outputs = [{k: v for k, v in out.items() if k not in omit} for out in outputs]
            metrics = {} if "metrics" in omit else metrics
        return Outcome("proto", encode_fwdbwd_output(outputs, metrics))

    detail = f"{len(req.data)} datums {sum(len(tokens) for tokens, _ in req.data)} tokens"
    return state.submit_ordered(entry, req.seq_id or None, label, fn, detail)


async def optim_step(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.OptimStepRequest)
    entry = state.model(req.model_id)
    adam = req.adam_params.model_dump()  # every field, SDK defaults filled in (SDK 0.25: AdamW only)

    def fn() -> Outcome:
        t0 = time.perf_counter()
        metrics = state.engine.optim_step(entry.engine_id, adam)
        answered = state.profile.optim_metrics(metrics, time.perf_counter() - t0)
        return Outcome("json", dump(types.OptimStepResponse(metrics=answered)))

    return state.submit_ordered(entry, req.seq_id, "optim_step", fn)


async def save_weights(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.SaveWeightsRequest)
    entry = state.model(req.model_id)
    name = req.path or f"checkpoint-seq{req.seq_id}"

    def fn() -> Outcome:
        if (
            state.profile.is_spindle
            and not req.overwrite
            and f"tinker://{entry.model_id}/weights/{name}" in state.checkpoints
        ):
            # Spindle's Miles backend installs into /checkpoints/<name>/<model_id> and raises a plain
            # FileExistsError (backends/miles_lora.py `_install_directory`); its engine reports a
            # failed persist as "<type>: <text>", category server (engine/server.py `_failure`).
            text = f"FileExistsError: checkpoint already exists: /checkpoints/{name}/{entry.model_id}"
            return Outcome("error", text, "server")
        path = state.engine.save_state(entry.engine_id, name, overwrite=req.overwrite)
        state.record_checkpoint(path)
        return Outcome("json", dump(types.SaveWeightsResponse(path=path, type="save_weights")))

    return state.submit_ordered(entry, req.seq_id, "save_weights", fn)


async def save_weights_for_sampler(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.SaveWeightsForSamplerRequest)
    entry = state.model(req.model_id)
    if req.path is None and req.sampling_session_seq_id is None:
        raise ProtocolError("save_weights_for_sampler needs 'path' or 'sampling_session_seq_id'")

    def fn() -> Outcome:
        path = state.engine.save_for_sampler(entry.engine_id, req.path)
        state.record_checkpoint(path)
        sampler_id = None
        if req.path is None and req.sampling_session_seq_id is not None:
            sampler_id = state.new_sampler(entry.session_id, int(req.sampling_session_seq_id), entry.base_model, path)
        response = types.SaveWeightsForSamplerResponseInternal(
            path=path, sampling_session_id=sampler_id, type="save_weights_for_sampler"
        )
        return Outcome("json", dump(response))

    return state.submit_ordered(entry, req.seq_id, "save_weights_for_sampler", fn)


async def load_weights(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.LoadWeightsRequest)
    path = req.path
    if req.model_id is not None:  # form 1: load into an existing model, in seq order
        entry = state.model(req.model_id)

        def fn() -> Outcome:
            state.engine.load_state(entry.engine_id, path, req.optimizer)
            return Outcome(
                "json", dump(types.LoadWeightsResponse(path=path, model_id=entry.model_id, type="load_weights"))
            )

        return state.submit_ordered(entry, req.seq_id, "load_weights", fn)
    # form 2: create-via-load; the SDK derives the model id "{session_id}:train:{model_seq_id}"
    if req.session_id is None or req.model_seq_id is None:
        raise ProtocolError("LoadWeightsRequest: needs model_id, or session_id with model_seq_id")
    session_id = req.session_id

    async def build(model_id: str) -> Outcome:
        if state.profile.is_spindle:  # a creation like create_model: cold trainer, a LoRA slot
            refused = await spindle.admit_creation(state, model_id, session_id)
            if refused is not None:
                return refused
        engine_id, meta = await state.run_engine(
            state.misc_pool,
            "load_weights",
            lambda: (
                state.engine.create_model_from_state(path, req.optimizer, model_id=model_id),
                state.engine.read_checkpoint(path)[1],
            ),
        )
        base_model = req.base_model or meta["requested_base_model"]
        state.models[model_id] = ModelEntry(
            model_id, engine_id, base_model, session_id, int(meta["lora_rank"]), str_metadata(req.user_metadata)
        )
        if state.profile.is_spindle:
            # A creation resolves to its type and model id only, no path
            # (src/spindle/control_plane/service.py, `_retrieve_creation`).
            return Outcome("json", {"type": "load_weights", "model_id": model_id})
        return Outcome("json", dump(types.LoadWeightsResponse(path=path, model_id=model_id, type="load_weights")))

    return _creation(state, session_id, req.model_seq_id, "load_weights", build)


async def unload_model(request: web.Request) -> web.Response:
    """`POST unload_model {"model_id"}` (SDK 0.25: tinker/resources/models.py `unload`): a future
    resolving once the model's earlier requests are done; its id answers as unknown from then on."""
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.UnloadModelRequest)
    entry = state.model(req.model_id)
    if state.profile.is_spindle:  # the slot is free at once; a waiting creation proceeds (service.py unload_model)
        await state.release_slot(entry.model_id)

    async def work() -> Outcome:
        # After the requests already accepted for the model, but not after one a fault holds
        # forever (--fault-queue-pause KIND:N:forever:active): the unload frees the model all the same.
        async with entry.cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.cond.wait_for(lambda: entry.pending == 0), UNLOAD_DRAIN_S)
        await state.run_engine(entry.executor, "unload_model", lambda: state.engine.unload_model(entry.engine_id))
        state.models.pop(entry.model_id, None)
        entry.executor.shutdown(wait=False)
        return Outcome("json", dump(types.UnloadModelResponse(model_id=entry.model_id, type="unload_model")))

    return state.submit("unload_model", work, entry.model_id)


# ---- sampling -------------------------------------------------------------------------------------


async def create_sampling_session(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.CreateSamplingSessionRequest)
    state.session(req.session_id)
    base_model = req.base_model
    if req.model_path is None:
        if base_model is None:
            raise UserError("create_sampling_session needs model_path or base_model")
        state.check_served(base_model)
    else:
        if not req.model_path.startswith("tinker://"):
            raise UserError(f"model_path must start with tinker://, got {req.model_path!r}")
        if base_model is None:  # the saving model's, when the checkpoint is readable
            with contextlib.suppress(UserError):
                base_model = state.engine.read_checkpoint(req.model_path)[1]["requested_base_model"]
        base_model = base_model or constants.BASE_MODEL
    sampler_id = state.new_sampler(req.session_id, req.sampling_session_seq_id, base_model, req.model_path)
    return ok(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id))


async def get_sampler(request: web.Request) -> web.Response:
    s = request.app[STATE_KEY].samplers.get(request.match_info["sampler_id"])
    if s is None:
        return error_json(f"unknown sampler {request.match_info['sampler_id']!r}", 404)
    return ok(s)


async def asample(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, types.SampleRequest)
    if req.topk_prompt_logprobs:  # SDK 0.25's one optional sample output this server does not compute
        raise UserError("asample: topk_prompt_logprobs not supported by the local server")
    if req.sampling_session_id is not None:
        sampler = state.samplers.get(req.sampling_session_id)
        if sampler is None:
            raise UserError(f"asample: unknown sampling_session_id {req.sampling_session_id!r}")
        target = sampler.model_path or sampler.base_model
    else:
        target = req.model_path or req.base_model or ""
        if not target:
            raise UserError("asample needs sampling_session_id, model_path or base_model")
        if req.model_path is None:
            state.check_served(target)
    prompt = prompt_tokens_of(req.prompt)
    params = req.sampling_params
    stop_ids, stop_strings = parse_stop(params.stop, [constants.STOP_TOKEN_ID])
    want_prompt_lp = bool(req.prompt_logprobs)

    def fn() -> Outcome:
        seqs = state.engine.sample(
            target,
            prompt,
            req.num_samples,
            params.max_tokens,
            float(params.temperature),
            int(params.top_k),
            float(params.top_p),
            stop_ids,
            stop_strings,
            params.seed,
            want_prompt_lp,
        )
        prompt_lp = seqs[0].prompt_logprobs if want_prompt_lp else None  # the whole prompt's, first element None
        omit = state.faults.omitted_fields("asample")
        return Outcome("proto", encode_sample_response(seqs, prompt_lp, omit_logprobs="logprobs" in omit))

    return state.submit("asample", lambda: state.run_engine(state.sample_pool, "asample", fn))


# ---- futures --------------------------------------------------------------------------------------


async def retrieve_future(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    request_id = (await parse_body(request, types.FutureRetrieveRequest)).request_id
    fut = state.results.get(request_id)
    if fut is None:
        if state.profile.is_spindle:  # RecordNotFound("future", ...)
            raise SpindleError(404, "not_found", f"future not found: {request_id}")
        return error_json(f"unknown request_id {request_id!r}", 404)
    if not fut.done():
        # Spindle: every pending poll is 408 try_again, queue_state active, no reason: a cold trainer, a
        # full one and a held request all look alike (src/spindle/control_plane/http.py, retrieve_future).
        hold = None if state.profile.is_spindle else state.holds.get(fut)
        paused = hold if hold is not None and hold.queue_state != "active" else None
        if state.profile.is_spindle and request_id in state.creation_requests:
            window = spindle.CREATION_POLL_S
        else:
            window = PAUSED_POLL_S if paused is not None else LONG_POLL_S
        try:
            await asyncio.wait_for(asyncio.shield(fut), window)
        except TimeoutError:
            pending = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            if paused is not None:
                pending["queue_state"] = paused.queue_state
                # queue_state_reason: sent by the service, read by the SDK, not in its TryAgainResponse type
                reason = paused.poll_reason()
                if reason:
                    pending["queue_state_reason"] = reason
            return web.json_response(pending, status=408)
    outcome: Outcome = fut.result()
    if outcome.kind == "proto":
        return web.Response(body=outcome.payload, content_type="application/x-protobuf")
    if outcome.kind == "error":
        return error_json(str(outcome.payload), 200, outcome.category)
    return web.json_response(outcome.payload)


# ---- REST reads (the SDK's RestClient, the cookbook's checkpoint_utils) ---------------------------


async def get_training_run(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    entry = state.models.get(request.match_info["model_id"])
    if entry is None:
        return error_json(f"unknown training run {request.match_info['model_id']!r}", 404)
    return ok(state.training_run(entry))


async def list_checkpoints(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    model_id = request.match_info["model_id"]
    if model_id not in state.models:
        return error_json(f"unknown training run {model_id!r}", 404)
    return ok(types.CheckpointsListResponse(checkpoints=state.checkpoints_of(model_id)))


async def checkpoint_archive(request: web.Request) -> web.Response:
    """`GET training_runs/{id}/checkpoints/{checkpoint_id}/archive` (spindle): no archive download; a
    known checkpoint answers 405 unsupported naming the volume copy (control_plane/http.py,
    `get_checkpoint_archive_url`), an unknown one 404."""
    model_id = request.match_info["model_id"]
    name = request.match_info["checkpoint_id"].removeprefix("weights/")
    path = f"tinker://{model_id}/weights/{name}"
    if path not in request.app[STATE_KEY].checkpoints:
        raise SpindleError(404, "not_found", f"checkpoint not found: {path}")
    raise SpindleError(
        405,
        "unsupported",
        "archive downloads are not served; copy the checkpoint directly with "
        f"`modal volume get {CHECKPOINT_VOLUME} /{name}/{model_id} <dest>`",
    )


class WeightsInfoRequest(pydantic.BaseModel):
    """Body of `POST weights_info` (RestClient.get_weights_info_by_tinker_path posts it untyped)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    tinker_path: str


async def weights_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = await parse_body(request, WeightsInfoRequest)
    # the checkpoint's own record on disk: a restarted server (a resumed run) still knows it
    try:
        _, meta = state.engine.read_checkpoint(req.tinker_path)
    except UserError:
        return error_json(f"unknown checkpoint {req.tinker_path!r} (not saved through this server)", 404)
    targets = meta["lora_targets"]
    return ok(
        types.WeightsInfoResponse(
            base_model=meta["requested_base_model"],
            is_lora=True,
            lora_rank=int(meta["lora_rank"]),
            train_mlp="gate_proj" in targets,
            train_attn="q_proj" in targets,
            train_unembed="lm_head" in targets,
        )
    )

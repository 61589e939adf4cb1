"""Training handlers: create_model, get_info, forward(_backward), optim_step, save and load
weights, unload_model; work on one model runs in its `seq_id` order."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web
from tinker import types

from dppo_harness import constants
from dppo_harness.json_types import JsonObject
from dppo_harness.local_server.engine.loss_fns import server_loss
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.faults import CAPACITY_EXHAUSTED_TEXT
from dppo_harness.local_server.http import spindle
from dppo_harness.local_server.http.codecs import ProtocolError, decode_fwdbwd_request, dump, encode_fwdbwd_output
from dppo_harness.local_server.http.state import (
    ModelEntry,
    Outcome,
    ServerState,
    new_sampler,
    session_of,
    state_of,
    str_metadata,
)
from dppo_harness.local_server.http.work import (
    check_served,
    future_json,
    model_entry,
    new_entry,
    parse_body,
    run_engine,
    spawn,
    submit_ordered,
)


async def create_model(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.CreateModelRequest)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    if state.profile.is_spindle:
        spindle.check_creation(req)
    key = (req.session_id, req.model_seq_id)
    if key in state.model_requests:  # resent request
        return future_json(state.model_requests[key], model_id if state.profile.is_spindle else None)
    session_of(state, req.session_id)
    lora = req.lora_config
    if lora is None:
        raise UserError("lora_config is required: the local server trains LoRA adapters only")
    switches = (lora.train_mlp, lora.train_attn, lora.train_unembed)
    request_id, fut = state.new_future()
    state.model_requests[key] = request_id
    state.creation_requests.add(request_id)

    async def work() -> Outcome:
        if state.faults.take_capacity_failure():
            state.model_requests.pop(key, None)  # a retry is a new creation attempt
            return Outcome("error", f"{CAPACITY_EXHAUSTED_TEXT}: no trainer available for {req.base_model}", "server")
        check_served(state, req.base_model)
        if state.profile.is_spindle:  # the trainer's cold start, a LoRA slot, then Miles' checks
            refusal = spindle.lora_refusal(lora.rank, lora.seed, switches)
            refused = await spindle.admit_creation(state, model_id, req.session_id, refusal)
            if refused is not None:
                return refused
        engine_id = await run_engine(
            state,
            state.misc_pool,
            "create_model",
            lambda: state.engine.create_model(
                req.base_model,
                lora.rank,
                lora.seed,
                model_id=model_id,
                train_mlp=switches[0],
                train_attn=switches[1],
                train_unembed=switches[2],
            ),
        )
        new_entry(
            state,
            model_id,
            engine_id,
            req.base_model,
            req.session_id,
            lora_rank=lora.rank,
            user_metadata=str_metadata(req.user_metadata),
            lora_switches=switches,
        )
        return Outcome("json", dump(types.CreateModelResponse(model_id=model_id)))

    spawn(state, fut, "create_model", work)
    # Spindle's create_model answers the model id with the request id (control_plane/http.py).
    return future_json(request_id, model_id if state.profile.is_spindle else None)


def _model_data(state: ServerState, entry: ModelEntry) -> JsonObject:
    # The SDK reuses model_data.model_name as the base model of its sampling sessions, so it is the
    # requested name; `arch` names the stand-in really computing, plus the marker (extra key).
    data = types.ModelData(arch=state.stand_in, model_name=entry.base_model, tokenizer_id=entry.base_model)
    return dump(data) | {"embedded_server": constants.EMBEDDED_SERVER_MARKER}


async def get_info(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.GetInfoRequest)
    entry = model_entry(state, req.model_id)
    if state.profile.is_spindle:
        # Spindle's fields exactly: no architecture, tokenizer id or optimizer config
        # (src/spindle/control_plane/http.py, get_info).
        spindle_info: JsonObject = {
            "type": "get_info",
            "model_id": entry.model_id,
            "model_data": {"model_name": entry.base_model},
            "model_name": entry.base_model,
            "is_lora": True,
            "lora_rank": entry.lora_rank,
            "parameterization": {"type": "lora"},
        }
        return web.json_response(state.faults.omit_json("get_info", spindle_info))
    info = state.engine.get_info(entry.engine_id)
    response = types.GetInfoResponse(
        type="get_info",
        model_data=types.ModelData(),
        model_id=entry.model_id,
        is_lora=bool(info.get("is_lora", True)),
        lora_rank=info.get("lora_rank"),
        model_name=entry.base_model,
    )
    return web.json_response(
        state.faults.omit_json("get_info", dump(response) | {"model_data": _model_data(state, entry)})
    )


async def forward_backward(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await request.read()
    req = decode_fwdbwd_request(body, request.headers.get("Content-Encoding"))
    entry = model_entry(state, req.model_id or None)
    forward_only = req.forward_only
    label = "forward" if forward_only else "forward_backward"
    server_loss(req.loss_fn)  # UserError naming the supported losses
    if not req.data:
        raise UserError(f"{label} without data")
    engine_call = state.engine.forward if forward_only else state.engine.forward_backward

    def fn() -> Outcome:
        outputs, metrics = engine_call(entry.engine_id, req.data, req.loss_fn, req.loss_fn_config)
        if "loss:sum" not in metrics:
            raise RuntimeError("engine returned no 'loss:sum' metric")
        omit = state.faults.omitted_fields(label)
        if omit:  # --fault-omit-field: output keys / metrics a service may leave out
            outputs = [{k: v for k, v in out.items() if k not in omit} for out in outputs]
            metrics = {} if "metrics" in omit else metrics
        return Outcome("proto", encode_fwdbwd_output(outputs, metrics))

    detail = f"{len(req.data)} datums {sum(len(tokens) for tokens, _ in req.data)} tokens"
    return submit_ordered(state, entry, req.seq_id or None, label, fn, detail)


async def optim_step(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.OptimStepRequest)
    entry = model_entry(state, req.model_id)
    adam = req.adam_params.model_dump()  # every field, SDK defaults filled in (SDK 0.25: AdamW only)

    def fn() -> Outcome:
        t0 = time.perf_counter()
        metrics = state.engine.optim_step(entry.engine_id, adam)
        answered = state.profile.optim_metrics(metrics, time.perf_counter() - t0)
        return Outcome("json", dump(types.OptimStepResponse(metrics=answered)))

    return submit_ordered(state, entry, req.seq_id, "optim_step", fn)


async def save_weights(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.SaveWeightsRequest)
    entry = model_entry(state, req.model_id)
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
            return Outcome(
                "error", f"FileExistsError: checkpoint already exists: /checkpoints/{name}/{entry.model_id}", "server"
            )
        path = state.engine.save_state(entry.engine_id, name, overwrite=req.overwrite)
        state.record_checkpoint(entry, path)
        return Outcome("json", dump(types.SaveWeightsResponse(path=path, type="save_weights")))

    return submit_ordered(state, entry, req.seq_id, "save_weights", fn)


async def save_weights_for_sampler(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.SaveWeightsForSamplerRequest)
    entry = model_entry(state, req.model_id)
    if req.path is None and req.sampling_session_seq_id is None:
        raise ProtocolError("save_weights_for_sampler needs 'path' or 'sampling_session_seq_id'")
    session_seq_id = req.sampling_session_seq_id  # not None when path is (checked above)

    def fn() -> Outcome:
        path = state.engine.save_for_sampler(entry.engine_id, req.path)
        state.record_checkpoint(entry, path)
        sampler_id = None
        if req.path is None and session_seq_id is not None:
            sampler_id = new_sampler(state, entry.session_id, int(session_seq_id), entry.base_model, path)
        return Outcome(
            "json",
            dump(
                types.SaveWeightsForSamplerResponseInternal(
                    path=path, sampling_session_id=sampler_id, type="save_weights_for_sampler"
                )
            ),
        )

    return submit_ordered(state, entry, req.seq_id, "save_weights_for_sampler", fn)


async def load_weights(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.LoadWeightsRequest)
    path = req.path
    if req.model_id is not None:  # form 1: load into an existing model, in seq order
        entry = model_entry(state, req.model_id)

        def fn() -> Outcome:
            state.engine.load_state(entry.engine_id, path, req.optimizer)
            return Outcome(
                "json", dump(types.LoadWeightsResponse(path=path, model_id=entry.model_id, type="load_weights"))
            )

        return submit_ordered(state, entry, req.seq_id, "load_weights", fn)

    # form 2: create-via-load; the SDK derives the model id "{session_id}:train:{model_seq_id}"
    if req.session_id is None or req.model_seq_id is None:
        raise ProtocolError("LoadWeightsRequest: needs model_id, or session_id with model_seq_id")
    session_id, model_seq_id = req.session_id, req.model_seq_id
    session_of(state, session_id)
    key = (session_id, model_seq_id)
    if key in state.model_requests:
        return future_json(state.model_requests[key])
    model_id = f"{session_id}:train:{model_seq_id}"
    request_id, fut = state.new_future()
    state.model_requests[key] = request_id
    state.creation_requests.add(request_id)

    async def work() -> Outcome:
        if state.profile.is_spindle:  # a creation like create_model: cold trainer, a LoRA slot
            refused = await spindle.admit_creation(state, model_id, session_id)
            if refused is not None:
                return refused
        engine_id = await run_engine(
            state,
            state.misc_pool,
            "load_weights",
            lambda: state.engine.create_model_from_state(path, req.optimizer, model_id=model_id),
        )
        info = await run_engine(state, state.misc_pool, "get_info", lambda: state.engine.get_info(engine_id))
        saved = state.checkpoints.get(path)
        base_model = (
            req.base_model
            or info.get("requested_base_model")
            or (saved.base_model if saved else None)
            or constants.BASE_MODEL
        )
        new_entry(
            state,
            model_id,
            engine_id,
            base_model,
            session_id,
            lora_rank=info.get("lora_rank"),
            user_metadata=str_metadata(req.user_metadata),
        )
        if state.profile.is_spindle:
            # A creation resolves to its type and model id only, no path
            # (src/spindle/control_plane/service.py, `_retrieve_creation`).
            return Outcome("json", {"type": "load_weights", "model_id": model_id})
        return Outcome("json", dump(types.LoadWeightsResponse(path=path, model_id=model_id, type="load_weights")))

    spawn(state, fut, "load_weights", work)
    return future_json(request_id, model_id)


UNLOAD_DRAIN_S = 10.0  # how long an unload waits for the model's accepted requests


async def unload_model(request: web.Request) -> web.Response:
    """`POST unload_model {"model_id"}` (SDK 0.25: tinker/resources/models.py `unload`): a future
    resolving to `UnloadModelResponse` (tinker/types/unload_model_response.py) once the model's
    earlier requests are done; the model is freed and its id answers as unknown from then on."""
    state = state_of(request)
    req = await parse_body(request, types.UnloadModelRequest)
    entry = model_entry(state, req.model_id)
    request_id, fut = state.new_future()
    if state.profile.is_spindle:  # the slot is free at once; a waiting creation proceeds (service.py unload_model)
        await spindle.release_slot(state, entry.model_id)

    async def work() -> Outcome:
        # After the requests already accepted for the model, but not after one a fault holds
        # forever (--fault-never-complete): the unload frees the model all the same.
        async with entry.cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.cond.wait_for(lambda: entry.pending == 0), UNLOAD_DRAIN_S)
        await run_engine(state, entry.executor, "unload_model", lambda: state.engine.unload_model(entry.engine_id))
        state.models.pop(entry.model_id, None)
        entry.executor.shutdown(wait=False)
        return Outcome("json", dump(types.UnloadModelResponse(model_id=entry.model_id, type="unload_model")))

    spawn(state, fut, "unload_model", work)
    return future_json(request_id, entry.model_id)

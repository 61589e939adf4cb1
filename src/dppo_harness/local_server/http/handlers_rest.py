"""REST reads (the SDK's RestClient, the cookbook's checkpoint_utils): training runs,
checkpoint lists with paging, weights info."""

from __future__ import annotations

import pydantic
from aiohttp import web
from tinker import types

from dppo_harness.local_server.errors import SpindleError, UserError
from dppo_harness.local_server.http.codecs import ProtocolError, dump
from dppo_harness.local_server.http.state import state_of
from dppo_harness.local_server.http.work import error_json, parse_body


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


async def get_training_run(request: web.Request) -> web.Response:
    state = state_of(request)
    model_id = request.match_info["model_id"]
    if model_id not in state.models:
        return error_json(f"unknown training run {model_id!r}", 404)
    return web.json_response(dump(state.training_run(state.models[model_id])))


async def list_training_runs(request: web.Request) -> web.Response:
    state = state_of(request)
    runs = [state.training_run(e) for e in state.models.values()]
    lo, hi = _page(request, len(runs))
    cursor = types.Cursor(offset=lo, limit=hi - lo, total_count=len(runs))
    return web.json_response(dump(types.TrainingRunsResponse(training_runs=runs[lo:hi], cursor=cursor)))


async def list_checkpoints(request: web.Request) -> web.Response:
    state = state_of(request)
    model_id = request.match_info["model_id"]
    if model_id not in state.models:
        return error_json(f"unknown training run {model_id!r}", 404)
    mine = [r.checkpoint for r in state.checkpoints.values() if r.model_id == model_id]
    return web.json_response(dump(types.CheckpointsListResponse(checkpoints=mine)))


async def list_user_checkpoints(request: web.Request) -> web.Response:
    state = state_of(request)
    every = [r.checkpoint for r in state.checkpoints.values()]
    lo, hi = _page(request, len(every))
    cursor = types.Cursor(offset=lo, limit=hi - lo, total_count=len(every))
    return web.json_response(dump(types.CheckpointsListResponse(checkpoints=every[lo:hi], cursor=cursor)))


CHECKPOINT_VOLUME = "spindle-checkpoints"  # Spindle's default checkpoint volume name


async def checkpoint_archive(request: web.Request) -> web.Response:
    """`GET training_runs/{id}/checkpoints/{checkpoint_id}/archive` (spindle profile): Spindle serves
    no archive download; a known checkpoint answers 405 unsupported naming the volume copy
    (src/spindle/control_plane/http.py, `get_checkpoint_archive_url`), an unknown one 404."""
    state = state_of(request)
    model_id = request.match_info["model_id"]
    name = request.match_info["checkpoint_id"].removeprefix("weights/")
    path = f"tinker://{model_id}/weights/{name}"
    if path not in state.checkpoints:
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
    state = state_of(request)
    req = await parse_body(request, WeightsInfoRequest)
    saved = state.checkpoints.get(req.tinker_path)
    if saved is None:
        # saved before this server started (a resumed run): the checkpoint's own record on disk
        # names its base model and rank; the LoRA switches were never written, so none is sent
        try:
            meta = state.engine.checkpoint_meta(req.tinker_path)
        except UserError:
            return error_json(f"unknown checkpoint {req.tinker_path!r} (not saved through this server)", 404)
        on_disk = types.WeightsInfoResponse(
            base_model=meta["requested_base_model"], is_lora=True, lora_rank=int(meta["lora_rank"])
        )
        return web.json_response(dump(on_disk))
    return web.json_response(
        dump(
            types.WeightsInfoResponse(
                base_model=saved.base_model,
                is_lora=True,
                lora_rank=saved.lora_rank,
                train_mlp=saved.lora_switches[0],
                train_attn=saved.lora_switches[1],
                train_unembed=saved.lora_switches[2],
            )
        )
    )

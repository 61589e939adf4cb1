"""Sampling handlers: sampling sessions, sampler reads, and `asample` on the shared sample pool."""

from __future__ import annotations

from aiohttp import web
from tinker import types

from dppo_harness import constants
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.http.codecs import dump, encode_sample_response, parse_stop, prompt_tokens_of
from dppo_harness.local_server.http.state import Outcome, new_sampler, session_of, state_of
from dppo_harness.local_server.http.work import check_served, error_json, future_json, parse_body, run_engine, spawn


async def create_sampling_session(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.CreateSamplingSessionRequest)
    session_of(state, req.session_id)
    base_model = req.base_model
    if req.model_path is None:
        if base_model is None:
            raise UserError("create_sampling_session needs model_path or base_model")
        check_served(state, base_model)
    else:
        if not req.model_path.startswith("tinker://"):
            raise UserError(f"model_path must start with tinker://, got {req.model_path!r}")
        saved = state.checkpoints.get(req.model_path)
        base_model = base_model or (saved.base_model if saved else None) or constants.BASE_MODEL
    sampler_id = new_sampler(state, req.session_id, req.sampling_session_seq_id, base_model, req.model_path)
    return web.json_response(dump(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)))


async def get_sampler(request: web.Request) -> web.Response:
    state = state_of(request)
    sampler_id = request.match_info["sampler_id"]
    if sampler_id not in state.samplers:
        return error_json(f"unknown sampler {sampler_id!r}", 404)
    s = state.samplers[sampler_id]
    return web.json_response(
        dump(types.GetSamplerResponse(sampler_id=s.sampler_id, base_model=s.base_model, model_path=s.model_path))
    )


async def asample(request: web.Request) -> web.Response:
    state = state_of(request)
    req = await parse_body(request, types.SampleRequest)
    if req.topk_prompt_logprobs:  # SDK 0.25's one optional sample output this server does not compute
        raise UserError("asample: topk_prompt_logprobs not supported by the local server")
    if req.sampling_session_id is not None:
        if req.sampling_session_id not in state.samplers:
            raise UserError(f"asample: unknown sampling_session_id {req.sampling_session_id!r}")
        sampler = state.samplers[req.sampling_session_id]
        target = sampler.model_path or sampler.base_model
    else:
        requested = req.model_path or req.base_model
        if not requested:
            raise UserError("asample needs sampling_session_id, model_path or base_model")
        target = requested
        if req.model_path is None:
            check_served(state, target)
    prompt = prompt_tokens_of(req.prompt)
    if not prompt:
        raise UserError("asample: empty prompt")
    if req.num_samples < 1:
        raise UserError(f"asample: num_samples must be >= 1, got {req.num_samples}")
    params = req.sampling_params
    max_tokens = params.max_tokens
    if max_tokens is None or max_tokens < 1:
        raise UserError(f"asample: sampling_params.max_tokens must be a positive integer, got {params.max_tokens!r}")
    stop_ids, stop_strings = parse_stop(params.stop, state.default_stop_ids())
    want_prompt_lp = bool(req.prompt_logprobs)
    num_samples = req.num_samples
    request_id, fut = state.new_future()

    def fn() -> Outcome:
        seqs = state.engine.sample(
            target,
            prompt,
            num_samples,
            max_tokens,
            float(params.temperature),
            int(params.top_k),
            float(params.top_p),
            stop_ids,
            stop_strings,
            params.seed,
            want_prompt_lp,
        )
        # The engine's prompt logprobs cover the whole prompt, first element None.
        prompt_lp = seqs[0].prompt_logprobs if want_prompt_lp else None
        omit = state.faults.omitted_fields("asample")
        return Outcome("proto", encode_sample_response(seqs, prompt_lp, omit_logprobs="logprobs" in omit))

    async def work() -> Outcome:
        return await run_engine(state, state.sample_pool, "asample", fn)

    spawn(state, fut, "asample", work)
    return future_json(request_id)

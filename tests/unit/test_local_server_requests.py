"""Pure parts of the embedded server's HTTP side: SDK-typed request parsing (a bad request is a
clear error naming the field), the loss registry, and the spindle profile's credential check."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from dppo_harness import constants
from dppo_harness.local_server.engine.loss_fns import SERVER_LOSSES, server_loss
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.http.codecs import ProtocolError, decode_fwdbwd_request, parse_request
from dppo_harness.local_server.profiles import (
    MissingCredential,
    Profile,
    make_profile,
)

# optim_step metrics that only echo the requested optimizer config; Spindle does not send them.
OPTIMIZER_ECHO_KEYS = frozenset(
    f"optim/{k}" for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
)


def _raw(obj: object) -> bytes:
    return json.dumps(obj).encode()


CREATE = {"session_id": "s", "model_seq_id": 0, "base_model": constants.BASE_MODEL, "lora_config": {"rank": 8}}


def test_create_model_parses_into_the_sdk_type_with_its_defaults():
    req = parse_request(types.CreateModelRequest, _raw(CREATE))
    assert isinstance(req, types.CreateModelRequest)
    assert req.lora_config == types.LoraConfig(rank=8)
    assert req.user_metadata is None


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({k: v for k, v in CREATE.items() if k != "model_seq_id"}, "missing field model_seq_id"),
        ({**CREATE, "lora_config": {"rank": "eight"}}, "field lora_config.rank"),
        ({**CREATE, "surprise": True}, "unknown field surprise"),
        ({**CREATE, "model_seq_id": [1]}, "field model_seq_id"),
    ],
)
def test_bad_create_model_names_the_field(body, needle):
    with pytest.raises(ProtocolError, match="CreateModelRequest") as info:
        parse_request(types.CreateModelRequest, _raw(body))
    assert needle in str(info.value)


def test_not_json_and_empty_bodies_are_protocol_errors():
    with pytest.raises(ProtocolError, match="not JSON"):
        parse_request(types.GetInfoRequest, b"{oops")
    with pytest.raises(ProtocolError, match="empty body"):
        parse_request(types.GetInfoRequest, b"")
    with pytest.raises(ProtocolError, match="GetInfoRequest: missing field model_id"):
        parse_request(types.GetInfoRequest, b"{}")


def test_optim_step_takes_adam_params_and_the_sdk_defaults():
    req = parse_request(
        types.OptimStepRequest, _raw({"model_id": "m", "seq_id": 3, "adam_params": {"learning_rate": 2e-3}})
    )
    assert isinstance(req.adam_params, types.AdamParams)
    # The server no longer holds its own copy of the defaults: they are the pinned SDK's.
    assert req.adam_params.model_dump() == types.AdamParams(learning_rate=2e-3).model_dump()
    # SDK 0.25's OptimStepRequest is AdamW only: adam_params is required, other optimizers do not parse.
    with pytest.raises(ProtocolError, match="adam_params"):
        parse_request(
            types.OptimStepRequest,
            _raw({"model_id": "m", "optimizer_params": {"type": "dimuon", "learning_rate": 1.0}}),
        )
    with pytest.raises(ProtocolError, match="learning_rate"):
        parse_request(types.OptimStepRequest, _raw({"model_id": "m", "adam_params": {"learning_rate": "fast"}}))


def test_sample_request_prompt_and_params_are_typed():
    body = {
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 5, "stop": [248046], "seed": 1},
        "base_model": constants.BASE_MODEL,
    }
    req = parse_request(types.SampleRequest, _raw(body))
    assert req.prompt.to_ints() == [1, 2, 3] and list(req.sampling_params.stop) == [248046]
    with pytest.raises(ProtocolError, match="sampling_params"):
        parse_request(types.SampleRequest, _raw({**body, "sampling_params": "hot"}))


def test_load_weights_both_forms_parse():
    form1 = parse_request(
        types.LoadWeightsRequest,
        _raw({"model_id": "m", "seq_id": 1, "path": "tinker://m/weights/a", "optimizer": True}),
    )
    form2 = parse_request(
        types.LoadWeightsRequest,
        _raw({"session_id": "s", "model_seq_id": 2, "path": "tinker://m/weights/a", "optimizer": False}),
    )
    assert form1.model_id == "m" and form2.session_id == "s" and form2.model_id is None
    with pytest.raises(ProtocolError, match="missing field optimizer"):
        parse_request(types.LoadWeightsRequest, _raw({"model_id": "m", "path": "tinker://m/weights/a"}))


def _fwdbwd_message() -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=3, loss_fn="ppo", forward_only=True)
    msg.loss_fn_config["clip_low_threshold"] = 0.5
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([5, 6, 7], np.int32).tobytes()
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype, weights.dense = pb.DTYPE_FLOAT32, np.asarray([0.0, 1.0, 1.0], np.float32).tobytes()
    return msg


def test_zstd_forward_backward_decodes_like_the_uncompressed_one():
    """SDK 0.25 sends `Content-Encoding: zstd` under client/config proto_compress_fwdbwd
    (tinker/resources/training.py: zstd.ZstdCompressor().compress of the serialized request)."""
    import zstandard

    raw = _fwdbwd_message().SerializeToString()

    def decoded(body: bytes, encoding: str | None) -> tuple:
        req = decode_fwdbwd_request(body, encoding)
        data = [(tokens, {k: v.tolist() for k, v in inputs.items()}) for tokens, inputs in req.data]
        return (req.model_id, req.seq_id, req.loss_fn, req.loss_fn_config, req.forward_only, data)

    plain = decoded(raw, None)
    assert plain[-1] == [([5, 6, 7], {"weights": [0.0, 1.0, 1.0]})]
    for encoding in ("zstd", "ZSTD"):
        assert decoded(zstandard.ZstdCompressor().compress(raw), encoding) == plain
    # a frame without its content size in the header (a streaming compressor) inflates as well
    streamed = zstandard.ZstdCompressor().compressobj()
    assert decoded(streamed.compress(raw) + streamed.flush(), "zstd") == plain
    assert decoded(raw, "identity") == plain


def test_a_bad_zstd_body_or_another_encoding_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="not a zstd stream"):
        decode_fwdbwd_request(b"not zstd at all", "zstd")
    with pytest.raises(ProtocolError, match="Content-Encoding 'gzip' is not supported"):
        decode_fwdbwd_request(b"\x1f\x8b", "gzip")


def test_forward_backward_protobuf_decodes_into_its_record():
    req = decode_fwdbwd_request(_fwdbwd_message().SerializeToString(), None)
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("m", 3, "ppo", True)
    assert req.loss_fn_config == {"clip_low_threshold": 0.5}
    [(tokens, inputs)] = req.data
    assert tokens == [5, 6, 7] and inputs["weights"].tolist() == [0.0, 1.0, 1.0]


# ---- loss table --------------------------------------------------------------------------------


def test_the_table_holds_the_built_in_losses():
    assert tuple(SERVER_LOSSES) == ("cross_entropy", "importance_sampling", "ppo")
    with pytest.raises(UserError, match=r"unsupported loss_fn 'dro'.*cross_entropy"):
        server_loss("dro")


def test_ppo_config_defaults_and_bounds():
    spec = server_loss("ppo")
    assert spec.config(None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert spec.config({"clip_high_threshold": 1.28})["clip_high_threshold"] == 1.28
    with pytest.raises(UserError, match="unknown ppo loss_fn_config keys"):
        spec.config({"eps": 0.2})
    with pytest.raises(UserError, match="clip_low_threshold <= 1"):
        spec.config({"clip_low_threshold": 1.5})
    with pytest.raises(UserError, match="takes no loss_fn_config"):
        server_loss("cross_entropy").config({"clip_low_threshold": 0.8})


def test_losses_compute_the_documented_formulas():
    lp_T = torch.tensor([-1.0, -0.5, -2.0])
    inputs = {
        "weights": torch.tensor([1.0, 0.0, 2.0]),
        "logprobs": torch.tensor([-1.2, -0.5, -1.0]),
        "advantages": torch.tensor([1.0, -1.0, 0.5]),
    }
    assert torch.allclose(server_loss("cross_entropy").fn(lp_T, inputs, {}), torch.tensor([1.0, 0.0, 4.0]))
    ratio = torch.exp(lp_T - inputs["logprobs"])
    assert torch.allclose(server_loss("importance_sampling").fn(lp_T, inputs, {}), -(ratio * inputs["advantages"]))
    cfg = server_loss("ppo").config(None)
    expected = -torch.minimum(ratio * inputs["advantages"], ratio.clamp(0.8, 1.2) * inputs["advantages"])
    got = server_loss("ppo").fn(lp_T, inputs, cfg)
    assert torch.allclose(got, expected)
    assert not torch.allclose(got, -(ratio * inputs["advantages"]))  # the clip is engaged here


# ---- profiles -----------------------------------------------------------------------------------


ENV = {"TINKER_API_KEY": "tml-k", "MODAL_PROXY_TOKEN_ID": "wk-i", "MODAL_PROXY_TOKEN_SECRET": "ws-s"}


def test_spindle_profile_needs_every_variable_and_hides_values():
    for var in ENV:
        with pytest.raises(MissingCredential, match=var):
            make_profile("spindle", {k: v for k, v in ENV.items() if k != var})
    profile = make_profile("spindle", ENV)
    assert all(v not in repr(profile) for v in ENV.values())
    good = {"X-API-Key": "tml-k", "Modal-Key": "wk-i", "Modal-Secret": "ws-s"}
    # the exchange's front door (Modal-Key / Modal-Secret), then Spindle's own X-API-Key check
    assert profile.auth_error(good) is None and profile.api_key_ok(good)
    assert (
        profile.auth_error({**good, "Modal-Secret": "ws-x"})
        == "research exchange front door: invalid credentials in header Modal-Secret"
    )
    assert profile.auth_error({"X-API-Key": "tml-k"}) == "research exchange front door: missing header Modal-Key"
    assert profile.auth_error({**good, "X-API-Key": "tml-x"}) is None  # not the front door's business
    assert not profile.api_key_ok({**good, "X-API-Key": "tml-x"}) and not profile.api_key_ok({})
    assert Profile().auth_error({}) is None and Profile().api_key_ok({})


def test_spindle_profile_serves_the_base_model_and_drops_optimizer_echo():
    profile = make_profile("spindle", ENV)
    assert profile.served_models([constants.BASE_MODEL, "local/x"]) == [constants.BASE_MODEL]
    assert Profile().served_models([constants.BASE_MODEL, "local/x"]) == [constants.BASE_MODEL, "local/x"]
    metrics = dict.fromkeys(OPTIMIZER_ECHO_KEYS, 1.0) | {"optim/grad_norm": 2.0, "optim/step": 3.0}
    # Spindle's Miles metrics (backends/miles_lora.py optim_step): no optimizer echo
    assert profile.optim_metrics(metrics, 0.5) == {
        "update_successful:mean": 1.0,
        "grad_norm:mean": 2.0,
        "timing/optimizer_step": 2.0,
        "timing/optim_step": 0.5,
    }
    assert Profile().optim_metrics(metrics) == metrics


def test_client_config_per_profile_parses_into_the_sdk_type():
    """Spindle's flags (zstd fwd/bwd bodies, create-from-state via load_weights, httpx transport);
    the default profile keeps the SDK's pyqwest transport and its plain create_model restore."""
    spindle = make_profile("spindle", ENV).client_config()
    assert spindle["proto_write_fwdbwd"] is True  # Spindle's own key: SDK 0.25 ignores it
    cfg = types.ClientConfigResponse.model_validate(spindle)
    assert (cfg.pjwt_auth_enabled, cfg.credential_default_source, cfg.parallel_fwdbwd_chunks) == (
        False,
        "api_key",
        True,
    )
    assert (cfg.use_pyqwest_transport, cfg.create_model_via_load_weights, cfg.proto_compress_fwdbwd) == (
        False,
        True,
        True,
    )
    default = types.ClientConfigResponse.model_validate(Profile().client_config())
    assert (default.use_pyqwest_transport, default.create_model_via_load_weights, default.proto_compress_fwdbwd) == (
        True,
        False,
        False,
    )


def test_fault_kinds_of_rest_reads_do_not_carry_ids():
    from dppo_harness.local_server.faults import FaultInjector, HeaderRecorder
    from dppo_harness.local_server.http.app import build_app
    from dppo_harness.local_server.http.state import ServerState

    app = build_app(ServerState(None, FaultInjector(), HeaderRecorder()))  # type: ignore[arg-type]  # routes only
    kinds = {r.resource.canonical: r.name for r in app.router.routes() if r.resource is not None}
    assert kinds["/api/v1/training_runs/{model_id}"] == "get_training_run"
    assert kinds["/api/v1/training_runs/{model_id}/checkpoints"] == "list_checkpoints"
    assert kinds["/api/v1/weights_info"] == "weights_info"
    assert kinds["/api/v1/client/config"] == "client_config"

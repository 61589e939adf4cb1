"""Request/response codecs of the Tinker wire protocol (pure): protobuf tensors, forward_backward
requests and outputs, sample responses, stop parsing, pydantic request validation (HTTP 400 text)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import pydantic
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from dppo_harness.json_types import JsonObject
from dppo_harness.local_server.errors import UserError

if TYPE_CHECKING:
    from dppo_harness.local_server.engine.sampling import Decoded

API = "/api/v1"
# A zstd fwd/bwd body inflates to at most this (the server takes raw bodies up to 512 MiB).
MAX_INFLATED_BODY = 1024 * 1024 * 1024

RequestT = TypeVar("RequestT", bound=pydantic.BaseModel)

# SDK 0.25 encodes float32 and int64 tensors only (tinker/proto/request_conv.py).
_PB_TO_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}


class ProtocolError(Exception):
    """A request the server cannot parse: answered with HTTP 400 and a message naming the field."""


def decode_tensor(msg: pb.Tensor) -> np.ndarray:
    """A dense tensor. The SDK sends sparse CSR only for 2-D `target_tokens`/`weights` (top-k
    targets), which no loss here takes: refused."""
    if msg.dtype not in _PB_TO_NP or msg.HasField("sparse_csr"):
        raise ProtocolError(f"unsupported tensor (dtype enum {msg.dtype}, sparse {msg.HasField('sparse_csr')})")
    arr = np.frombuffer(msg.dense, _PB_TO_NP[msg.dtype]).copy()
    shape = list(msg.shape)
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise ProtocolError(f"tensor shape {shape} does not match its {arr.size} elements")
        arr = arr.reshape(shape)
    return arr


@dataclass(frozen=True)
class FwdBwdRequest:
    """A protobuf `ForwardBackwardRequest` as plain Python."""

    model_id: str
    seq_id: int
    data: list[tuple[list[int], dict[str, np.ndarray]]]  # (model_input tokens, loss_fn_inputs) per datum
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


def decode_fwdbwd_request(body: bytes, content_encoding: str | None) -> FwdBwdRequest:
    """The protobuf `ForwardBackwardRequest` as plain Python. SDK 0.25 zstd-compresses it (with
    `Content-Encoding: zstd`) when client/config says `proto_compress_fwdbwd` (resources/training.py)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "zstd":  # at most MAX_INFLATED_BODY bytes
        out = bytearray()
        try:
            with zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True) as reader:
                while piece := reader.read(1 << 20):
                    out += piece
                    if len(out) > MAX_INFLATED_BODY:
                        raise ProtocolError(f"zstd body inflates beyond {MAX_INFLATED_BODY} bytes")
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"Content-Encoding zstd: body is not a zstd stream: {exc}") from exc
        body = bytes(out)
    elif encoding != "identity":
        raise ProtocolError(
            f"Content-Encoding {content_encoding!r} is not supported; send zstd or uncompressed protobuf"
        )
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise ProtocolError(f"forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    data: list[tuple[list[int], dict[str, np.ndarray]]] = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            which = chunk.WhichOneof("chunk")
            if which != "encoded_text":
                raise UserError(f"datum {i}: model_input chunk type {which!r} is not supported (tokens only)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: decode_tensor(t) for name, t in datum.loss_fn_inputs.items()}
        data.append((tokens, inputs))
    # SDK 0.25's protobuf carries float-only loss_fn_config (tinker/proto/request_conv.py).
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    return FwdBwdRequest(msg.model_id, msg.seq_id, data, msg.loss_fn, config or None, msg.forward_only)


def encode_fwdbwd_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """The engine's per-datum float32 vectors (the same keys in every datum) as one ArrayRecord."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else ():
        arrays = [np.asarray(out[name], dtype=np.float32) for out in outputs]
        field_msg = record.fields[name]
        field_msg.data = b"".join(a.tobytes() for a in arrays)
        field_msg.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()
        field_msg.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def encode_sample_response(
    seqs: Sequence[Decoded], prompt_logprobs: list[float | None] | None, *, omit_logprobs: bool = False
) -> bytes:
    """`omit_logprobs`: leave every sequence's (optional) logprobs out, as a service may."""
    msg = pb.SampleResponse()
    for seq in seqs:
        out = msg.sequences.add()
        out.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if not omit_logprobs:
            out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
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
    items: list[str | int] = list(stop)
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


def dump(response: pydantic.BaseModel) -> JsonObject:
    """An SDK response model as wire JSON."""
    return response.model_dump(mode="json", exclude_none=True)

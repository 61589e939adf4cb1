"""Training-client helpers shared by every stage that drives a Tinker training client. A response
that lacks what a caller needs raises `RestorationError` with one line naming the missing field."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import tinker
from pydantic import JsonValue


class RestorationError(RuntimeError):
    """A restoration step could not run (as opposed to a check that ran and failed): raised by the
    client helpers here too, so a response without a field the proof needs reads as one line."""


def datum_arrays(datum: tinker.Datum) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input tokens, target tokens, mask) of one datum; the mask is `mask`, else `weights`."""
    tokens_T = np.asarray(datum.model_input.to_ints(), dtype=np.int64)
    inputs = datum.loss_fn_inputs
    if "target_tokens" not in inputs:
        raise ValueError("fixed-batch datum has no 'target_tokens' in loss_fn_inputs")
    targets_T = np.asarray(inputs["target_tokens"].to_numpy(), dtype=np.int64).reshape(-1)
    mask_key = "mask" if "mask" in inputs else "weights" if "weights" in inputs else None
    if mask_key is None:
        raise ValueError("fixed-batch datum has neither 'mask' nor 'weights' in loss_fn_inputs")
    mask_T = np.asarray(inputs[mask_key].to_numpy(), dtype=np.float32).reshape(-1)
    if not (len(tokens_T) == len(targets_T) == len(mask_T)):
        raise ValueError(
            f"fixed-batch datum lengths differ: tokens {len(tokens_T)}, targets {len(targets_T)}, "
            f"{mask_key} {len(mask_T)}"
        )
    return tokens_T, targets_T, mask_T


def make_datum(
    prompt_tokens: Sequence[int], completion_tokens: Sequence[int], completion_weight: float = 1.0
) -> tinker.Datum:
    """Datum for `forward(..., "cross_entropy")`: shifted input/targets, `completion_weight` on the
    completion's targets, 0 on the prompt (weight 0 everywhere: a forward-only logprob read)."""
    tokens = list(prompt_tokens) + list(completion_tokens)
    if len(completion_tokens) == 0 or len(tokens) < 2:
        raise ValueError("fixed-batch item needs a non-empty completion")
    weights_T = np.zeros(len(tokens) - 1, dtype=np.float32)
    weights_T[len(prompt_tokens) - 1 :] = completion_weight
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
            "weights": tinker.TensorData.from_numpy(weights_T),
        },
    )


def full_logprobs(client: tinker.TrainingClient, batch: Sequence[tinker.Datum]) -> list[np.ndarray]:
    """Per-token logprobs of every target token (forward only, no gradient, no update)."""
    out = client.forward(list(batch), "cross_entropy").result()
    if len(out.loss_fn_outputs) != len(batch):
        raise RestorationError(f"forward returned {len(out.loss_fn_outputs)} outputs for {len(batch)} datums")
    result = []
    for i, o in enumerate(out.loss_fn_outputs):
        if "logprobs" not in o:
            raise RestorationError(f"forward output {i} has no 'logprobs' (keys {sorted(o)})")
        result.append(np.asarray(o["logprobs"].to_numpy()).reshape(-1))
    return result


def dump_response(obj: object) -> JsonValue:
    """JSON-able form of an SDK response (pydantic model, dataclass or plain value)."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "__dataclass_fields__"):
        return {k: dump_response(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {str(k): dump_response(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [dump_response(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    return obj  # type: ignore[return-value]  # any other value goes to the JSON writer as it is


def server_info(service_client: tinker.ServiceClient, client: tinker.TrainingClient) -> Mapping[str, JsonValue]:
    """A training client's get_info as the service sent it: raw through the session's own reads
    (`ObservedServiceClient.rest`), so a field tinker 0.25's type drops (`optimizer_config`) is
    still seen; the SDK's parsed response when no raw read is possible or it was refused."""
    rest = getattr(service_client, "rest", None)
    model_id = getattr(client, "model_id", None)
    if rest is not None and model_id is not None:
        try:
            raw = rest.get_info(str(model_id))
            if raw.status == 200 and isinstance(raw.json, Mapping):
                return raw.json
        except Exception:  # the SDK's parsed response stands in (it never invents a field)
            pass
    return client.get_info().model_dump(mode="json", exclude_unset=True)

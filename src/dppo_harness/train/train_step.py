"""The minibatch update, the second half of every training step (gate, diagnostic, feasibility
pilot, comparison): the (recorded) loss -> `forward_backward_custom` -> `optim_step`.

Shaped like the cookbook's `rl/train.py`: `train_step` runs one update per minibatch (of complete
groups, `frozen_batch.split_complete_groups`). No other module calls `forward_backward_custom` or
`optim_step` for training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import tinker

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonValue
from dppo_harness.loss.losses import CustomLossFn

if TYPE_CHECKING:
    import torch

# The SDK's custom loss (forward_backward_custom): (datums, per-datum logprobs) -> (loss, metrics).
B = TypeVar("B")  # what `submit_behind()` returns


class TrainStepError(RuntimeError):
    """An update did not go through the loss exactly once."""


@dataclass(frozen=True)
class UpdateResult(Generic[B]):
    fwd_bwd: tinker.types.ForwardBackwardOutput  # metrics from the loss
    optim: tinker.types.OptimStepResponse
    seconds: float  # submit -> both awaited
    behind: B | None = None  # what `submit_behind()` returned (e.g. a forward future), not awaited here
    # Where `seconds` went, as this client saw it: forward_wait (submit -> the loss called with the
    # first pass's logprobs), loss, before_optim, backward_wait (-> the custom loss's result),
    # optim_wait (-> the optimizer step's result).
    phases: dict[str, float] = field(default_factory=dict)


def minibatch_update(
    training_client: tinker.TrainingClient,
    datums: Sequence[tinker.Datum],
    loss_fn: CustomLossFn,
    adam: tinker.AdamParams,
    *,
    before_optim: Callable[[], None] | None = None,
    submit_behind: Callable[[], B] | None = None,
    sequential: bool = False,
) -> UpdateResult[B]:
    """One `forward_backward_custom` + `optim_step`, then `submit_behind()` (optional, e.g. a
    sentinel forward that must see the updated weights).

    Pipelined (default): the SDK reserves the custom loss's forward and backward request ids at
    submission and a client executes requests in id order, so `optim_step` and `submit_behind()`
    are submitted at once and queue behind the backward: one wait instead of three. (tinker 0.25's
    `forward_backward_custom` returns only once the backward is submitted: they still queue behind it.)
    The SDK is sent `sdk_datums(datums)`; the loss is called with `datums` themselves.
    `before_optim` then runs inside the loss call (it needs what the loss saw), before the
    backward is sent, so still before the optimizer step reaches the server.
    `sequential=True` is the old schedule (each call awaited before the next is submitted), kept
    for benchmarks/round_trips.py and the equivalence test.
    """
    t0 = time.perf_counter()
    marks: dict[str, float] = {}
    inner = loss_fn
    full = list(datums)

    def timed_loss_fn(data: list[tinker.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        marks["loss_start"] = time.perf_counter()
        if len(data) != len(full):
            raise TrainStepError(f"forward_backward_custom called the loss with {len(data)} datums, sent {len(full)}")
        out = inner(full, logprobs)  # the RL inputs the SDK was not sent (sdk_datums)
        marks["loss_end"] = time.perf_counter()
        if not sequential:
            if before_optim is not None:
                before_optim()
            marks["before_optim_end"] = time.perf_counter()
        return out

    if sequential:
        fb_out = training_client.forward_backward_custom(sdk_datums(full), timed_loss_fn).result()
        marks["fb_done"] = time.perf_counter()
        if before_optim is not None:
            before_optim()
        marks["before_optim_end"] = time.perf_counter()
        opt_out = training_client.optim_step(adam).result()
        marks["optim_done"] = time.perf_counter()
        behind = submit_behind() if submit_behind is not None else None
        return UpdateResult(fb_out, opt_out, time.perf_counter() - t0, behind, _phases(t0, marks, sequential))
    fb = training_client.forward_backward_custom(sdk_datums(full), timed_loss_fn)
    opt = training_client.optim_step(adam)
    behind = submit_behind() if submit_behind is not None else None
    fb_out = fb.result()
    marks["fb_done"] = time.perf_counter()
    opt_out = opt.result()
    marks["optim_done"] = time.perf_counter()
    return UpdateResult(fb_out, opt_out, time.perf_counter() - t0, behind, _phases(t0, marks, sequential))


# The only loss_fn_inputs tinker 0.25's forward_backward_custom accepts per datum (it raises on any
# other key; 0.38 dropped them): the RL inputs (logprobs, advantages, mask) reach the loss by closure.
SDK_CUSTOM_LOSS_KEYS = ("target_tokens", "weights")


def sdk_datums(datums: Sequence[tinker.Datum]) -> list[tinker.Datum]:
    """The datums as `forward_backward_custom` is sent them: model input, target tokens (and
    weights where a datum has them), nothing else."""
    return [
        tinker.Datum(
            model_input=d.model_input,
            loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k in SDK_CUSTOM_LOSS_KEYS},
        )
        for d in datums
    ]


def _phases(t0: float, marks: Mapping[str, float], sequential: bool) -> dict[str, float]:
    """Durations between consecutive marks of one update; an interval whose mark is missing (a
    loss that was never called) is left out, not guessed."""
    order: tuple[tuple[str, str], ...] = (("forward_wait", "loss_start"), ("loss", "loss_end"))
    order += (
        (("backward_wait", "fb_done"), ("before_optim", "before_optim_end"))
        if sequential
        else (("before_optim", "before_optim_end"), ("backward_wait", "fb_done"))
    )
    order += (("optim_wait", "optim_done"),)
    out: dict[str, float] = {}
    last: float | None = t0
    for name, mark in order:
        if mark in marks:
            if last is not None:
                out[name] = marks[mark] - last
            last = marks[mark]
        else:
            last = None
    return out


def train_step(
    training_client: tinker.TrainingClient,
    datums: Sequence[tinker.Datum],
    loss_fn: CustomLossFn,
    adam: tinker.AdamParams,
    recorder: ins.LossCallRecorder,
    context: Mapping[str, JsonValue],  # the loss-call context the recorder keeps with each record
    *,
    persist: Callable[[ins.LossCallRecord], None] | None = None,
    submit_behind: Callable[[], B] | None = None,
    sequential: bool = False,
) -> tuple[ins.LossCallRecord, UpdateResult[B]]:
    """One recorded update: the loss wrapped by `recorder` with `context`, then the update.
    `persist(record)` (optional) runs after the loss call and before the optimizer step reaches
    the server; `submit_behind` and `sequential` as in `minibatch_update`."""
    wrapped = recorder.wrap(loss_fn, **dict(context))
    n_before = len(recorder.records)
    hook = None if persist is None else (lambda: persist(recorder.records[-1]))
    result = minibatch_update(
        training_client, datums, wrapped, adam, before_optim=hook, submit_behind=submit_behind, sequential=sequential
    )
    if len(recorder.records) != n_before + 1:
        raise TrainStepError(f"expected one loss call, the recorder saw {len(recorder.records) - n_before}")
    return recorder.records[-1], result

"""The minibatch update, the second half of every training step (gate, diagnostic, feasibility
pilot, comparison): the (recorded) loss -> `forward_backward_custom` -> `optim_step`.

Shaped like the cookbook's `rl/train.py`: `prepare_minibatches` splits a batch into complete
groups, `train_step` runs one update per minibatch. No other module calls
`forward_backward_custom` or `optim_step` for training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dppo_harness import instrumentation as ins
from dppo_harness.frozen_batch import split_complete_groups

if TYPE_CHECKING:
    import tinker

LossFn = Callable[[list, list], tuple[Any, dict[str, float]]]


class TrainStepError(RuntimeError):
    """A minibatch cannot be formed, or an update did not go through the loss exactly once."""


def prepare_minibatches(group_of_datum: Sequence[int], n_minibatches: int) -> list[list[int]]:
    """Datum indices of `n_minibatches` minibatches of whole groups, groups in order
    (`frozen_batch.split_complete_groups`, the one home of the rule)."""
    try:
        return [seqs for _, seqs in split_complete_groups(group_of_datum, n_minibatches)]
    except ValueError as exc:
        raise TrainStepError(str(exc)) from None


@dataclass(frozen=True)
class UpdateResult:
    fwd_bwd: Any  # tinker ForwardBackwardOutput (metrics from the loss)
    optim: Any  # tinker OptimStepResponse
    seconds: float  # submit -> both awaited


def minibatch_update(
    training_client: tinker.TrainingClient,
    datums: Sequence[Any],
    loss_fn: LossFn,
    adam: tinker.AdamParams,
    *,
    before_optim: Callable[[], None] | None = None,
) -> UpdateResult:
    """One `forward_backward_custom` + `optim_step`.

    Without `before_optim` both are submitted before either is awaited (the server orders them).
    With it, the optimizer step is submitted only after the loss call returned and
    `before_optim()` ran (e.g. to persist what the loss saw before the step it feeds).
    """
    t0 = time.perf_counter()
    fb = training_client.forward_backward_custom(list(datums), loss_fn)
    if before_optim is None:
        opt = training_client.optim_step(adam)
        fb_out, opt_out = fb.result(), opt.result()
    else:
        fb_out = fb.result()
        before_optim()
        opt_out = training_client.optim_step(adam).result()
    return UpdateResult(fb_out, opt_out, time.perf_counter() - t0)


def train_step(
    training_client: tinker.TrainingClient,
    datums: Sequence[Any],
    loss_fn: LossFn,
    adam: tinker.AdamParams,
    recorder: ins.LossCallRecorder,
    context: Mapping[str, Any],
    *,
    persist: Callable[[ins.LossCallRecord], None] | None = None,
) -> tuple[ins.LossCallRecord, UpdateResult]:
    """One recorded update: the loss wrapped by `recorder` with `context`, then the update.
    `persist(record)` (optional) runs after the loss call and before the optimizer step."""
    wrapped = recorder.wrap(loss_fn, **dict(context))
    n_before = len(recorder.records)
    hook = None if persist is None else (lambda: persist(recorder.records[-1]))
    result = minibatch_update(training_client, datums, wrapped, adam, before_optim=hook)
    if len(recorder.records) != n_before + 1:
        raise TrainStepError(f"expected one loss call, the recorder saw {len(recorder.records) - n_before}")
    return recorder.records[-1], result


def timed_updates(training_client: tinker.TrainingClient, datums: Sequence[Any], loss_fn: LossFn,
                  adam: tinker.AdamParams, n: int) -> list[float]:
    """Wall seconds of each of `n` unrecorded updates on the same minibatch (timing pilots)."""
    return [minibatch_update(training_client, datums, loss_fn, adam).seconds for _ in range(n)]

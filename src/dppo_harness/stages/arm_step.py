"""One arm-step, the unit the gate's pilot and the comparison's arms both train in: sample a fresh
rollout batch from the client's current weights, then one recorded update per complete-group
minibatch. The caller names the sampler, builds each update's record context and reads what the
step reached from its `ArmStepProgress` (kept when a call fails part-way). The update phase alone
(`run_arm_updates`) is what the feasibility pilot times, so it measures an update as the arms run it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss.losses import CustomLossFn
from dppo_harness.rollout import rollouts
from dppo_harness.rollout.frozen_batch import split_complete_groups
from dppo_harness.train import train_step

if TYPE_CHECKING:  # only types: the callers make the clients and the renderer
    import tinker
    from tinker_cookbook import renderers

    from dppo_harness.data.gsm8k import Gsm8kItem

# (1-based update in the batch, sampler path, datum indices of its minibatch) -> the loss call's context
UpdateContext = Callable[[int, str, list[int]], Mapping[str, int | str]]


@dataclass
class ArmStepProgress:
    """How far one arm-step got: its sampled batch, its minibatches once formed, the updates sent
    (counted before each call: a refusal may come after the server applied it) and returned."""

    sampled: rollouts.SampledStep | None = None
    minibatches: list[list[int]] | None = None
    updates_submitted: int = 0
    updates_done: int = 0
    records: list[ins.LossCallRecord] = field(default_factory=list)
    update_seconds: list[float] = field(default_factory=list)  # each returned update, submit -> awaited


@dataclass(frozen=True)
class ArmStepResult:
    sampled: rollouts.SampledStep
    records: list[ins.LossCallRecord]  # one per update, in order


@dataclass(frozen=True)
class ArmStepRun:
    """What an arm-step trains with: its client, loss, optimizer and recorder."""

    client: tinker.TrainingClient
    loss_fn: CustomLossFn
    adam: tinker.AdamParams
    recorder: ins.LossCallRecorder
    updates_per_batch: int


def run_arm_step(
    arm: ArmStepRun,
    items: Sequence[Gsm8kItem],
    renderer: renderers.Renderer,
    rollout_cfg: rollouts.RolloutConfig,
    *,
    sampler_name: str,
    context: UpdateContext,
    progress: ArmStepProgress | None = None,
) -> ArmStepResult:
    """Sample `items` from `arm.client`'s current weights as `sampler_name`, then one recorded
    update per minibatch of whole groups (`frozen_batch.split_complete_groups`; ValueError when the
    groups do not split evenly); `progress` says how far it got."""
    progress = progress if progress is not None else ArmStepProgress()
    sampled = rollouts.sample_rollout_batch(arm.client, items, renderer, rollout_cfg, sampler_name=sampler_name)
    progress.sampled = sampled
    progress.minibatches = [seqs for _, seqs in split_complete_groups(sampled.group_of_datum, arm.updates_per_batch)]
    run_arm_updates(arm, sampled, progress.minibatches, context=context, progress=progress)
    return ArmStepResult(sampled, list(progress.records))


def run_arm_updates(
    arm: ArmStepRun,
    sampled: rollouts.SampledStep,
    minibatches: Sequence[list[int]],
    *,
    context: UpdateContext,
    progress: ArmStepProgress,
) -> None:
    """The arm-step's update phase: one recorded update per minibatch (indices into
    `sampled.datums`), in order; each update's record and seconds go to `progress` as it returns."""
    for u, idx in enumerate(minibatches, start=1):
        progress.updates_submitted += 1
        update: train_step.UpdateResult[None]  # no request submitted behind the update
        record, update = train_step.train_step(
            arm.client,
            [sampled.datums[i] for i in idx],
            arm.loss_fn,
            arm.adam,
            arm.recorder,
            context(u, sampled.sampler_path, idx),
        )
        progress.records.append(record)
        progress.update_seconds.append(update.seconds)
        progress.updates_done += 1

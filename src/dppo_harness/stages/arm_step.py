"""One arm-step, the unit the gate's pilot and the comparison's arms both train in (`run_arm_step`):
sample a fresh rollout batch at the plan's settings from the client's current weights, then one
recorded update per complete-group minibatch. The caller names the sampler and reads what the step
reached from its `ArmStepProgress` (kept when a call fails part-way). The update phase alone
(`run_arm_updates`) is what the feasibility pilot times, so it measures an update as the arms run it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tinker

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss import losses
from dppo_harness.rollout import rollouts
from dppo_harness.rollout.frozen_batch import split_complete_groups
from dppo_harness.train import train_step

if TYPE_CHECKING:  # only types: the callers make the clients and the renderer
    from tinker_cookbook import renderers

    from dppo_harness.data.gsm8k import Gsm8kItem
    from dppo_harness.plans import ArmConfig, RunConfig

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
    loss_fn: losses.CustomLossFn
    adam: tinker.AdamParams
    recorder: ins.LossCallRecorder
    updates_per_batch: int


def make_loss(arm: ArmConfig, run: RunConfig) -> tuple[losses.CustomLossFn, ins.LossCallRecorder]:
    """An arm's loss function and the recorder every one of its loss calls goes through."""
    lc = losses.LossConfig.for_loss(arm.loss, run.normalization)
    return losses.make_loss_fn(lc), ins.LossCallRecorder(lc)


def rollout_config(run: RunConfig, seed: int) -> rollouts.RolloutConfig:
    """The plan's sampling settings for one rollout batch, from sampling seed `seed`."""
    return rollouts.RolloutConfig(
        int(run.groups_per_batch.value),
        int(run.group_size.value),
        float(run.temperature.value),
        int(run.max_tokens.value),
        seed=seed,
        max_seq_len=run.max_seq_len,
    )


def run_arm_step(
    client: tinker.TrainingClient,
    arm: ArmConfig,
    run: RunConfig,
    loss: tuple[losses.CustomLossFn, ins.LossCallRecorder],
    step: int,
    items: Sequence[Gsm8kItem],
    renderer: renderers.Renderer,
    *,
    seed: int,
    sampler_name: str,
    progress: ArmStepProgress | None = None,
) -> ArmStepResult:
    """Sample `items` from `client`'s current weights as `sampler_name` at the plan's settings, then
    `arm`'s updates, one recorded update per minibatch of whole groups
    (`frozen_batch.split_complete_groups`; ValueError when the groups do not split evenly);
    `progress` says how far it got."""
    progress = progress if progress is not None else ArmStepProgress()
    loss_fn, recorder = loss
    stepper = ArmStepRun(client, loss_fn, tinker.AdamParams(**arm.adam), recorder, arm.updates_per_batch)
    sampled = rollouts.sample_rollout_batch(
        client, items, renderer, rollout_config(run, seed), sampler_name=sampler_name
    )
    progress.sampled = sampled
    progress.minibatches = [seqs for _, seqs in split_complete_groups(sampled.group_of_datum, arm.updates_per_batch)]

    def context(u: int, sampler_path: str, idx: list[int]) -> dict[str, int | str]:
        return {
            "arm": arm.name,
            "step": step,
            "update_in_batch": u,
            "update_index": step * arm.updates_per_batch + u,
            "sampler_checkpoint": sampler_path,
            "n_sequences": len(idx),
        }

    run_arm_updates(stepper, sampled, progress.minibatches, context=context, progress=progress)
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

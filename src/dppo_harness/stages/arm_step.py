"""One arm-step, the unit the gate's pilot and the comparison's arms both train in (`run_arm_step`):
a fresh rollout batch sampled at the plan's settings from the client's current weights, then one
recorded update per complete-group minibatch; `ArmStepProgress` says how far it got. The feasibility
pilot times the update phase alone (`run_arm_updates`), so it measures an update as the arms run it."""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass
class ArmStepProgress:
    """How far one arm-step got: its sampled batch, its minibatches once formed, the updates sent
    (counted before each call: a refusal may come after the server applied it) and the record of
    each update returned."""

    sampled: rollouts.SampledStep | None = None
    minibatches: list[list[int]] | None = None
    updates_submitted: int = 0
    records: list[ins.LossCallRecord] = field(default_factory=list)
    update_seconds: list[float] = field(default_factory=list)  # each returned update, submit -> awaited


def make_loss(arm: ArmConfig, run: RunConfig) -> tuple[losses.CustomLossFn, ins.LossCallRecorder]:
    """An arm's loss function and the recorder every one of its loss calls goes through."""
    lc = losses.LossConfig.for_loss(arm.loss, run.normalization)
    return losses.make_loss_fn(lc), ins.LossCallRecorder(lc)


def rollout_config(run: RunConfig, seed: int) -> rollouts.RolloutConfig:
    """The plan's sampling settings for one rollout batch, from sampling seed `seed`."""
    return rollouts.RolloutConfig(
        run.groups_per_batch,
        run.group_size,
        run.temperature,
        run.max_tokens,
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
) -> tuple[rollouts.SampledStep, list[ins.LossCallRecord]]:
    """Sample `items` from `client`'s current weights as `sampler_name` at the plan's settings, then
    `arm`'s updates, one recorded update per minibatch of whole groups
    (`frozen_batch.split_complete_groups`; ValueError when the groups do not split evenly);
    `progress` says how far it got. Returns the sampled step and one record per update, in order."""
    progress = progress if progress is not None else ArmStepProgress()
    sampled = rollouts.sample_rollout_batch(
        client, items, renderer, rollout_config(run, seed), sampler_name=sampler_name
    )
    progress.sampled = sampled
    progress.minibatches = [seqs for _, seqs in split_complete_groups(sampled.group_of_datum, arm.updates_per_batch)]
    run_arm_updates(client, arm, loss, sampled, progress.minibatches, step=step, progress=progress)
    return sampled, list(progress.records)


def run_arm_updates(
    client: tinker.TrainingClient,
    arm: ArmConfig,
    loss: tuple[losses.CustomLossFn, ins.LossCallRecorder],
    sampled: rollouts.SampledStep,
    minibatches: Sequence[list[int]],
    *,
    step: int,
    progress: ArmStepProgress,
) -> None:
    """The arm-step's update phase: one recorded update per minibatch (indices into
    `sampled.datums`), in order, with `arm`'s optimizer; each update's record and seconds go to
    `progress` as it returns."""
    loss_fn, recorder = loss
    adam = tinker.AdamParams(**arm.adam)
    for u, idx in enumerate(minibatches, start=1):
        progress.updates_submitted += 1
        context: dict[str, int | str] = {
            "arm": arm.name,
            "step": step,
            "update_in_batch": u,
            "update_index": step * arm.updates_per_batch + u,
            "sampler_checkpoint": sampled.sampler_path,
            "n_sequences": len(idx),
        }
        update: train_step.UpdateResult[None]  # no request submitted behind the update
        record, update = train_step.train_step(
            client, [sampled.datums[i] for i in idx], loss_fn, adam, recorder, context
        )
        progress.records.append(record)
        progress.update_seconds.append(update.seconds)

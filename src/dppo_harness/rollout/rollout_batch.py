"""Rollout-batch creation, the first half of every training step (gate, diagnostic, feasibility
pilot, comparison): save the current weights for the sampler, sample one batch of groups from
them, and (where the batch is reused) freeze it.

Like the cookbook's `rl/train.py`, a step is a few named calls: `save_sampler` ->
`sample_rollout_batch` -> `freeze`; the update half lives in `train_step`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.rollout import rollouts
from dppo_harness.rollout.frozen_batch import FrozenBatch

if TYPE_CHECKING:  # only types: the SDK is imported by the callers that make clients
    import tinker
    from tinker_cookbook import renderers

    from dppo_harness.data.gsm8k import Gsm8kItem


@dataclass(frozen=True)
class SampledStep:
    """One sampled rollout batch and the datums the loss trains on."""

    sampler_path: str  # tinker:// path of the weights that sampled
    batch: rollouts.RolloutBatch
    datums: tuple[tinker.Datum, ...]  # cookbook layout
    group_of_datum: tuple[int, ...]  # group index of each datum (complete-group minibatches)
    seconds: float  # save for sampler + sampling + grading

    def summary(self) -> JsonObject:
        return {**self.batch.summary(), "step_seconds": self.seconds}


def save_sampler(training_client: tinker.TrainingClient, name: str) -> tuple[str, tinker.SamplingClient]:
    """The training client's current weights as a named sampler checkpoint and its client."""
    path = training_client.save_weights_for_sampler(name).result().path
    return path, training_client.create_sampling_client(path)


def sample_rollout_batch(
    training_client: tinker.TrainingClient,
    items: Sequence[Gsm8kItem],
    renderer: renderers.Renderer,
    cfg: rollouts.RolloutConfig,
    *,
    sampler_name: str,
) -> SampledStep:
    """Save sampler weights, sample `cfg.group_size` responses per item from them, build datums."""
    t0 = time.perf_counter()
    path, sampler = save_sampler(training_client, sampler_name)
    batch = rollouts.sample_batch(sampler, items, renderer, cfg, sampler_checkpoint=path)
    datums, meta = rollouts.batch_to_datums(batch)
    return SampledStep(path, batch, tuple(datums), tuple(int(m["group_idx"]) for m in meta), time.perf_counter() - t0)


def freeze(sampled: SampledStep, extra_metadata: Mapping[str, JsonValue] | None = None) -> FrozenBatch:
    """The sampled batch frozen (hashed, immutable) for reuse across updates."""
    return FrozenBatch.from_rollouts(sampled.batch, sampler_version=sampled.sampler_path, extra_metadata=extra_metadata)

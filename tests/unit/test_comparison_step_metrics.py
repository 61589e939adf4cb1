"""The cookbook's per-step metrics a step row carries: KL(sample||train) and entropy as the
cookbook computes them, and its `env/all/*` trajectory metrics under its own names."""

from __future__ import annotations

import numpy as np
import pytest
from diagnostic_rehearsal import simulate_records

from dppo_harness.data.gsm8k import Graded, Gsm8kItem
from dppo_harness.loss import loss_registry
from dppo_harness.rollout import rollouts
from dppo_harness.stages.comparison.step_rows import kl_sample_train, step_metrics, trajectory_metrics


def test_kl_sample_train_and_entropy_match_the_cookbook_definition_by_hand():
    records = simulate_records(n_updates=2, minibatches_per_epoch=2, sequences=4, drift_per_update=0.05)
    kl = kl_sample_train(records)
    q = np.concatenate([r.tensors["sampler_logprobs_N"][r.tensors["mask_N"] > 0] for r in records]).astype(np.float64)
    p = np.concatenate([r.tensors["logprobs_N"][r.tensors["mask_N"] > 0] for r in records]).astype(np.float64)
    d = q - p  # sampler minus trainer over action tokens
    assert kl["optim/kl_sample_train_v1"] == pytest.approx(d.mean(), rel=1e-5, abs=1e-7)
    assert kl["optim/kl_sample_train_v2"] == pytest.approx(0.5 * (d**2).mean(), rel=1e-5)
    assert kl["optim/entropy"] == pytest.approx(-q.mean(), rel=1e-5)
    assert kl["optim/kl_sample_train_v2"] > 0  # the simulated policy drifted


def test_kl_is_not_invented_without_loss_tokens():
    records = simulate_records(n_updates=1, minibatches_per_epoch=1, sequences=2)
    for r in records:
        r.tensors["mask_N"] = np.zeros_like(r.tensors["mask_N"])
    assert kl_sample_train(records) == {}


def _tiny_batch():
    item = Gsm8kItem("gsm8k-train-0000", "train", 0, "q", "s #### 1", "1")
    groups = []
    for g, rewards in enumerate(([1.0, 0.0], [-0.1, -0.1])):
        graded = tuple(Graded(r, r > -0.1, r > 0.5, "", r > -0.1) for r in rewards)
        groups.append(
            rollouts.SampledGroup(
                g, item, (1, 2, 3), ((4, 5), (6, 7, 8)), ((0.0, 0.0), (0.0, 0.0, 0.0)), ("stop", "length"), graded
            )
        )
    cfg = rollouts.RolloutConfig(groups_per_batch=2, group_size=2, temperature=1.0, max_tokens=3)
    return rollouts.RolloutBatch(tuple(groups), cfg, "tinker://m/sampler_weights/s0", "m", (9,), 0.1, 0.0)


def test_a_step_row_carries_the_cookbooks_metrics_under_its_names():
    batch = _tiny_batch()
    env = trajectory_metrics(batch)
    assert env["env/all/reward/total"] == pytest.approx(np.mean([1.0, 0.0, -0.1, -0.1]))
    assert env["env/all/total_ac_tokens"] == 10 and env["env/all/by_group/frac_mixed"] == 0.5
    records = simulate_records(n_updates=2, minibatches_per_epoch=2, sequences=2)
    kl = kl_sample_train(records)
    row = step_metrics(
        "grpo_seed0",
        1,
        batch.summary(),
        records,
        loss=loss_registry.GRPO_LOSS,
        seconds=3.0,
        sample_seconds=1.0,
        sampler_checkpoint="tinker://x",
        kl=kl,
        cookbook_env=env,
        rollout_seconds=0.5,
    )
    assert row["cookbook_env"] == env and row["rollout_seconds"] == 0.5
    assert (row["kl_sample_train_v1"], row["kl_sample_train_v2"], row["entropy"]) == (
        kl["optim/kl_sample_train_v1"],
        kl["optim/kl_sample_train_v2"],
        kl["optim/entropy"],
    )

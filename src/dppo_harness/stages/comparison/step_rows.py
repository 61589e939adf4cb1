"""One row per arm-step, `StepRowJson` (the batch's reward and format, each decision's fractions of
the step's updates, labelled `counterfactual_` when the arm does not train with that rule, drift
tails, timings, the cookbook's KL(sample||train), entropy and `env/all/*` metrics); the per-arm summary
`metrics.arms` posts; the terminal line of a committed step; the rows as JSONL."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Required, TypedDict, cast

import numpy as np
import tinker
import torch
from tinker_cookbook.rl.metric_util import compute_trajectory_metrics
from tinker_cookbook.rl.metrics import compute_kl_sample_train

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss import loss_registry
from dppo_harness.loss.terms import DECISIONS, row_fraction, row_label
from dppo_harness.rollout import rollouts

# The cookbook's `compute_kl_sample_train` names -> the row keys they are kept under.
ROW_KL_KEYS = {
    "optim/kl_sample_train_v1": "kl_sample_train_v1",
    "optim/kl_sample_train_v2": "kl_sample_train_v2",
    "optim/entropy": "entropy",
}


def kl_sample_train(records: Sequence[ins.LossCallRecord]) -> dict[str, float]:
    """The cookbook's `compute_kl_sample_train` over every datum of the step's loss calls and the
    trainer logprobs each loss call received, as `rl/train.py` passes them (the datums rebuilt from
    the records with the two inputs it reads, `logprobs` and `mask`); {} when no loss token."""
    if not any(float(np.sum(rec.tensors["mask_N"])) > 0 for rec in records):
        return {}
    data_D, train_lp_D = [], []
    for rec in records:
        t = rec.tensors
        starts = np.cumsum([0, *(int(n) for n in t["lengths_S"])])
        for sl in (slice(int(a), int(b)) for a, b in itertools.pairwise(starts)):
            inputs = {k: tinker.TensorData.from_numpy(np.asarray(t[n][sl], dtype=np.float32)) for k, n in _KL_INPUTS}
            data_D.append(tinker.Datum(model_input=tinker.ModelInput.from_ints([]), loss_fn_inputs=inputs))
            train_lp_D.append(torch.as_tensor(np.asarray(t["logprobs_N"][sl], dtype=np.float32)))
    return {k: float(v) for k, v in compute_kl_sample_train(data_D, train_lp_D).items()}


_KL_INPUTS = (("logprobs", "sampler_logprobs_N"), ("mask", "mask_N"))


def trajectory_metrics(batch: rollouts.RolloutBatch) -> dict[str, float]:
    """The cookbook's `env/all/*` metrics of one rollout batch (`compute_trajectory_metrics`; no
    per-tag split: one data set), kept in the row's `cookbook_env`."""
    groups = rollouts.to_trajectory_groups(batch)
    return {k: float(v) for k, v in compute_trajectory_metrics(groups, [[] for _ in groups]).items()}


def fraction_names(loss: str) -> dict[str, str]:
    """Each decision's row keys -> their label in the rows of an arm training with the registered
    `loss`: plain for the decisions it trains with, else counterfactual."""
    own = loss_registry.get_loss(loss).decisions
    return {key: row_label(key, trained=d == own) for d in DECISIONS for key in d.row_keys}


class StepRowJson(TypedDict, total=False):
    """A step row as the JSONL and the run state hold it (`step_metrics`, plus `retries` once
    committed; a resumed run reads its rows back from the state file in this form), with each
    decision's fractions under its plain or `counterfactual_` `row_keys` (`row_fraction` decodes them)."""

    arm: Required[str]
    step: Required[int]
    loss: str
    reward_mean: float
    format_rate: float
    correct_rate: float
    truncated_frac: float
    no_answer_frac: float
    mean_response_tokens: float
    responses: int
    max_tokens: int
    drift_abs_p90: float
    drift_abs_p99: float
    drift_abs_max: float
    loss_tokens: int
    response_tokens: int
    updates: int
    seconds: float
    sample_seconds: float
    sampler_checkpoint: str
    kl_sample_train_v1: float
    kl_sample_train_v2: float
    entropy: float
    rollout_seconds: float
    cookbook_env: dict[str, float]
    retries: int


def step_metrics(
    arm: str,
    step: int,
    summary: Mapping[str, Any],
    records: Sequence[ins.LossCallRecord],
    *,
    loss: str,
    seconds: float,
    sample_seconds: float,
    sampler_checkpoint: str,
    kl: Mapping[str, float] | None = None,
    cookbook_env: Mapping[str, float] | None = None,
    rollout_seconds: float | None = None,
) -> StepRowJson:
    """One arm-step row: reward/format/truncation from the batch, loss metrics of the step's minibatch
    updates pooled by loss tokens (fractions) and of its last update (drift tails, as the gate);
    a rule the arm does not train with is keyed `counterfactual_` (`fraction_names`)."""
    den = int(sum(r.stats.tokens_loss for r in records))
    last = records[-1].stats if records else None
    pooled = {d.row_keys[0]: int(sum(r.stats[d.removed] for r in records)) / den if den else 0.0 for d in DECISIONS}
    last_update = {d.row_keys[1]: float(last[d.fraction()]) if last else 0.0 for d in DECISIONS}
    tails = (last.drift_abs_p90, last.drift_abs_p99, last.drift_abs_max) if last else (0.0, 0.0, 0.0)
    names = fraction_names(loss)
    row: dict[str, Any] = {
        "arm": arm,
        "step": step,
        "loss": loss,
        "reward_mean": float(summary["mean_reward"]),
        "format_rate": float(summary["frac_format"]),
        "correct_rate": float(summary["frac_correct"]),
        "truncated_frac": float(summary["frac_truncated"]),
        "no_answer_frac": float(summary["frac_no_answer"]),
        "mean_response_tokens": float(summary["mean_response_tokens"]),
        "responses": int(summary["n_sequences"]),
        "max_tokens": int(summary["config"]["max_tokens"]),
        **{names[key]: value for key, value in (pooled | last_update).items()},
        **{f"drift_abs_{q}": float(v) for q, v in zip(("p90", "p99", "max"), tails, strict=True)},
        "loss_tokens": den,
        "response_tokens": int(summary["response_tokens"]),
        "updates": len(records),
        "seconds": float(seconds),
        "sample_seconds": float(sample_seconds),
        "sampler_checkpoint": sampler_checkpoint,
        **{ROW_KL_KEYS[k]: float(v) for k, v in (kl or {}).items() if k in ROW_KL_KEYS},
    }
    if rollout_seconds is not None:
        row["rollout_seconds"] = float(rollout_seconds)
    if cookbook_env is not None:
        row["cookbook_env"] = {k: float(v) for k, v in cookbook_env.items()}
    return cast(StepRowJson, row)


def number(row: StepRowJson, key: str) -> float:
    """A numeric field of a step row (read from the JSONL or the run state) as a float."""
    fields: Mapping[str, object] = row  # the field is chosen at run time
    value = fields[key]
    if not isinstance(value, (int, float)):
        raise TypeError(f"step row {key}: {value!r} is not a number")
    return float(value)


def arm_summary(rows: Sequence[StepRowJson]) -> dict[str, float]:
    """`metrics.arms[arm]`: plain floats over the steps so far (loss-rule fractions keep their
    counterfactual label)."""
    if not rows:
        return {}
    last = rows[-1]
    out = {
        "steps_completed": float(len(rows)),
        "reward_mean_last": float(last["reward_mean"]),
        "reward_mean_over_steps": float(np.mean([r["reward_mean"] for r in rows])),
        "format_rate_last": float(last["format_rate"]),
    }
    for base in (d.row_keys[0] for d in DECISIONS):
        key = row_label(base, trained=not row_fraction(last, base).counterfactual)
        out[f"{key}_mean"] = float(np.mean([row_fraction(r, base).value for r in rows]))
    out["drift_abs_p90_last"] = float(last["drift_abs_p90"])
    for key in ("truncated_frac", "no_answer_frac", "mean_response_tokens"):
        out[f"{key}_last"] = number(last, key)
        out[f"{key}_mean"] = float(np.mean([number(r, key) for r in rows]))
    for key in ("kl_sample_train_v1", "kl_sample_train_v2", "entropy"):
        if key in last:  # none when the step had no loss token
            out[f"{key}_last"] = number(last, key)
    out["loss_tokens_total"] = float(sum(r["loss_tokens"] for r in rows))
    out["train_seconds_total"] = float(sum(r["seconds"] for r in rows))
    return out


def step_line(row: StepRowJson, steps: int) -> str:
    """The terminal line of one committed arm-step (a counterfactual fraction is labelled 'cf')."""
    parts = [
        f"[comparison] {row['arm']} step {row['step'] + 1}/{steps}: reward {row['reward_mean']:.3f}, "
        f"format {row['format_rate']:.2f}"
    ]
    for d in DECISIONS:
        f = row_fraction(row, d.row_keys[0])
        parts.append(f"{'cf ' if f.counterfactual else ''}{d.verb} {f.value:.4g}")
    parts.append(f"truncated {row['truncated_frac']:.2f}")
    parts.append(f"|p-q| q90 {row['drift_abs_p90']:.4g}, {row['seconds']:.1f}s")
    return ", ".join(parts)


def jsonl(rows: Sequence[StepRowJson]) -> bytes:
    return "".join(json.dumps(ins.nan_free(dict(r)), sort_keys=True) + "\n" for r in rows).encode()

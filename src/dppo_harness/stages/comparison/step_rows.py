"""One row per arm-step (pure): the batch's reward and format, the loss-rule fractions of the
step's updates (the rule an arm does not train with labelled counterfactual), drift tails,
timings; what a resumed run must reproduce of them; the per-arm summary `metrics.arms` posts;
the terminal line of a committed step; the rows as JSONL."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dppo_harness.instrument import cookbook_metrics
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss import losses


def fraction_label(name: str, *, trained: bool) -> str:
    """A loss-rule metric's name in an arm's rows: the rule the arm does not train with is counted
    counterfactually on the arm's own tensors, and its name says so."""
    return name if trained else f"counterfactual_{name}"


# A row's loss-rule fractions -> the loss-call statistic each is computed from (every loss call
# counts both rules on its tensors, whichever loss it trains with).
FRACTION_SOURCES = {"dppo_masked_frac": "dppo/removed", "last_update_masked_frac": "dppo/masked_frac_loss_tokens",
                    "ppo_clip_frac": "ppo/clipped", "last_update_clip_frac": "ppo/clip_frac_loss_tokens"}


def fraction_names(loss: str) -> dict[str, str]:
    """Base name -> label in the rows of an arm training with the registered `loss`: a fraction is
    the arm's own when its statistic is one of the loss's `metric_names`, else counterfactual."""
    own = set(losses.get_loss(loss).metric_names)
    return {base: fraction_label(base, trained=source in own) for base, source in FRACTION_SOURCES.items()}


def labelled(row: Mapping[str, Any], base: str) -> tuple[str, Any]:
    """(key, value) of a loss-rule fraction in a row, whichever label it carries."""
    for key in (base, f"counterfactual_{base}"):
        if key in row:
            return key, row[key]
    raise KeyError(base)


def step_metrics(arm: str, step: int, summary: Mapping[str, Any], records: Sequence[ins.LossCallRecord],
                 *, loss: str, seconds: float, sample_seconds: float, sampler_checkpoint: str,
                 kl: Mapping[str, float] | None = None, cookbook_env: Mapping[str, float] | None = None,
                 rollout_seconds: float | None = None) -> dict[str, Any]:
    """One arm-step row: reward/format/truncation from the batch, loss metrics of the step's minibatch
    updates pooled by loss tokens (fractions) and of its last update (drift tails, as the gate).

    `loss` is the arm's registered loss name. A rule the loss does not train with (the GRPO arm's
    DPPO mask, the DPPO arm's PPO clip) is a counterfactual count on the same tensors: its keys
    start with `counterfactual_` (`fraction_names`). `kl` is the
    cookbook's `compute_kl_sample_train` of the step (`cookbook_metrics.kl_sample_train`)."""
    sums = {k: int(sum(r.stats[k] for r in records)) for k in ("tokens/loss", "dppo/removed", "ppo/clipped")}
    last = records[-1].stats if records else {}
    den = sums["tokens/loss"]
    names = fraction_names(loss)
    row: dict[str, Any] = {
        "arm": arm, "step": step, "loss": loss,
        "reward_mean": float(summary["mean_reward"]), "format_rate": float(summary["frac_format"]),
        "correct_rate": float(summary["frac_correct"]),
        "truncated_frac": float(summary["frac_truncated"]), "no_answer_frac": float(summary["frac_no_answer"]),
        "mean_response_tokens": float(summary["mean_response_tokens"]), "responses": int(summary["n_sequences"]),
        "max_tokens": int(summary["config"]["max_tokens"]),
        names["dppo_masked_frac"]: sums["dppo/removed"] / den if den else 0.0,
        names["ppo_clip_frac"]: sums["ppo/clipped"] / den if den else 0.0,
        names["last_update_masked_frac"]: float(last.get("dppo/masked_frac_loss_tokens", 0.0)),
        names["last_update_clip_frac"]: float(last.get("ppo/clip_frac_loss_tokens", 0.0)),
        "drift_abs_p90": float(last.get("drift/abs_p90", 0.0)), "drift_abs_p99": float(last.get("drift/abs_p99", 0.0)),
        "drift_abs_max": float(last.get("drift/abs_max", 0.0)),
        "loss_tokens": den, "response_tokens": int(summary["response_tokens"]), "updates": len(records),
        "seconds": float(seconds), "sample_seconds": float(sample_seconds), "sampler_checkpoint": sampler_checkpoint,
    }
    row.update({cookbook_metrics.ROW_KL_KEYS[k]: float(v) for k, v in (kl or {}).items() if k in cookbook_metrics.ROW_KL_KEYS})
    if rollout_seconds is not None:
        row["rollout_seconds"] = float(rollout_seconds)
    if cookbook_env is not None:
        row["cookbook_env"] = {k: float(v) for k, v in cookbook_env.items()}
    return row


TIMING_KEYS = ("seconds", "sample_seconds", "rollout_seconds", "sampler_checkpoint", "retries")


def comparable(row: Mapping[str, Any]) -> dict[str, Any]:
    """A step row without wall times and paths (what must match between a resumed and an
    uninterrupted run)."""
    return {k: v for k, v in row.items() if k not in TIMING_KEYS}


# What the sampled tokens decide must match exactly between a resumed and an uninterrupted run;
# logprob-derived floats only to the embedded server's run-to-run float noise (its batched CPU
# kernels are not bitwise reproducible between two runs, resumed or not).
TOKEN_FIELDS = ("reward_mean", "format_rate", "correct_rate", "response_tokens", "loss_tokens", "updates", "loss",
                "truncated_frac", "no_answer_frac", "mean_response_tokens", "responses", "max_tokens", "cookbook_env")
RESUME_FLOAT_ATOL = 2e-3


def row_differences(got: Mapping[str, Any], want: Mapping[str, Any], atol: float = RESUME_FLOAT_ATOL) -> list[str]:
    """Why two comparable step rows of the same arm and step differ (empty: they match)."""
    where = f"{got['arm']} step {got['step']}"
    out = [f"{where}: {k} {got.get(k)!r} != {want.get(k)!r}" for k in TOKEN_FIELDS if got.get(k) != want.get(k)]
    out += [f"{where}: {k} {got[k]!r} vs {want[k]!r}" for k in sorted(set(want) - set(TOKEN_FIELDS) - {"arm", "step"})
            if abs(float(got[k]) - float(want[k])) > atol]
    return out


def arm_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
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
    for base in ("dppo_masked_frac", "ppo_clip_frac"):
        key, _ = labelled(last, base)
        out[f"{key}_mean"] = float(np.mean([labelled(r, base)[1] for r in rows]))
    out["drift_abs_p90_last"] = float(last["drift_abs_p90"])
    for key in ("truncated_frac", "no_answer_frac", "mean_response_tokens"):
        if all(key in r for r in rows):
            out[f"{key}_last"] = float(last[key])
            out[f"{key}_mean"] = float(np.mean([r[key] for r in rows]))
    for key in ("kl_sample_train_v1", "kl_sample_train_v2", "entropy"):
        if key in last:
            out[f"{key}_last"] = float(last[key])
    out["loss_tokens_total"] = float(sum(r["loss_tokens"] for r in rows))
    out["train_seconds_total"] = float(sum(r["seconds"] for r in rows))
    return out



def step_line(row: Mapping[str, Any], steps: int) -> str:
    """The terminal line of one committed arm-step (a counterfactual fraction is labelled 'cf')."""
    parts = [f"[comparison] {row['arm']} step {row['step'] + 1}/{steps}: reward {row['reward_mean']:.3f}, "
             f"format {row['format_rate']:.2f}"]
    for base, short in (("dppo_masked_frac", "masked"), ("ppo_clip_frac", "clip")):
        try:
            key, value = labelled(row, base)
        except KeyError:
            continue
        parts.append(f"{'cf ' if key.startswith('counterfactual_') else ''}{short} {value:.4g}")
    if "truncated_frac" in row:
        parts.append(f"truncated {row['truncated_frac']:.2f}")
    parts.append(f"|p-q| q90 {row.get('drift_abs_p90', 0.0):.4g}, {row.get('seconds', 0.0):.1f}s")
    return ", ".join(parts)



def jsonl(rows: Sequence[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(ins.nan_free(dict(r)), sort_keys=True) + "\n" for r in rows).encode()


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)

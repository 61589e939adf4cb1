"""The bounded diagnostic's settings, read from the plan's `BoundedDiagnostic` (validated), and the
fixed texts that say what this loop is.

This loop is a REPLACEMENT written for this harness, not the earlier run's audited code: that
code and its diagnosis could not be fetched from here (recorded as unavailable evidence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.loss.loss_registry import DPPO_LOSS
from dppo_harness.loss.losses import LossConfig

if TYPE_CHECKING:
    from dppo_harness.plans.models import BoundedDiagnostic

# Seconds kept free at the end of the cap for analysis, replay re-check, report and evidence.
FINALIZE_RESERVE_S = 30.0
LOOP_LABEL = (
    "replacement loop written for this harness (dppo_harness.stages.diagnostic); NOT the earlier run's "
    "audited code, which could not be retrieved"
)
# What this replacement loop does against the known ways a DPPO mask reads zero. Whether the prior
# run lacked any of them cannot be verified: its code was unavailable.
FIXES = (
    "anchor = the sampler logprobs captured at sampling time, frozen and hashed, never refreshed "
    "(a recomputed old policy makes p - p_old = 0 at the first update)",
    "divergence on probabilities p - q, not log-ratios or ratios; directional strict mask, A = 0 on the "
    "negative branch; decisions in float64 from the service's float32 logprobs",
    "16 updates over one frozen batch (2 epochs x 8 complete-group minibatches) so the policy can drift",
    "zero-advantage, prompt and padding tokens never counted as engagement; removed counts split by sign",
    "every loss call's tensors persisted and recomputed by an independent padded implementation",
)
BASIS_FOR_REFERENCES = (
    "Prior code/diagnosis references were not fetched: this machine has no network beyond package "
    "registries and no session access to the research exchange."
)


ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
SENTINELS_PER_SIGN = 4


class DiagnosticError(RuntimeError):
    """The diagnostic cannot run as planned; the message says which requirement failed."""


def adam(d: BoundedDiagnostic) -> dict[str, float]:
    return {k: float(getattr(d.fixed_settings.optimizer, k)) for k in ADAM_KEYS}


def max_wall_seconds(d: BoundedDiagnostic) -> float:
    return float(d.caps.max_wall_minutes) * 60.0


def loss_config(d: BoundedDiagnostic) -> LossConfig:
    # The plan kind pins DPPO Binary-TV (fixed_settings.treatment.loss); its thresholds are the plan's.
    fs = d.fixed_settings
    return LossConfig(
        DPPO_LOSS,
        normalization=fs.loss_normalization.mode,
        ppo_eps=float(fs.counterfactual_baseline.ppo_eps),
        dppo_delta=float(fs.treatment.delta),
        ratio_cap=float(fs.treatment.ratio_cap),
    )


def config_record(d: BoundedDiagnostic) -> JsonObject:
    """The settings and schedule the diagnostic runs, as the analysis and the feasibility block
    record them (the plan's model validated the schedule: one sampled batch, never refreshed,
    complete-group minibatches); a smaller run is a smaller plan file."""
    fs, sch, samp = d.fixed_settings, d.schedule, d.fixed_settings.sampling
    return {
        "arm": fs.treatment.arm,
        "dataset": samp.dataset,
        "base_model": fs.base_model,
        "lora_rank": fs.lora_rank,
        "seed": fs.seed,
        "groups_per_batch": sch.groups_per_batch,
        "group_size": sch.group_size,
        "temperature": float(samp.temperature),
        "max_tokens": samp.max_tokens,
        "minibatches_per_epoch": sch.minibatches_per_epoch,
        "groups_per_minibatch": sch.groups_per_minibatch,
        "epochs": sch.epochs,
        "max_updates": sch.max_optimizer_updates,
        "max_wall_seconds": max_wall_seconds(d),
        "adam": as_object(adam(d)),
        "normalization": fs.loss_normalization.mode,
        "delta": float(fs.treatment.delta),
        "ratio_cap": float(fs.treatment.ratio_cap),
        "ppo_eps": float(fs.counterfactual_baseline.ppo_eps),
        "sentinel_after_updates": list(d.recording.sentinels.after_updates),
        "sentinels_per_sign": SENTINELS_PER_SIGN,
        "data_step": 0,  # which train batch of the cookbook order is sampled
    }

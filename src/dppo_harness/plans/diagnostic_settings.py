"""A bounded diagnostic's settings blocks: what it holds fixed (`fixed_settings`), its schedule,
caps, recording, outcomes and unavailable references.

The stages read these through the validated `BoundedDiagnostic` (`models`), which also holds the
blocks the stages check against (its analysis criteria and declared service work).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from dppo_harness.plans.model_base import NonNeg, NonNegInt, PosInt, StrictModel, Unit
from dppo_harness.plans.schema_errors import rule_error


class Initialization(StrictModel):
    source: str
    require_observed_successful_load: bool
    trained_pilot_weights_allowed: bool


class Treatment(StrictModel):
    arm: str
    loss: Literal["dppo_binary_tv"]
    delta: NonNeg
    ratio_cap: NonNeg
    variant: str
    variant_note: str
    anchor: Literal["sampler_logprobs"]
    divergence: str
    reference_revision: str


class CounterfactualBaseline(StrictModel):
    loss: str
    ppo_eps: NonNeg
    trained: bool
    note: str


class DiagnosticOptimizer(StrictModel):
    name: Literal["adamw"]
    learning_rate: NonNeg
    beta1: Unit
    beta2: Unit
    eps: NonNeg
    weight_decay: NonNeg
    grad_clip_norm: NonNeg


class Sampling(StrictModel):
    renderer: str
    dataset: str
    split: Literal["train"]
    temperature: NonNeg
    max_tokens: PosInt


class LossNormalization(StrictModel):
    mode: Literal["sum", "token_mean"]
    denominator: str
    reason: str


class FixedSettings(StrictModel):
    base_model: str
    lora_rank: PosInt
    seed: int
    initialization: Initialization
    treatment: Treatment
    counterfactual_baseline: CounterfactualBaseline
    optimizer: DiagnosticOptimizer
    sampling: Sampling
    advantages: Literal["group_mean_centered"]
    loss_normalization: LossNormalization


class DiagnosticSchedule(StrictModel):
    """A bounded diagnostic's schedule: one sampled batch reused over epochs of minibatches."""

    sampling_batches: Annotated[int, Field(ge=1, le=1)]
    groups_per_batch: PosInt
    group_size: PosInt
    minibatches_per_epoch: PosInt
    groups_per_minibatch: PosInt
    complete_groups_only: bool
    epochs: PosInt
    max_optimizer_updates: PosInt
    new_sampling_after_batch: Literal[False]
    old_logprob_refresh: Literal[False]
    frozen_fields: Annotated[list[str], Field(min_length=1)]
    assert_hashes_before_every_reuse: bool
    record_sampler_checkpoint: bool

    @model_validator(mode="after")
    def _consistent(self) -> DiagnosticSchedule:
        if self.minibatches_per_epoch * self.groups_per_minibatch != self.groups_per_batch:
            raise rule_error(
                "groups_per_minibatch", "minibatches_per_epoch x groups_per_minibatch must equal groups_per_batch"
            )
        if self.max_optimizer_updates > self.epochs * self.minibatches_per_epoch:
            raise rule_error("max_optimizer_updates", "exceeds epochs x minibatches_per_epoch")
        return self


class Caps(StrictModel):
    max_wall_minutes: NonNeg
    wall_clock_includes: list[str]
    gpu_hours_cap: NonNeg
    gpu_hours_cap_source: str
    stop_rule: str
    on_setup_exhausting_cap: str
    check_remaining_budget_before_service_work: bool


class Sentinels(StrictModel):
    source: str
    compare: str
    after_updates: Annotated[list[NonNegInt], Field(min_length=1)]
    purpose: str


class Recording(StrictModel):
    before_each_loss_and_update: Annotated[list[str], Field(min_length=1)]
    sentinels: Sentinels


class Outcomes(StrictModel):
    inactive: str
    active: str
    verdict: str


class UnavailableReference(StrictModel):
    ref: str
    reason: str

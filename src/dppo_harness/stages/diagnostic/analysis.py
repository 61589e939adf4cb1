"""The fixed analysis of a diagnostic run: all second-epoch loss calls pooled by loss tokens (no
selection), the plan's criteria, integrity re-checks, the classification for the planned model,
the next action, and what the stage contributes to result.json."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dppo_harness.evidence.backend import ServedModel
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument import replay
from dppo_harness.instrument.instrumentation import ANALYSIS_FILE, pool_calls
from dppo_harness.json_types import JsonObject, as_value
from dppo_harness.loss.terms import hist_bin_labels, magnitude_edges
from dppo_harness.stages.diagnostic.classification import (
    Classification,
    anchor_problems,
    classify,
    pinned_variant_problems,
    trainer_moved,
)
from dppo_harness.stages.diagnostic.conclusion import compose_summary, for_planned_model, next_action
from dppo_harness.stages.diagnostic.config import FIXES, LOOP_LABEL, DiagnosticConfig
from dppo_harness.stages.diagnostic.criteria import CriterionResult, evaluate_criteria
from dppo_harness.stages.diagnostic.run_state import DiagnosticResultFields, SelftestReport, SentinelSummary

if TYPE_CHECKING:
    from dppo_harness.plans import ExperimentSpec, Plan


@dataclass(frozen=True)
class DiagnosticResult:
    config: DiagnosticConfig
    records: list[ins.LossCallRecord]
    sentinels: SentinelSummary
    pooled: dict[str, Any] | None  # instrumentation.pool_calls of the second-epoch calls
    criteria: list[CriterionResult]
    classification: Classification
    selftest: SelftestReport
    updates_done: int
    stop_reason: str
    wall_seconds: float
    setup_seconds: float
    frozen_batch_sha256: str | None
    minibatches: list[JsonObject]
    next_action: JsonObject
    files: tuple[str, ...] = ()
    restore: JsonObject = field(default_factory=dict)
    effective_cap_seconds: float | None = None
    errors: list[str] = field(default_factory=list)
    served: ServedModel | None = None

    @property
    def result_fields(self) -> DiagnosticResultFields:
        """What this stage contributes to result.json."""
        return result_fields(self)

    def analysis_json(self) -> JsonObject:
        return ins.nan_free(
            {
                "kind": "bounded_diagnostic_analysis",
                "loop": LOOP_LABEL,
                "config": asdict(self.config),
                "updates_done": self.updates_done,
                "stop_reason": self.stop_reason,
                "wall_seconds": self.wall_seconds,
                "effective_cap_seconds": self.effective_cap_seconds,
                "restore": self.restore,
                "setup_seconds": self.setup_seconds,
                "frozen_batch_sha256": self.frozen_batch_sha256,
                "minibatches": self.minibatches,
                "per_update": [ins.summary_row(r) | {"loss_seconds": r.loss_seconds} for r in self.records],
                "pooled_second_epoch": self.pooled,
                "criteria": [asdict(c) for c in self.criteria],
                "classification": self.classification.as_dict(),
                "selftest_passed": self.selftest.get("passed"),
                "fixes": list(FIXES),
                "sentinels": self.sentinels,
                "errors": self.errors,
                "hist_bins": hist_bin_labels(magnitude_edges(self.config.delta)),
            }
        )


def analyse(
    cfg: DiagnosticConfig,
    plan: Plan,
    records: Sequence[ins.LossCallRecord],
    *,
    selftest: SelftestReport,
    sentinels: SentinelSummary,
    frozen_by_call: Sequence[np.ndarray] | None,
    updates_done: int,
    stop_reason: str,
    wall_seconds: float,
    setup_seconds: float,
    frozen_sha256: str | None,
    minibatches: list[JsonObject],
    errors: list[str],
    spec: ExperimentSpec | None,
    restore: JsonObject | None = None,
    effective_cap_seconds: float | None = None,
    served: ServedModel | None = None,
) -> DiagnosticResult:
    """The fixed analysis: ALL second-epoch loss calls pooled by loss tokens (no selection),
    the plan's criteria, integrity re-checks, and the classification."""
    loss_cfg = cfg.loss_config()
    second_epoch = [r for r in records if r.context.get("epoch") == 2]
    pooled = (
        pool_calls(second_epoch, [ins.record_prob_diff(r, loss_cfg) for r in second_epoch]) if second_epoch else None
    )
    planned = plan.diagnostic.analysis.criteria
    # Without a second-epoch loss call each criterion is reported missing (and failing), not left out.
    criteria = (
        evaluate_criteria(planned, pooled)
        if pooled
        else [
            CriterionResult(c.id, c.metric, None, True, False, "missing: no second-epoch loss call", {})
            for c in planned
        ]
    )
    # Every recorded call recomputed by the independent padded implementation (as replay does).
    integrity = [
        problem
        for r in records
        for problem in replay.check_record(r, loss_cfg.dppo_delta, loss_cfg.ratio_cap, loss_cfg.ppo_eps).problems
    ]
    variant = pinned_variant_problems(cfg) + anchor_problems(records, frozen_by_call, trainer_moved(sentinels))
    classification = classify(
        criteria=criteria,
        pooled=pooled,
        selftest=selftest,
        integrity_problems=integrity,
        variant_problems=variant,
        sentinels=sentinels,
        updates_done=updates_done,
        second_epoch_calls=len(second_epoch),
        stop_reason=stop_reason,
        delta=cfg.delta,
        updates_planned=cfg.max_updates,
        minibatches_per_epoch=cfg.minibatches_per_epoch,
        errors=errors,
    )
    if served is not None:
        classification = for_planned_model(classification, served)
    measured: JsonObject = {  # what the run measured, as the next action cites it
        "state": classification.state,
        "measured_cause": classification.measured_cause,
        "mask_fired": classification.mask_fired,
        "updates_done": updates_done,
    }
    action = next_action(classification, cfg, spec, plan.diagnostic.plan_id, served, measured)
    return DiagnosticResult(
        config=cfg,
        records=list(records),
        sentinels=sentinels,
        pooled=pooled,
        criteria=criteria,
        classification=classification,
        selftest=selftest,
        updates_done=updates_done,
        stop_reason=stop_reason,
        wall_seconds=wall_seconds,
        setup_seconds=setup_seconds,
        frozen_batch_sha256=frozen_sha256,
        minibatches=minibatches,
        next_action=action,
        errors=list(errors),
        restore=dict(restore or {}),
        effective_cap_seconds=effective_cap_seconds,
        served=served,
    )


def result_fields(res: DiagnosticResult) -> DiagnosticResultFields:
    """What this stage contributes to result.json (numbers only under metrics)."""
    c = res.classification
    metrics: dict[str, float] = {
        "diagnostic/updates_done": float(res.updates_done),
        "diagnostic/wall_seconds": float(res.wall_seconds),
        "diagnostic/setup_seconds": float(res.setup_seconds),
        "diagnostic/mask_fired": 1.0 if c.mask_fired else 0.0,
        "diagnostic/active": 1.0 if c.active else 0.0,
        "diagnostic/selftest_passed": 1.0 if res.selftest.get("passed") else 0.0,
    }
    if res.pooled:
        for k in (
            "dppo/masked_frac_loss_tokens",
            "dppo/masked_frac_nonzero_adv",
            "ppo/clip_frac_loss_tokens",
            "drift/abs_p90",
            "drift/abs_p99",
            "drift/abs_max",
            "tokens/loss",
            "tokens/nonzero_adv",
            "dppo/removed",
            "dppo/removed_pos_adv",
            "dppo/removed_neg_adv",
            "dppo/exceed_pos",
            "dppo/exceed_neg",
            "dppo/ratio_cap_hits",
            "ppo/clipped",
        ):
            v = res.pooled.get(k)
            if isinstance(v, (int, float)) and math.isfinite(v):
                metrics[f"diagnostic/epoch2_pooled/{k}"] = float(v)
    served = res.served or ServedModel(res.config.base_model, res.config.base_model)
    summary = compose_summary(
        served=served,
        updates_done=res.updates_done,
        max_updates=res.config.max_updates,
        groups=res.config.groups_per_batch,
        group_size=res.config.group_size,
        wall_seconds=res.wall_seconds,
        state=c.state,
        cause=c.cause,
        active=c.active,
        next_action=str(res.next_action.get("action", "review the frozen revised comparison spec (not executed)")),
    )
    calibration: JsonObject = {
        "values": {cr.id: (as_value(cr.value) if cr.value is not None else "missing") for cr in res.criteria},
        "note": (
            f"bounded diagnostic, not the original gate: {res.updates_done} updates over one frozen batch "
            f"({res.config.epochs} epochs x {res.config.minibatches_per_epoch} minibatches of "
            f"{res.config.groups_per_minibatch} groups), values pooled over all second-epoch loss calls by "
            f"loss-token counts; state {c.state}"
        ),
        "evidence_ref": ANALYSIS_FILE,
    }
    return {
        "metrics": metrics,
        "summary": summary,
        "activation_calibration": calibration,
        "final": {
            "status": "succeeded" if not res.errors else "failed",
            "verdict": "inconclusive",
            "outcome_reason": "insufficient_evidence" if not res.errors else "incomplete_execution",
        },
    }

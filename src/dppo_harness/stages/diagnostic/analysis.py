"""The fixed analysis of a diagnostic run: all second-epoch loss calls pooled by loss tokens (no
selection), the plan's criteria, integrity re-checks, the classification for the planned model,
the next action, and what the stage contributes to result.json."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument import replay
from dppo_harness.instrument.pooled import ANALYSIS_FILE, pool_calls
from dppo_harness.json_types import JsonObject, as_value
from dppo_harness.loss.terms import hist_bin_labels, magnitude_edges
from dppo_harness.service.identity import ServedModel
from dppo_harness.stages.diagnostic.classification import (
    Classification,
    CriterionResult,
    anchor_problems,
    classify,
    evaluate_criteria,
    pinned_variant_problems,
    trainer_moved,
)
from dppo_harness.stages.diagnostic.conclusion import compose_summary, for_planned_model, next_action
from dppo_harness.stages.diagnostic.config import FIXES, LOOP_LABEL, DiagnosticConfig
from dppo_harness.stages.diagnostic.run_state import RunState, SentinelSummary
from dppo_harness.stages.diagnostic.selftest import SelftestReport
from dppo_harness.train.clients import dump_response

if TYPE_CHECKING:
    from dppo_harness.plans import ExperimentSpec, Plan


class DiagnosticFinal(TypedDict):
    """The outcome the diagnostic proposes for result.json's `final` block."""

    status: str
    verdict: str
    outcome_reason: str


class DiagnosticResultFields(TypedDict):
    """What the diagnostic contributes to result.json (numbers only under `metrics`)."""

    metrics: dict[str, float]
    summary: str
    activation_calibration: dict[str, Any]  # {"values", "note", "evidence_ref"}
    final: DiagnosticFinal


@dataclass(frozen=True)
class DiagnosticResult:
    config: DiagnosticConfig
    state: RunState  # what the run measured, however early it stopped
    sentinels: SentinelSummary
    pooled: dict[str, Any] | None  # instrument.pooled.pool_calls of the second-epoch calls
    criteria: list[CriterionResult]
    classification: Classification
    selftest: SelftestReport
    wall_seconds: float
    next_action: JsonObject
    effective_cap_seconds: float | None = None
    served: ServedModel | None = None

    @property
    def result_fields(self) -> DiagnosticResultFields:
        """What this stage contributes to result.json (numbers only under metrics)."""
        c = self.classification
        metrics: dict[str, float] = {
            "diagnostic/updates_done": float(self.state.updates_done),
            "diagnostic/wall_seconds": float(self.wall_seconds),
            "diagnostic/setup_seconds": float(self.state.setup_seconds),
            "diagnostic/mask_fired": 1.0 if c.mask_fired else 0.0,
            "diagnostic/active": 1.0 if c.active else 0.0,
            "diagnostic/selftest_passed": 1.0 if self.selftest.get("passed") else 0.0,
        }
        if self.pooled:
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
                v = self.pooled.get(k)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    metrics[f"diagnostic/epoch2_pooled/{k}"] = float(v)
        if y := self.state.rollout_yield:  # the frozen batch's truncation and answer yield
            metrics |= {f"diagnostic/rollout_{k}": float(y[k]) for k in ("truncated_frac", "no_answer_frac")}
            metrics["diagnostic/rollout_mean_response_tokens"] = float(y["mean_response_tokens"])
        served = self.served or ServedModel(self.config.base_model, self.config.base_model, None, "plan")
        summary = compose_summary(
            served=served,
            updates_done=self.state.updates_done,
            max_updates=self.config.max_updates,
            groups=self.config.groups_per_batch,
            group_size=self.config.group_size,
            wall_seconds=self.wall_seconds,
            state=c.state,
            cause=c.cause,
            active=c.active,
            next_action=str(self.next_action.get("action", "review the frozen revised comparison spec (not executed)")),
        )
        calibration: JsonObject = {
            "values": {cr.id: (as_value(cr.value) if cr.value is not None else "missing") for cr in self.criteria},
            "note": (
                f"bounded diagnostic, not the original gate: {self.state.updates_done} updates over one frozen batch "
                f"({self.config.epochs} epochs x {self.config.minibatches_per_epoch} minibatches of "
                f"{self.config.groups_per_minibatch} groups), values pooled over all second-epoch loss calls by "
                f"loss-token counts; state {c.state}"
            ),
            "evidence_ref": ANALYSIS_FILE,
        }
        return {
            "metrics": metrics,
            "summary": summary,
            "activation_calibration": calibration,
            "final": {
                "status": "succeeded" if not self.state.errors else "failed",
                "verdict": "inconclusive",
                "outcome_reason": "insufficient_evidence" if not self.state.errors else "incomplete_execution",
            },
        }

    def analysis_json(self) -> JsonObject:
        st = self.state
        return ins.nan_free(
            {
                "kind": "bounded_diagnostic_analysis",
                "loop": LOOP_LABEL,
                "config": asdict(self.config),
                "updates_done": st.updates_done,
                "stop_reason": st.stop_reason,
                "wall_seconds": self.wall_seconds,
                "effective_cap_seconds": self.effective_cap_seconds,
                "restore": st.restore,
                "setup_seconds": st.setup_seconds,
                "frozen_batch_sha256": st.frozen.sha256 if st.frozen else None,
                "minibatches": st.minibatches,
                "per_update": [ins.summary_row(r) | {"loss_seconds": r.loss_seconds} for r in st.records],
                "pooled_second_epoch": self.pooled,
                "criteria": [asdict(c) for c in self.criteria],
                "classification": self.classification.as_dict(),
                "selftest_passed": self.selftest.get("passed"),
                "fixes": list(FIXES),
                "sentinels": self.sentinels,
                "errors": st.errors,
                "hist_bins": hist_bin_labels(magnitude_edges(self.config.delta)),
                "timings": {  # where the stage's seconds went, on the budget ledger's clock
                    "restore_seconds": st.restore_seconds,
                    "sampling_seconds": st.sampling_seconds,
                    "sampled_sequences": st.sampled_sequences,
                    "update_seconds": st.update_seconds,
                    "update_phases": st.update_phases,
                    "setup_seconds": st.setup_seconds,
                    "wall_seconds": self.wall_seconds,
                    "wall_counted_from": "session start (the budget ledger's clock)",
                },
                "final_checkpoint": st.final_checkpoint,
                "trained_client_initial_output": st.initial_output,
                "trained_client_first_optim_step": dump_response(st.first_optim) if st.first_optim else None,
                "snapshots": st.snapshots,
                "rollout_yield": st.rollout_yield,
            }
        )


def analyse(
    cfg: DiagnosticConfig,
    plan: Plan,
    state: RunState,
    selftest: SelftestReport,
    sentinels: SentinelSummary,
    *,
    wall_seconds: float,
    spec: ExperimentSpec | None,
    effective_cap_seconds: float | None = None,
    served: ServedModel | None = None,
) -> DiagnosticResult:
    """The fixed analysis: ALL second-epoch loss calls pooled by loss tokens (no selection),
    the plan's criteria, integrity re-checks, and the classification."""
    loss_cfg, records = cfg.loss_config(), state.records
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
        for problem in replay.check_record(
            r, loss_cfg.normalization, loss_cfg.dppo_delta, loss_cfg.ratio_cap, loss_cfg.ppo_eps
        ).problems
    ]
    variant = pinned_variant_problems(cfg) + anchor_problems(records, state.frozen_by_call, trainer_moved(sentinels))
    classification = classify(
        criteria=criteria,
        pooled=pooled,
        selftest=selftest,
        integrity_problems=integrity,
        variant_problems=variant,
        sentinels=sentinels,
        updates_done=state.updates_done,
        second_epoch_calls=len(second_epoch),
        stop_reason=state.stop_reason,
        delta=cfg.delta,
        updates_planned=cfg.max_updates,
        minibatches_per_epoch=cfg.minibatches_per_epoch,
        errors=state.errors,
    )
    if served is not None:
        classification = for_planned_model(classification, served)
    measured: JsonObject = {  # what the run measured, as the next action cites it
        "state": classification.state,
        "measured_cause": classification.measured_cause,
        "mask_fired": classification.mask_fired,
        "updates_done": state.updates_done,
    }
    action = next_action(classification, cfg, spec, plan.diagnostic.plan_id, served, measured)
    return DiagnosticResult(
        cfg,
        state,
        sentinels,
        pooled,
        criteria,
        classification,
        selftest,
        wall_seconds,
        action,
        effective_cap_seconds,
        served,
    )

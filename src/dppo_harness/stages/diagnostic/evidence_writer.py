"""What the diagnostic registers in the evidence bundle: its declarations before any service work
(revised spec, deviations, unavailable references, self-test) and, after the run, the analysis,
sentinels, next action, provenance, service-work ledger, feasibility, replay output and report."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from pydantic import JsonValue

from dppo_harness.evidence import report
from dppo_harness.evidence.snapshots import post_snapshot
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument.pooled import ANALYSIS_FILE, REVISED_SPEC_FILE
from dppo_harness.json_types import JsonObject
from dppo_harness.service.identity import ServedModel
from dppo_harness.stages.diagnostic import evidence_items
from dppo_harness.stages.diagnostic.analysis import DiagnosticResult, analyse
from dppo_harness.stages.diagnostic.config import BASIS_FOR_REFERENCES, FINALIZE_RESERVE_S, LOOP_LABEL, DiagnosticConfig
from dppo_harness.stages.diagnostic.files import (
    NEXT_ACTION_FILE,
    ORIGINAL_GATE_REPORT_FILE,
    REFERENCES_FILE,
    REPLAY_OUTPUT_FILE,
    SELFTEST_FILE,
    SENTINEL_FILE,
    SERVICE_WORK_FILE,
)
from dppo_harness.stages.diagnostic.records import DiagnosticResultFields, SelftestReport, SentinelSummary
from dppo_harness.stages.diagnostic.run_state import RunState
from dppo_harness.stages.diagnostic.selftest import deterministic_selftest
from dppo_harness.train.clients import dump_response
from dppo_harness.train.optimizer_checks import OptimizerCheck, echoed_config, optimizer_check

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ExperimentSpec, Plan


def register_json(bundle: EvidenceBundle, state: RunState, name: str, kind: str, obj: object) -> None:
    bundle.register_json(name, kind, ins.nan_free(obj))
    state.files.append(name)


def declare(bundle: EvidenceBundle, plan: Plan, cfg: DiagnosticConfig, state: RunState) -> SelftestReport:
    """Before any service work: revised spec, deviations, unavailable references, self-test."""
    if bundle.entry(REVISED_SPEC_FILE) is None:  # normally written at session start (before any update)
        bundle.register_plan(plan, REVISED_SPEC_FILE)
    state.files.append(REVISED_SPEC_FILE)
    for dev in plan.diagnostic.deviations:
        bundle.add_deviation(dev.field, dev.original, dev.effective, dev.reason)
    for red in cfg.reductions:
        bundle.add_deviation(
            "steps" if red["field"] in ("max_updates", "max_wall_seconds") else "effective_batch",
            f"{red['field']}={red['original']}",
            f"{red['field']}={red['effective']}",
            "size reduction for a small test plan (not the requester's settings)",
        )
    register_json(
        bundle,
        state,
        REFERENCES_FILE,
        "report",
        {
            "loop": LOOP_LABEL,
            "unavailable_references": [
                dict(r.model_dump(), available=False) for r in plan.diagnostic.unavailable_references
            ],
            "reason": BASIS_FOR_REFERENCES,
            "consequence": "the old code path cannot be audited; this run tests the replacement loop and the pinned rule",
        },
    )
    # What the deviations' "kept separately" points at: the original gate report's status.
    register_json(
        bundle,
        state,
        ORIGINAL_GATE_REPORT_FILE,
        "report",
        evidence_items.original_gate_report(
            plan.diagnostic, "gate-report.json" if bundle.entry("gate-report.json") else None
        ),
    )
    bundle.update_result(original_hypothesis_tested=False, tested_instead=plan.diagnostic.tested_instead)
    selftest = deterministic_selftest(loss_cfg=cfg.loss_config())
    register_json(bundle, state, SELFTEST_FILE, "report", selftest)
    return selftest


def own_optimizer_check(cfg: DiagnosticConfig, plan: Plan, state: RunState) -> OptimizerCheck | None:
    """The optimizer check from the trained client's OWN first optim_step response (its metrics
    are optional in the SDK's OptimStepResponse: absent, the config stays declared), or None
    before update 1."""
    if state.first_optim is None:
        return None
    metrics = getattr(state.first_optim, "metrics", None) or {}
    requested = dict(cfg.adam)
    return optimizer_check(
        after_restore=0,
        requested_optimizer=plan.diagnostic.fixed_settings.optimizer.name,
        requested_config=requested,
        info=state.info,
        info_ref=f"{ANALYSIS_FILE}#restore.get_info",
        echoed=echoed_config(metrics, list(requested)),
        echo_ref=f"{ANALYSIS_FILE}#trained_client_first_optim_step",
        echo_observed_on="the trained client's own optim_step response of update 1 (checked before update 2)",
    )


def _trained_client_provenance(bundle: EvidenceBundle, cfg: DiagnosticConfig, plan: Plan, state: RunState) -> None:
    """Post the trained arm's provenance: the optimizer check from ITS OWN first optim_step
    response, its own initial output, and one more restore when the diagnostic restored it itself."""
    prior = (bundle.result.get("initialization_provenance") or {}).get("arms", {}).get(cfg.arm)
    if not prior or state.initial_output is None:
        return
    entry = evidence_items.trained_client_entry(
        prior,
        restore=state.restore,
        initial_output=state.initial_output,
        own_check=own_optimizer_check(cfg, plan, state),
        restore_ref=f"{ANALYSIS_FILE}#restore",
        new_restore=not state.preloaded,
    )
    bundle.update_result(initialization_provenance={"arms": {cfg.arm: entry}})


def write_evidence(
    bundle: EvidenceBundle,
    plan: Plan,
    cfg: DiagnosticConfig,
    state: RunState,
    selftest: SelftestReport,
    *,
    wall: float,
    cap_s: float,
    backend: str,
    spec: ExperimentSpec | None,
    served: ServedModel | None = None,
    prior_service_work: Mapping[str, Mapping[str, int]] | None = None,
) -> DiagnosticResult:
    """Analyse, then write sentinels, analysis, next action, report and result fields."""
    result = _analyse_run(plan, cfg, state, selftest, wall=wall, cap_s=cap_s, spec=spec, served=served)
    if state.sentinels is not None and state.sentinels.points:
        register_json(bundle, state, SENTINEL_FILE, "metrics", state.sentinels.evidence())
    analysis = _analysis_record(bundle, result, state, wall)
    register_json(bundle, state, ANALYSIS_FILE, "metrics", analysis)
    register_json(bundle, state, NEXT_ACTION_FILE, "report", result.next_action)
    _trained_client_provenance(bundle, cfg, plan, state)
    _register_service_work(bundle, plan, state, prior_service_work)
    # Feasibility from the diagnostic's own measured setup: the plan forbids an extra pilot.
    if state.update_seconds:
        _record_feasibility(bundle, cfg, state, spec)
    # The replay output itself, as evidence: a reviewer reads it without rerunning replay.
    if state.records:
        _register_replay_output(bundle, state)
    state.files += list(report.write_report(bundle, analysis, backend, result.next_action).values())
    result = replace(result, files=tuple(state.files))
    _post_result_fields(bundle, state, result.result_fields)
    post_snapshot(bundle, "diagnostic stage end", reserve=4)
    return result


def _analyse_run(
    plan: Plan,
    cfg: DiagnosticConfig,
    state: RunState,
    selftest: SelftestReport,
    *,
    wall: float,
    cap_s: float,
    spec: ExperimentSpec | None,
    served: ServedModel | None,
) -> DiagnosticResult:
    """The fixed analysis of what the run measured (`state`), however early it stopped."""
    tracker = state.sentinels
    sentinels: SentinelSummary = (
        tracker.summary() if tracker is not None else {"points": [], "at_init": None, "last": None}
    )
    return analyse(
        cfg,
        plan,
        state.records,
        selftest=selftest,
        sentinels=sentinels,
        frozen_by_call=state.frozen_by_call or None,
        updates_done=state.updates_done,
        stop_reason=state.stop_reason,
        wall_seconds=wall,
        setup_seconds=state.setup_seconds,
        frozen_sha256=state.frozen.sha256 if state.frozen else None,
        minibatches=state.minibatches,
        errors=state.errors,
        spec=spec,
        restore=state.restore,
        effective_cap_seconds=cap_s,
        served=served,
    )


def _timings(state: RunState, wall: float) -> JsonObject:
    """Where the stage's seconds went, on the budget ledger's clock."""
    return {
        "restore_seconds": state.restore_seconds,
        "sampling_seconds": state.sampling_seconds,
        "sampled_sequences": state.sampled_sequences,
        "update_seconds": [*state.update_seconds],
        "update_phases": [dict[str, JsonValue](p) for p in state.update_phases],
        "setup_seconds": state.setup_seconds,
        "wall_seconds": wall,
        "wall_counted_from": "session start (the budget ledger's clock)",
    }


def _analysis_record(bundle: EvidenceBundle, result: DiagnosticResult, state: RunState, wall: float) -> JsonObject:
    """The analysis file's content: the analysis, then the run's timings, checkpoint, the trained
    client's own first outputs, snapshots, rollout yield and what effective-config.json declares."""
    analysis = result.analysis_json()
    analysis["timings"] = _timings(state, wall)
    analysis["final_checkpoint"] = state.final_checkpoint
    analysis["trained_client_initial_output"] = state.initial_output
    analysis["trained_client_first_optim_step"] = dump_response(state.first_optim) if state.first_optim else None
    analysis["snapshots"] = [*state.snapshots]
    analysis["rollout_yield"] = state.rollout_yield
    analysis["declared"] = _declared(bundle)
    return analysis


def _register_service_work(
    bundle: EvidenceBundle, plan: Plan, state: RunState, prior_service_work: Mapping[str, Mapping[str, int]] | None
) -> None:
    """Declared vs executed service work: the requester allowed only the declared updates and batches."""
    executed = {k: dict(v) for k, v in (prior_service_work or {}).items()}
    executed["bounded_diagnostic"] = {
        "optimizer_updates": state.updates_done,
        "sampling_batches": 1 if state.frozen is not None else 0,
    }
    register_json(
        bundle,
        state,
        SERVICE_WORK_FILE,
        "report",
        evidence_items.service_work_ledger(plan.diagnostic.service_work, executed),
    )


def _record_feasibility(
    bundle: EvidenceBundle, cfg: DiagnosticConfig, state: RunState, spec: ExperimentSpec | None
) -> None:
    """The result's feasibility block, from the run's measured restore, sampling and update seconds."""
    eff_path = bundle.file_path("effective-config.json")
    eff = json.loads(eff_path.read_text()) if bundle.entry("effective-config.json") else {}
    bundle.update_result(
        feasibility=evidence_items.diagnostic_feasibility(
            config=asdict(cfg),
            effective_config=eff,
            primary_endpoint=spec.primary_endpoint if spec is not None else "none in this diagnostic",
            setup_seconds=state.restore_seconds,
            sampling_seconds=state.sampling_seconds,
            sampled_sequences=state.sampled_sequences,
            update_seconds=state.update_seconds,
            sequences_per_update=state.sampled_sequences / max(1, cfg.minibatches_per_epoch),
            planned_updates=cfg.max_updates,
            recovery_seconds=FINALIZE_RESERVE_S,
        )
    )


def _register_replay_output(bundle: EvidenceBundle, state: RunState) -> None:
    """The offline replay of the bundle's recorded loss calls: its output and exit code, registered."""
    code, text = evidence_items.replay_output(bundle.dir)
    bundle.register_bytes(REPLAY_OUTPUT_FILE, "log", (text + f"exit code {code}\n").encode())
    state.files.append(REPLAY_OUTPUT_FILE)
    bundle.update_result(metrics={"diagnostic/replay_exit_code": float(code)})


def _post_result_fields(bundle: EvidenceBundle, state: RunState, fields_: DiagnosticResultFields) -> None:
    """The rollout yield's metrics, then the stage's result fields; an activation calibration an
    earlier stage already set is kept."""
    if state.rollout_yield:
        bundle.update_result(
            metrics={
                "diagnostic/rollout_truncated_frac": state.rollout_yield["truncated_frac"],
                "diagnostic/rollout_no_answer_frac": state.rollout_yield["no_answer_frac"],
                "diagnostic/rollout_mean_response_tokens": state.rollout_yield["mean_response_tokens"],
            }
        )
    bundle.update_result(
        **{
            k: v
            for k, v in fields_.items()
            if k in ("metrics", "summary", "activation_calibration")
            and not (k == "activation_calibration" and bundle.result.get("activation_calibration"))
        }
    )


def _declared(bundle: EvidenceBundle) -> JsonObject:
    """The renderer and loss normalization effective-config.json declares (what the report cites)."""
    if bundle.entry("effective-config.json") is None:
        return {}
    eff = json.loads(bundle.file_path("effective-config.json").read_text())
    return {k: eff[k] for k in ("renderer", "loss_normalization") if k in eff}

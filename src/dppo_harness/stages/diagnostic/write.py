"""The bounded diagnostic's fixed analysis and its one evidence writer: the only diagnostic code that
knows its file names and the result.json fields it sets (the names replay and the session also read
live in `instrument.instrumentation`, which must not import the diagnostic). What it writes as the
run goes leaves a valid bundle if the run is killed; `analyse` pools ALL second-epoch loss calls by
loss tokens (no selection)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import tinker
from pydantic import JsonValue

from dppo_harness.evidence import budget, report
from dppo_harness.evidence.backend import ServedModel, served_name
from dppo_harness.evidence.files import MAX_FILE_BYTES, EvidenceError
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument import replay
from dppo_harness.instrument.instrumentation import ANALYSIS_FILE, FROZEN_BATCH_STEM, pool_calls
from dppo_harness.json_types import JsonObject, as_value
from dppo_harness.loss.terms import LossStats, hist_bin_labels, magnitude_edges
from dppo_harness.stages.diagnostic.classification import (
    Classification,
    CriterionResult,
    SelftestReport,
    anchor_problems,
    classify,
    deterministic_selftest,
    evaluate_criteria,
    next_action,
    pinned_variant_problems,
)
from dppo_harness.stages.diagnostic.config import (
    BASIS_FOR_REFERENCES,
    FINALIZE_RESERVE_S,
    FIXES,
    LOOP_LABEL,
    adam,
    config_record,
    loss_config,
)
from dppo_harness.train.clients import dump_response
from dppo_harness.train.optimizer_checks import OptimizerCheck, echoed_config, optimizer_check, own_response_only

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ExperimentSpec, Plan
    from dppo_harness.plans.models import BoundedDiagnostic, ServiceWork
    from dppo_harness.rollout.frozen_batch import FrozenBatch
    from dppo_harness.stages.diagnostic.loop import RunState, SentinelSummary
    from dppo_harness.stages.restoration import ArmProvenance

SELFTEST_FILE = "diagnostic-selftest.json"
SENTINEL_FILE = "diagnostic-sentinels.json"
REFERENCES_FILE = "diagnostic-prior-references.json"
NEXT_ACTION_FILE = "diagnostic-next-action.json"
ORIGINAL_GATE_REPORT_FILE = "original-gate-report.json"
SERVICE_WORK_FILE = "service-work-ledger.json"
REPLAY_OUTPUT_FILE = "diagnostic-replay.txt"
FEASIBILITY_SOURCE = "diagnostic-analysis.json#timings"
SERVICE_WORK = ("optimizer_updates", "sampling_batches")  # what the plan declares per item and in total
NO_GPU: JsonObject = {"gpu_count": None, "allocation_source": None}  # the service allocates, not this run


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
    plan: BoundedDiagnostic
    state: RunState  # what the run measured, however early it stopped
    sentinels: SentinelSummary
    pooled: dict[str, Any] | None  # instrumentation.pool_calls of the second-epoch calls
    criteria: list[CriterionResult]
    classification: Classification
    selftest: SelftestReport
    next_action: JsonObject
    served: ServedModel

    @property
    def result_fields(self) -> DiagnosticResultFields:
        """What this stage contributes to result.json (numbers only under metrics)."""
        c, sch = self.classification, self.plan.schedule
        metrics: dict[str, float] = {
            "diagnostic/updates_done": float(self.state.updates_done),
            "diagnostic/wall_seconds": float(self.state.wall_seconds),
            "diagnostic/setup_seconds": float(self.state.setup_seconds),
            "diagnostic/mask_fired": 1.0 if c.mask_fired else 0.0,
            "diagnostic/active": 1.0 if c.active else 0.0,
            "diagnostic/selftest_passed": 1.0 if self.selftest.get("passed") else 0.0,
        }
        if self.pooled:
            pooled = LossStats.from_row(self.pooled)
            for k in (  # LossStats fields, under their recorded names in result.json
                "dppo_masked_frac_loss_tokens",
                "dppo_masked_frac_nonzero_adv",
                "ppo_clip_frac_loss_tokens",
                "drift_abs_p90",
                "drift_abs_p99",
                "drift_abs_max",
                "tokens_loss",
                "tokens_nonzero_adv",
                "dppo_removed",
                "dppo_removed_pos_adv",
                "dppo_removed_neg_adv",
                "dppo_exceed_pos",
                "dppo_exceed_neg",
                "dppo_ratio_cap_hits",
                "ppo_clipped",
            ):
                v = getattr(pooled, k)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    metrics[f"diagnostic/epoch2_pooled/{LossStats.recorded_name(k)}"] = float(v)
        if y := self.state.rollout_yield:  # the frozen batch's truncation and answer yield
            metrics |= {f"diagnostic/rollout_{k}": float(y[k]) for k in ("truncated_frac", "no_answer_frac")}
            metrics["diagnostic/rollout_mean_response_tokens"] = float(y["mean_response_tokens"])
        # Two plain sentences: what ran (naming the stand-in when one served) and what it showed,
        # with the next action. Details live in report.md.
        served, name = self.served, self.served.served or "a model the service did not name"
        model = f"the stand-in {name} (not {served.planned})" if served.rehearsal else name
        action = str(self.next_action.get("action", "review the frozen revised comparison spec (not executed)"))
        shown = "the mask engaged" if c.active else f"the measured state was {c.state}"
        sentences = (
            f"A bounded DPPO diagnostic trained {model} for {self.state.updates_done} of {sch.max_optimizer_updates} "
            f"updates on one frozen {sch.groups_per_batch}x{sch.group_size} GSM8K batch in {self.state.wall_seconds:.0f} s",
            f"On the stand-in {shown}, so for {served.planned} the cause is {c.cause or 'none'} "
            f"and the next action is to {action.split(':')[0]}"
            if served.rehearsal
            else f"Pooled over the second epoch {shown} (cause {c.cause or 'none'}); next: {action.split(':')[0]}",
        )
        # No inner sentence ends: a summary sentence must stay one sentence.
        summary = ". ".join(re.sub(r"[.!?](?=\s)", ",", x).rstrip(".!? ") for x in sentences) + "."
        calibration: JsonObject = {
            "values": {cr.id: (as_value(cr.value) if cr.value is not None else "missing") for cr in self.criteria},
            "note": (
                f"bounded diagnostic, not the original gate: {self.state.updates_done} updates over one frozen batch "
                f"({sch.epochs} epochs x {sch.minibatches_per_epoch} minibatches of "
                f"{sch.groups_per_minibatch} groups), values pooled over all second-epoch loss calls by "
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
                "config": config_record(self.plan),
                "updates_done": st.updates_done,
                "stop_reason": st.stop_reason,
                "wall_seconds": self.state.wall_seconds,
                "effective_cap_seconds": st.cap_seconds,
                "restore": st.restore,
                "setup_seconds": st.setup_seconds,
                "frozen_batch_sha256": st.frozen.sha256 if st.frozen else None,
                "minibatches": st.minibatches,
                "per_update": [ins.summary_row(r) | {"loss_seconds": r.loss_seconds} for r in st.records],
                "pooled_second_epoch": self.pooled,
                "criteria": [asdict(c) for c in self.criteria],
                "classification": asdict(self.classification),
                "selftest_passed": self.selftest.get("passed"),
                "fixes": list(FIXES),
                "sentinels": self.sentinels,
                "errors": st.errors,
                "hist_bins": hist_bin_labels(magnitude_edges(float(self.plan.fixed_settings.treatment.delta))),
                "timings": {  # where the stage's seconds went, on the budget ledger's clock
                    "restore_seconds": st.restore_seconds,
                    "sampling_seconds": st.sampling_seconds,
                    "sampled_sequences": st.sampled_sequences,
                    "update_seconds": st.update_seconds,
                    "update_phases": st.update_phases,
                    "setup_seconds": st.setup_seconds,
                    "wall_seconds": self.state.wall_seconds,
                    "wall_counted_from": "session start (the budget ledger's clock)",
                },
                "final_checkpoint": st.final_checkpoint,
                "trained_client_initial_output": st.initial_output,
                "trained_client_first_optim_step": dump_response(st.first_optim) if st.first_optim else None,
                "rollout_yield": st.rollout_yield,
            }
        )


def analyse(
    plan: Plan,
    state: RunState,
    selftest: SelftestReport,
    sentinels: SentinelSummary,
    served: ServedModel,
    spec: ExperimentSpec | None = None,
) -> DiagnosticResult:
    """The fixed analysis: ALL second-epoch loss calls pooled by loss tokens (no selection),
    the plan's criteria, integrity re-checks, and the classification."""
    d, records = plan.diagnostic, state.records
    loss_cfg = loss_config(d)
    second_epoch = [r for r in records if r.context.get("epoch") == 2]
    pooled = pool_calls([ins.record_terms(r) for r in second_epoch]) if second_epoch else None
    planned = d.analysis.criteria
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
    # The anchor equal to the current policy convicts only when the sentinels saw the trainer move.
    last = sentinels.get("last")
    moved = bool(last["summary"]["p_minus_p_init"]["abs_max"] > 0.0) if last else None
    variant = pinned_variant_problems(loss_cfg) + anchor_problems(records, state.frozen, moved)
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
        delta=loss_cfg.dppo_delta,
        updates_planned=d.schedule.max_optimizer_updates,
        minibatches_per_epoch=d.schedule.minibatches_per_epoch,
        errors=state.errors,
        served=served,
    )
    action = next_action(classification, d, spec, served, state.updates_done)
    return DiagnosticResult(d, state, sentinels, pooled, criteria, classification, selftest, action, served)


def declare(bundle: EvidenceBundle, plan: Plan) -> SelftestReport:
    """Before any service work (the session registered the revised spec): deviations, unavailable references, self-test."""
    for dev in plan.diagnostic.deviations:
        bundle.add_deviation(dev.field, dev.original, dev.effective, dev.reason)
    references = [dict(r.model_dump(), available=False) for r in plan.diagnostic.unavailable_references]
    bundle.register_json(
        REFERENCES_FILE,
        "report",
        {
            "loop": LOOP_LABEL,
            "unavailable_references": references,
            "reason": BASIS_FOR_REFERENCES,
            "consequence": "the old code path cannot be audited; this run tests the replacement loop and the pinned rule",
        },
    )
    # What the deviations' "kept separately" points at: the original gate report's status.
    gate_report = "gate-report.json" if bundle.entry("gate-report.json") else None
    bundle.register_json(ORIGINAL_GATE_REPORT_FILE, "report", original_gate_report(plan.diagnostic, gate_report))
    bundle.update_result(original_hypothesis_tested=False, tested_instead=plan.diagnostic.tested_instead)
    selftest = deterministic_selftest(loss_cfg=loss_config(plan.diagnostic))
    bundle.register_json(SELFTEST_FILE, "report", ins.nan_free(selftest))
    return selftest


def journal_frozen_batch(bundle: EvidenceBundle, frozen: FrozenBatch) -> None:
    """The frozen batch, durable in the journal before any update trains on it (a killed run keeps
    it); the writer registers these bytes (replay re-derives from them)."""
    npz, manifest = frozen.to_bytes()
    bundle.journal.append("diagnostic", "record", "frozen batch", manifest.decode(), blob=npz)


def register_frozen_batch(bundle: EvidenceBundle) -> None:
    """The frozen batch as the run journaled it."""
    e = next((e for e in bundle.journal.entries("record", "diagnostic") if e.label == "frozen batch"), None)
    if e is None or e.blob is None or not isinstance(e.data, str):
        raise EvidenceError(f"the frozen batch the run sampled is not in {bundle.journal.path}")
    bundle.register_bytes(f"{FROZEN_BATCH_STEM}.npz", "tensors", e.blob)
    bundle.register_bytes(f"{FROZEN_BATCH_STEM}.manifest.json", "manifest", e.data.encode())


def journal_record(bundle: EvidenceBundle, record: ins.LossCallRecord) -> None:
    """One update's record, durable in the journal before the optimizer step it feeds (a killed run keeps it)."""
    label = f"update {record.context['update_index']}"
    bundle.journal.append("diagnostic", "record", label, blob=ins.records_to_npz([record]))


def post_progress(bundle: EvidenceBundle, state: RunState) -> None:
    """Every SNAPSHOT_EVERY_UPDATES updates, the counts posted while running and a journal snapshot
    (a killed run keeps its numbers)."""
    n = state.updates_done
    if n % budget.SNAPSHOT_EVERY_UPDATES != 0:
        return
    bundle.update_result(metrics={"diagnostic/updates_done": float(n), "diagnostic/elapsed_seconds": state.elapsed()})
    bundle.journal.snapshot("diagnostic", f"diagnostic after update {n}")


def own_optimizer_check(
    plan: Plan, first_optim: tinker.OptimStepResponse, info: tinker.types.GetInfoResponse | None
) -> OptimizerCheck:
    """The optimizer check from the trained client's OWN first optim_step response (its metrics
    are optional in the SDK's OptimStepResponse: absent, the config stays declared)."""
    requested = adam(plan.diagnostic)
    return optimizer_check(
        after_restore=0,
        requested_optimizer=plan.diagnostic.fixed_settings.optimizer.name,
        requested_config=requested,
        info=info,
        info_ref=f"{ANALYSIS_FILE}#restore.get_info",
        echoed=echoed_config(first_optim.metrics, list(requested)),
        echo_ref=f"{ANALYSIS_FILE}#trained_client_first_optim_step",
        echo_observed_on="the trained client's own optim_step response of update 1 (checked before update 2)",
    )


def write_evidence(
    bundle: EvidenceBundle,
    plan: Plan,
    state: RunState,
    selftest: SelftestReport,
    backend: str,
    spec: ExperimentSpec | None,
    prior_service_work: Mapping[str, Mapping[str, int]] | None,
) -> DiagnosticResult:
    """The frozen batch and the update records' archives, then the fixed analysis of what the run
    measured (however early it stopped), the sentinels, analysis, next action, the trained arm's
    provenance, the service-work ledger, feasibility, the replay output, the report and the result fields."""
    d = plan.diagnostic
    per_file = budget.updates_per_archive(
        d.schedule.groups_per_minibatch * d.schedule.group_size, d.fixed_settings.sampling.max_tokens
    )
    if state.frozen is not None:
        register_frozen_batch(bundle)
    try:
        register_update_archives(bundle, state.records, per_file)
    except Exception as exc:  # recorded: the analysis then says which records are missing
        state.errors.append(f"update records not registered: {type(exc).__name__}: {exc}")
    no_sentinels: SentinelSummary = {"points": [], "at_init": None, "last": None}
    sentinels = state.sentinels.summary() if state.sentinels is not None else no_sentinels
    info = state.restore.get("get_info")  # the served model as the trained client's own get_info names it
    served = ServedModel(plan.planned_model, served_name(info if isinstance(info, dict) else None))
    result = analyse(plan, state, selftest, sentinels, served, spec)
    if state.sentinels is not None and state.sentinels.points:
        bundle.register_json(SENTINEL_FILE, "metrics", ins.nan_free(state.sentinels.evidence()))
    effective = (
        json.loads(bundle.file_path("effective-config.json").read_text())
        if bundle.entry("effective-config.json") is not None
        else {}
    )
    analysis = result.analysis_json()
    # what effective-config.json declares (the report cites it)
    analysis["declared"] = {k: effective[k] for k in ("renderer", "loss_normalization") if k in effective}
    bundle.register_json(ANALYSIS_FILE, "metrics", analysis)
    bundle.register_json(NEXT_ACTION_FILE, "report", ins.nan_free(result.next_action))
    # The trained arm's provenance: the optimizer check from ITS OWN first optim_step response, its
    # own initial output, and one more restore when the diagnostic restored it itself.
    arm = plan.diagnostic.fixed_settings.treatment.arm
    prior = (bundle.result.get("initialization_provenance") or {}).get("arms", {}).get(arm)
    if prior and state.initial_output is not None:
        entry = trained_client_entry(
            prior,
            restore=state.restore,
            initial_output=state.initial_output,
            own_check=state.own_check,
            new_restore=not state.preloaded,
        )
        bundle.update_result(initialization_provenance={"arms": {arm: entry}})
    # Declared vs executed service work: the requester allowed only the declared updates and batches.
    executed = {k: dict(v) for k, v in (prior_service_work or {}).items()}
    executed["bounded_diagnostic"] = {
        "optimizer_updates": state.updates_done,
        "sampling_batches": 1 if state.frozen is not None else 0,
    }
    ledger = service_work_ledger(plan.diagnostic.service_work, executed)
    bundle.register_json(SERVICE_WORK_FILE, "report", ledger)
    if state.update_seconds:  # feasibility from the diagnostic's own measured setup: the plan forbids a pilot
        endpoint = spec.primary_endpoint if spec is not None else "none in this diagnostic"
        bundle.update_result(feasibility=diagnostic_feasibility(plan.diagnostic, state, effective, endpoint))
    if state.records:  # the replay output itself: a reviewer reads it without rerunning replay
        buf = io.StringIO()  # `python -m dppo_harness.instrument.replay` on the bundle, run in-process
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = replay.main([str(bundle.dir)])
        bundle.register_bytes(REPLAY_OUTPUT_FILE, "log", (buf.getvalue() + f"exit code {code}\n").encode())
        bundle.update_result(metrics={"diagnostic/replay_exit_code": float(code)})
    report.write_report(bundle, analysis, backend, result.next_action)
    fields_ = result.result_fields  # an activation calibration an earlier stage already set is kept
    keep = (
        ("metrics", "summary")
        if bundle.result.get("activation_calibration")
        else ("metrics", "summary", "activation_calibration")
    )
    bundle.update_result(**{k: v for k, v in fields_.items() if k in keep})
    return result


def original_gate_report(plan: BoundedDiagnostic, gate_report_in_bundle: str | None = None) -> JsonObject:
    """What the deviations' "kept separately" points at: the original pilot's gate report is not in
    reach (the prior run's evidence), and this session's gate stage report, if any, is untouched."""
    refs = [r for r in plan.unavailable_references if "run_" in r.ref]
    return {
        "kind": "original_gate_report",
        "available": False,
        "reason": (
            "the original failed pilot's gate report is part of the prior run's evidence ("
            + ", ".join(r.ref for r in refs)
            + "), which cannot be reached from this machine: "
            + "; ".join(r.reason for r in refs)
        )
        if refs
        else "the original failed pilot's gate report is not reachable from this machine",
        "this_session_gate_report": gate_report_in_bundle,
        "overwritten": False,
        "made_to_pass": False,
        "note": "the diagnostic's criteria are recorded separately (diagnostic-analysis.json) and never "
        "change the original gate's verdict",
    }


def service_work_ledger(sw: ServiceWork | None, executed: Mapping[str, Mapping[str, int]]) -> JsonObject:
    """Declared (plan.service_work) vs executed optimizer updates and sampling batches per item.
    Executed work not declared, or above its declared count, is a problem."""
    if sw is None:
        return {
            "declared": None,
            "executed": {k: dict(v) for k, v in executed.items()},
            "problems": ["the plan declares no service_work"],
            "within_declaration": False,
        }
    declared = {i.id: i for i in sw.items}
    rows: list[JsonValue] = []
    problems: list[str] = []
    totals = dict.fromkeys(SERVICE_WORK, 0)
    for item_id in list(declared) + [k for k in executed if k not in declared]:
        d, done = declared.get(item_id), {k: int(executed.get(item_id, {}).get(k, 0)) for k in SERVICE_WORK}
        if d is None:
            problems.append(f"{item_id}: executed but not declared in the plan")
        over = [(k, getattr(d, k)) for k in SERVICE_WORK if d is not None and done[k] > getattr(d, k)]
        problems += [f"{item_id}: {done[k]} {k} executed > {want} declared" for k, want in over]
        dumped = None if d is None else d.model_dump(mode="json", exclude_none=True)
        rows.append({"id": item_id, "declared": dumped, "executed": dict(done)})
        totals = {k: totals[k] + done[k] for k in totals}
    caps = {k: getattr(sw, f"max_total_{k}") for k in SERVICE_WORK}
    problems += [f"{totals[k]} {k.replace('_', ' ')} > {caps[k]} declared" for k in SERVICE_WORK if totals[k] > caps[k]]
    return {
        "kind": "service_work_ledger",
        "declared_before_execution": bool(sw.declared_before_execution),
        "items": rows,
        "executed_totals": dict(totals),
        "declared_totals": dict(caps),
        "problems": list(problems),
        "within_declaration": not problems,
    }


def diagnostic_feasibility(
    d: BoundedDiagnostic, state: RunState, effective_config: Mapping[str, JsonValue], primary_endpoint: str
) -> JsonObject:
    """result.json's feasibility block from the diagnostic's own measured schedule: setup (restore),
    training (the one sampling batch + every update), no evaluation (forbidden in this launch)."""

    def phase(seconds: float, units: int, planned: int, samples: int) -> JsonObject:
        return {"seconds": float(seconds), "units": units, "planned_units": planned, "samples": samples} | NO_GPU

    updates = state.update_seconds
    per_update = state.sampled_sequences / max(1, d.schedule.minibatches_per_epoch)
    trained = int(state.sampled_sequences + per_update * len(updates))
    training = phase(state.sampling_seconds + sum(updates), len(updates), d.schedule.max_optimizer_updates, trained)
    return {
        "config": config_record(d),
        "effective_config": dict(effective_config),
        "primary_endpoint": primary_endpoint,
        "source": FEASIBILITY_SOURCE,
        "measurements": {
            "setup": phase(state.restore_seconds, 1, 1, 0),
            "training": training,
            "evaluation": phase(0.0, 0, 0, 0),
        },
        "generation": None,
        "recovery": {"seconds": float(FINALIZE_RESERVE_S), **NO_GPU},
    }


def trained_client_entry(
    prior: ArmProvenance,
    *,
    restore: JsonObject,
    initial_output: JsonObject,
    own_check: OptimizerCheck | None,
    new_restore: bool = True,
) -> JsonObject:
    """The trained arm's `initialization_provenance` entry: an optimizer check from the trained
    client's OWN response for its last restore, and that client's initial output before its first
    update. `new_restore`: the diagnostic restored the arm again (one more restore); otherwise it
    trains the preflight's loaded client, whose restore the own check replaces."""
    n = int(prior.get("restore_count", 0)) + (1 if new_restore else 0)
    checks = [own_response_only(c) for c in prior.get("optimizer_checks", [])]
    if own_check is not None:
        checks = [c for c in checks if c.get("after_restore") != n] + [dict(own_check, after_restore=n)]
    init = dict(prior.get("initialization", {}))
    init.update(
        loaded_checkpoint_uri=restore.get("loaded_checkpoint_uri"),
        load_succeeded=bool(restore.get("load_succeeded")),
        evidence_ref=f"{ANALYSIS_FILE}#restore",
        before_first_update=True,
    )
    return {
        "initialization": init,
        "restore_count": n,
        "optimizer_checks": list[JsonValue](checks),
        "initial_output": dict(initial_output),
        "trained_client": {
            "restore": n,
            "note": (
                "the client the bounded diagnostic trained, restored from the shared initial checkpoint"
                + ("" if new_restore else " by the restoration preflight (the same client, no second restore)")
            ),
        },
    }


def register_update_archives(bundle: EvidenceBundle, records: list[ins.LossCallRecord], per_file: int) -> list[str]:
    """The update records as evidence files, `per_file` per file, so the run's file count does not grow
    with its updates (`diagnostic-updates-01-08.npz` holds updates 1 to 8); the names registered. An
    archive whose bytes would pass the per-file limit is split; a single record that does not fit
    one file is refused (LimitError), never truncated."""
    names: list[str] = []
    for start in range(0, len(records), max(1, per_file)):
        pending = records[start : start + max(1, per_file)]
        while pending:
            take = len(pending)
            data = ins.records_to_npz(pending[:take])
            while len(data) > MAX_FILE_BYTES and take > 1:  # split: fewer records per file
                take -= 1
                data = ins.records_to_npz(pending[:take])
            first, last = (int(r.context["update_index"]) for r in (pending[0], pending[take - 1]))
            name = f"diagnostic-updates-{first:02d}-{last:02d}.npz"
            bundle.register_bytes(name, "tensors", data)
            names.append(name)
            pending = pending[take:]
    return names

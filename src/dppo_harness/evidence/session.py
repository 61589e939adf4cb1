"""The pytest session's part of the evidence: what is recorded before any service call, and the
closing of the result when the session ends (called by the harness plugin's fixtures and hooks)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dppo_harness import plans
from dppo_harness.evidence.backend import Backend, backend_deviations
from dppo_harness.evidence.bundle import EvidenceBundle
from dppo_harness.evidence.files import EFFECTIVE_CONFIG_FILE, LATEST_FILE, RESULT_FILE, sha256_bytes
from dppo_harness.evidence.provenance import ARCHIVE_NAME, register_code
from dppo_harness.evidence.result import REHEARSAL_PLAN_PREFIX, REHEARSAL_PREFIX
from dppo_harness.json_types import JsonMap, JsonObject, as_object, objs
from dppo_harness.plans import BackendKind
from dppo_harness.pytest_plugin.stages import STAGE_TEST_FOLDERS
from dppo_harness.service.config import sdk_versions


def effective_config(plan: plans.Plan, backend: Backend) -> JsonObject:
    """The configuration that will actually run (the feasibility record's `effective_config`),
    with every value the spec states only in prose and the sentence the resolution file quotes."""
    base = plans.plan_config(plan)
    # Deferred: the tokenizer pulls in tinker_cookbook and the loss path torch; the bundle stays light.
    from dppo_harness.data import tokenizer
    from dppo_harness.loss import losses as loss_path  # torch (see above)

    # Declared for every plan: the renderer's thinking mode (read off a rendered prompt) and the
    # loss normalization, against the cookbook ppo's sum.
    mode = plan.run.normalization if plan.run else plan.diagnostic.fixed_settings.loss_normalization.mode
    return {
        "plan": base["plan"],
        "backend": {
            "backend": backend.kind,
            "requested_model": backend.requested_model,
            "served_model": backend.served_model,
            "sdk_versions": dict(backend.sdk_versions or {}),
        },
        **{k: base[k] for k in ("pinned", "budget", "generation_audit", "config")},
        "renderer": tokenizer.renderer_declaration(),
        "loss_normalization": as_object(loss_path.normalization_declaration(mode)),
        "deviations": [as_object(d) for d in (*plan.deviations, *backend_deviations(plan, backend))],
    }


def record_plan(bundle: EvidenceBundle, plan: plans.Plan, backend: Backend) -> None:
    """Before any training call: the plan's exact bytes (its resolution file's too), the effective
    config with every deviation it declares, the hypothesis scope and generation_audit applicability."""
    config = effective_config(plan, backend)
    if plan.kind == "rehearsal":
        bundle.mark_rehearsal_plan()
    bundle.register_bytes(plan.name, "plan", plan.data)
    if plan.resolution is not None:
        bundle.register_bytes(plan.resolution.file, "plan", plan.resolution.data)
    bundle.register_json(EFFECTIVE_CONFIG_FILE, "effective_config", config)
    for d in objs(config["deviations"]):
        bundle.add_deviation(str(d["field"]), d["original"], d["effective"], str(d["reason"]))
    fields: dict[str, Any] = {"generation_audit": config["generation_audit"]}
    if plan.kind == "bounded_diagnostic":
        fields["original_hypothesis_tested"] = plan.diagnostic.original_hypothesis_tested
        fields["tested_instead"] = plan.diagnostic.tested_instead
    elif (current := bundle.result)["original_hypothesis_tested"] is None and not current["deviations"]:
        fields["original_hypothesis_tested"] = True
    bundle.update_result(**fields)


def start_session(
    bundle: EvidenceBundle,
    *,
    backend: BackendKind,
    plan: plans.Plan,
    stages: Sequence[str],
    project_root: Path,
    test_files: Sequence[str | Path] = (),
    served_model: str | None = None,
) -> None:
    """Everything that must be in evidence before any service call of the session."""
    root = Path(project_root)
    bundle.reserve_closing()  # before any other file: the close can never be starved (evidence.budget)
    versions = sdk_versions()
    bundle.set_backend(
        Backend(
            kind=backend,
            requested_model=plan.planned_model,
            served_model=served_model or "reported at client creation (see initialization_provenance)",
            sdk_versions=versions,
        )
    )
    register_code(bundle, root)
    _register_test_manifest(bundle, root, test_files)
    # The served model, when not known yet, is named for where it will be reported.
    served = served_model or (
        "the embedded server's model (named at client creation)" if backend == "local" else plan.base_model
    )
    record_plan(
        bundle,
        plan,
        Backend(kind=backend, requested_model=plan.planned_model, served_model=served, sdk_versions=versions),
    )
    if plan.kind == "bounded_diagnostic":
        # The revised spec, with the effective config and deviations above, before ANY optimizer
        # update of the session (the preflight's probes included), so the evidence shows what was planned before it ran.
        # instrument.instrumentation loads numpy and torch; the bundle, imported by every stage, stays light
        from dppo_harness.instrument.instrumentation import REVISED_SPEC_FILE

        bundle.register_bytes(REVISED_SPEC_FILE, "plan", plan.data)
    # The ledger's budget is the executed plan's own, counted from the session start (the ledger's
    # clock starts with the bundle): a bounded diagnostic's 12-minute cap includes setup and every
    # stage before it, inside the original experiment's GPU-hour cap.
    source = f"{plan.name} " + ("caps" if plan.kind == "bounded_diagnostic" else "budget")
    bundle.note_ledger(stages_selected=list(stages), budget_source=source)
    bundle.set_budget(plan.budget["max_wall_minutes"] * 60.0, plan.budget["gpu_hours"])


def _register_test_manifest(bundle: EvidenceBundle, root: Path, test_files: Sequence[str | Path]) -> None:
    """The executed test files' bytes are in the code archive; one manifest says which ran (stage
    test files and the root conftest flagged) with their hashes, so the 64-file limit is spent on
    measurements, not copies."""
    root = root.resolve()
    files = sorted({Path(p).resolve() for p in test_files})
    folders = {("tests", d) for d in STAGE_TEST_FOLDERS}
    conftest = root / "conftest.py"
    stage = [f for f in files if root in f.parents and f.relative_to(root).parts[:2] in folders]
    stage += [conftest.resolve()] if conftest.is_file() else []
    executed = stage + [f for f in files if f not in stage]
    if not executed:
        return
    listed = [
        {
            "path": str(f.relative_to(root)) if root in f.parents else str(f),
            "stage_test": f in stage,
            "sha256": sha256_bytes(f.read_bytes()),
            "size": f.stat().st_size,
        }
        for f in executed
        if f.is_file()
    ]
    bundle.register_json("test-files.json", "manifest", {"archive": ARCHIVE_NAME, "files": listed})


def closing_fields(
    result: JsonMap, stages_selected: Sequence[str], failures: Mapping[str, str]
) -> dict[str, Any] | None:
    """The final fields no stage has set (status, verdict, reason, scope, summary); None if the
    result is already final."""
    if result["status"] != "running":
        return None
    fields: dict[str, Any] = {
        "status": "failed" if failures else "succeeded",
        "verdict": result.get("verdict", "inconclusive"),
    }
    if result["original_hypothesis_tested"] is None:
        fields["original_hypothesis_tested"] = False
        fields["tested_instead"] = (
            "harness stages only (" + ", ".join(stages_selected) + "); the accuracy comparison did not run"
        )
    if "outcome_reason" not in result and fields["verdict"] == "inconclusive":
        fields["outcome_reason"] = "incomplete_execution"
    body = str(result["summary"]).removeprefix(REHEARSAL_PREFIX).removeprefix(REHEARSAL_PLAN_PREFIX).strip()
    if not body:  # no stage said what ran
        ran = ", ".join(stages_selected) or "no stage"
        if failures:
            tail = "Failed: " + "; ".join(f"{s} ({n})" for s, n in failures.items()) + "."
        else:
            tail = "All selected stages passed; the accuracy hypothesis was not tested."
        fields["summary"] = f"Stages run: {ran}. {tail}"
    return fields


def unclosed_line(bundle: EvidenceBundle) -> str | None:
    """None when the bundle's result.json on disk is closed. Otherwise (an evidence write refused at
    the close) LATEST stops naming the run, an unlink needing no free space, so no reader takes the
    half bundle for the run's record; the line says where it is and what verify will say."""
    try:
        status = json.loads((bundle.dir / RESULT_FILE).read_text())["status"]
    except (OSError, ValueError, KeyError, TypeError):
        status = None
    if status not in (None, "running"):
        return None
    latest = bundle.dir.parent / LATEST_FILE
    what = f"evidence: {bundle.dir} was left incomplete (its result.json is not closed; verify says INCOMPLETE)"
    try:
        if latest.read_text().strip() == bundle.run_id:
            latest.unlink()
            return what + "; LATEST no longer names it"
    except OSError:
        pass
    return what


def finish_session(bundle: EvidenceBundle, stage_failures: Mapping[str, str] | None = None) -> None:
    """Close the session's result: fills only what no stage has set (status, verdict, reason)."""
    failures = dict(stage_failures or {})
    bundle.note_ledger(stage_failures=failures)
    fields = closing_fields(bundle.result, bundle.ledger().get("stages_selected", []), failures)
    if fields is not None:
        bundle.finish(**fields)

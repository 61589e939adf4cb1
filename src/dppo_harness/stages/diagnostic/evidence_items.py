"""Evidence items of the bounded diagnostic that a reviewer checks exist (the requester asked for
them by name): the original gate report's status, the service-work ledger against the plan's
declaration, the feasibility block from the diagnostic's OWN measured setup (no extra pilot), the
replay output, and the trained client's provenance entry.

Pure builders; `evidence_writer` registers what they return.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import JsonValue

from dppo_harness.instrument import replay
from dppo_harness.json_types import JsonObject
from dppo_harness.stages.diagnostic.files import FEASIBILITY_SOURCE
from dppo_harness.train.optimizer_checks import OptimizerCheck, own_response_only

if TYPE_CHECKING:
    from dppo_harness.plans.models import BoundedDiagnostic, ServiceWork
    from dppo_harness.stages.restoration.records import ArmProvenance


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
    totals = {"optimizer_updates": 0, "sampling_batches": 0}
    for item_id in list(declared) + [k for k in executed if k not in declared]:
        d, e = declared.get(item_id), dict(executed.get(item_id, {}))
        done = {
            "optimizer_updates": int(e.get("optimizer_updates", 0)),
            "sampling_batches": int(e.get("sampling_batches", 0)),
        }
        if d is None:
            problems.append(f"{item_id}: executed but not declared in the plan")
        else:
            for k, want in (("optimizer_updates", d.optimizer_updates), ("sampling_batches", d.sampling_batches)):
                if done[k] > want:
                    problems.append(f"{item_id}: {done[k]} {k} executed > {want} declared")
        rows.append(
            {
                "id": item_id,
                "declared": None if d is None else d.model_dump(mode="json", exclude_none=True),
                "executed": dict(done),
            }
        )
        totals = {k: totals[k] + done[k] for k in totals}
    if totals["optimizer_updates"] > sw.max_total_optimizer_updates:
        problems.append(f"{totals['optimizer_updates']} optimizer updates > {sw.max_total_optimizer_updates} declared")
    if totals["sampling_batches"] > sw.max_total_sampling_batches:
        problems.append(f"{totals['sampling_batches']} sampling batches > {sw.max_total_sampling_batches} declared")
    return {
        "kind": "service_work_ledger",
        "declared_before_execution": bool(sw.declared_before_execution),
        "items": rows,
        "executed_totals": dict(totals),
        "declared_totals": {
            "optimizer_updates": sw.max_total_optimizer_updates,
            "sampling_batches": sw.max_total_sampling_batches,
        },
        "problems": list(problems),
        "within_declaration": not problems,
    }


def diagnostic_feasibility(
    *,
    config: Mapping[str, JsonValue],
    effective_config: Mapping[str, JsonValue],
    primary_endpoint: str,
    setup_seconds: float,
    sampling_seconds: float,
    sampled_sequences: int,
    update_seconds: Sequence[float],
    sequences_per_update: float,
    planned_updates: int,
    recovery_seconds: float,
) -> JsonObject:
    """result.json's feasibility block from the diagnostic's own measured schedule: setup (restore),
    training (the one sampling batch + every update), no evaluation (forbidden in this launch)."""
    train_s = float(sampling_seconds + sum(update_seconds))
    return {
        "config": dict(config),
        "effective_config": dict(effective_config),
        "primary_endpoint": primary_endpoint,
        "source": FEASIBILITY_SOURCE,
        "measurements": {
            "setup": {
                "seconds": float(setup_seconds),
                "units": 1,
                "planned_units": 1,
                "samples": 0,
                "gpu_count": None,
                "allocation_source": None,
            },
            "training": {
                "seconds": train_s,
                "units": len(update_seconds),
                "planned_units": int(planned_updates),
                "samples": int(sampled_sequences + sequences_per_update * len(update_seconds)),
                "gpu_count": None,
                "allocation_source": None,
            },
            "evaluation": {
                "seconds": 0.0,
                "units": 0,
                "planned_units": 0,
                "samples": 0,
                "gpu_count": None,
                "allocation_source": None,
            },
        },
        "generation": None,
        "recovery": {"seconds": float(recovery_seconds), "gpu_count": None, "allocation_source": None},
    }


def replay_output(bundle_dir: Path) -> tuple[int, str]:
    """(exit code, printed lines) of `python -m dppo_harness.instrument.replay` on the bundle, run in-process."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = replay.main([str(bundle_dir)])
    return code, buf.getvalue()


def trained_client_entry(
    prior: ArmProvenance,
    *,
    restore: JsonObject,
    initial_output: JsonObject,
    own_check: OptimizerCheck | None,
    restore_ref: str,
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
        evidence_ref=restore_ref,
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

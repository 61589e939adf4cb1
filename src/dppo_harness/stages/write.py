"""The stages' writers: the one place their file names and result.json keys live. A stage returns its
typed result and names no file (its evidence refs cite these names); its fixture calls its writer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dppo_harness.evidence.backend import backend_of
from dppo_harness.json_types import JsonValue, as_object
from dppo_harness.train.clients import datum_arrays
from dppo_harness.train.optimizer_checks import own_response_only

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.service.connectivity import ConnectivityReport
    from dppo_harness.stages.feasibility import FeasibilityResult
    from dppo_harness.stages.gate import GateReport
    from dppo_harness.stages.restoration import InitializationProvenance, RestorationResult

RESPONSES_FILE = "restoration-server-responses.json"
PROBE_FILE = "restoration-probe.json"
PROVENANCE_FILE = "initialization-provenance.json"
LR_SCALING_FILE = "lr-scaling-probe.json"
INITIAL_OUTPUT_FILE = "restoration-initial-logprobs.json"
FIXED_BATCH_FILE = "restoration-fixed-batch.json"
PILOT_FILE = "feasibility-pilot.json"
GATE_REPORT_FILE = "activation-gate-report.json"
CONNECTIVITY_FILE = "connectivity-preflight.json"


def write_connectivity(bundle: EvidenceBundle, report: ConnectivityReport, option_backend: str) -> None:
    """Before any training client: the connectivity report, a model choice, and on the embedded
    server (its marker) the backend block of kind `local`, whatever `--backend` said, which labels
    every summary a rehearsal and says which server and profile ran."""
    bundle.register_json(CONNECTIVITY_FILE, "manifest", report.as_evidence())
    if report.substitution:
        bundle.add_deviation(**report.substitution)
    marker, block = report.marker, backend_of(bundle.result)
    if marker is None or block is None:
        return
    # The session's block keeps the model the experiment is about and the SDK versions.
    update = dict(kind="local", served_model=marker.stand_in or block.served_model, base_url=report.base_url)
    kind_reason = "the service carries the embedded-server marker: a rehearsal on a stand-in model"
    update.update(requested_backend=option_backend, answers_to=report.model, kind_reason=kind_reason)
    bundle.set_backend(block.model_copy(update={**update, "embedded_server": marker}))


def write_restoration(bundle: EvidenceBundle, r: RestorationResult) -> None:
    """The preflight's six files and the result's `initialization_provenance` (a diagnostic's, which
    excludes arms, keeps only what each arm's OWN responses exposed) and its metrics."""
    rows: list[JsonValue] = []
    for d in r.fixed_batch:
        tokens_T, targets_T, mask_T = datum_arrays(d)
        rows.append({"input_tokens": tokens_T.tolist(), "target_tokens": targets_T.tolist(), "mask": mask_T.tolist()})
    batch = {
        "batch_sha256": r.batch_sha256,
        "hash": "sha256 over each datum's int64 input ids, int64 target ids and float32 mask (weights), "
        "length-prefixed; see restoration.batch_sha256",
        "description": r.batch_description,
        "datums": rows,
    }
    bundle.register_json(FIXED_BATCH_FILE, "tensors", batch)
    stored = r.initial_logprobs
    outputs = {
        "batch_sha256": r.batch_sha256,
        "dtype": {a: str(lp[0].dtype) for a, lp in stored.items()},
        "output_sha256": r.output_sha256,
        "comparison": r.provenance["group"]["initial_output_comparison"],
        "hash": "sha256 over every datum's per-token logprobs at the returned precision; see "
        "restoration.logprobs_sha256",
        "logprobs": {a: [x.tolist() for x in lp] for a, lp in stored.items()},
    }
    bundle.register_json(INITIAL_OUTPUT_FILE, "tensors", outputs)
    bundle.register_json(RESPONSES_FILE, "log", r.responses)
    bundle.register_json(PROBE_FILE, "metrics", r.probe.to_json())
    bundle.register_json(LR_SCALING_FILE, "metrics", r.lr_scaling.to_json())
    bundle.register_json(PROVENANCE_FILE, "manifest", r.provenance)
    posted: InitializationProvenance = {"version": 1, "arms": r.provenance["arms"]}
    if "excluded_arms" in r.provenance:  # a diagnostic: it trains its treatment arm only
        own = {a: [as_object(own_response_only(c)) for c in e["optimizer_checks"]] for a, e in posted["arms"].items()}
        posted["arms"] = {a: {**e, "optimizer_checks": own[a]} for a, e in posted["arms"].items()}
        posted["excluded_arms"] = r.provenance["excluded_arms"]
    metrics = {"preflight/restoration_wall_seconds": r.wall_seconds, "preflight/restoration_passed": float(r.passed)}
    bundle.update_result(initialization_provenance=posted, metrics=metrics)


def write_feasibility(bundle: EvidenceBundle, r: FeasibilityResult) -> None:
    """The pilot file, the result's `feasibility` block and its metrics."""
    bundle.register_json(PILOT_FILE, "metrics", r.pilot)
    proj = r.projection
    metrics = {
        "feasibility/pilot_wall_seconds": r.wall_seconds,
        "feasibility/projected_wall_seconds": proj.total_seconds,
        "feasibility/remaining_wall_budget_seconds": proj.budget_seconds,
        "feasibility/fits": 1.0 if proj.fits else 0.0,
    }
    if proj.gpu_hours is not None:
        metrics["feasibility/projected_gpu_hours"] = proj.gpu_hours
    bundle.update_result(feasibility=r.block, metrics=metrics)


def write_gate(bundle: EvidenceBundle, report: GateReport) -> None:
    """Each pilot step's loss records (journaled as the pilot ran), the report, `activation_calibration`."""
    for step, npz in report.step_records.items():
        bundle.register_bytes(f"gate-pilot-step{step}.npz", "tensors", npz)
    bundle.register_json(GATE_REPORT_FILE, "report", report.to_json())
    bundle.update_result(activation_calibration=report.calibration())

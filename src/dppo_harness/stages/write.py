"""The stages' writers: the one place their file names and result.json keys live. A stage returns its
typed result and names no file (its evidence refs cite these names); its fixture calls its writer.
Light to import (the plugin's fixtures do at start-up): the SDK loads with the stages."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dppo_harness.evidence.backend import backend_of
from dppo_harness.evidence.files import EvidenceError
from dppo_harness.json_types import JsonObject, JsonValue, as_object
from dppo_harness.train.optimizer_checks import own_response_only

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.service.connectivity import ConnectivityReport
    from dppo_harness.service.wait.policy import CapacityBlock
    from dppo_harness.stages import feasibility, gate, restoration
    from dppo_harness.stages.comparison.run import ComparisonResult
    from dppo_harness.stages.correctness_preflight import CorrectnessPreflight

RESPONSES_FILE = "restoration-server-responses.json"
PROBE_FILE = "restoration-probe.json"
PROVENANCE_FILE = "initialization-provenance.json"
LR_SCALING_FILE = "lr-scaling-probe.json"
INITIAL_OUTPUT_FILE = "restoration-initial-logprobs.json"
FIXED_BATCH_FILE = "restoration-fixed-batch.json"
PILOT_FILE = "feasibility-pilot.json"
GATE_REPORT_FILE = "activation-gate-report.json"
CONNECTIVITY_FILE = "connectivity-preflight.json"
STEPS_FILE = "comparison-steps.jsonl"  # a resumed session's: comparison-steps-<N>.jsonl
OBSERVATIONS_FILE = "scored-observations.jsonl"
DECISION_FILE = "comparison-decision.json"
NOTHING_TRAINED = "nothing: the run stopped on service capacity before any training"


def write_connectivity(bundle: EvidenceBundle, report: ConnectivityReport, option_backend: str) -> None:
    """Before any training client: the report, a model choice, and on the embedded server (its marker) the
    backend block of kind `local` whatever `--backend` said: every summary a rehearsal's, naming the server."""
    head = ("backend", "base_url", "requested_model", "model", "served_models", "substitution")
    evidence: JsonObject = {
        **{k: getattr(report, k) for k in head},
        "embedded_server": report.marker.model_dump() if report.marker else None,
        "get_server_capabilities": report.capabilities,
        "first_contact": report.first_contact,
        "checks": list(report.checks),
        "seconds": round(report.seconds, 3),
    }
    bundle.register_json(CONNECTIVITY_FILE, "manifest", evidence)
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


def write_capacity_stop(bundle: EvidenceBundle, block: CapacityBlock) -> None:
    """A capacity stop before any arm trained: the result fails inconclusive with the capacity
    block and, unless a stage already said which hypothesis it tested, says nothing was tested."""
    fields = block.result_fields()
    if bundle.result["original_hypothesis_tested"] is None:
        fields.update(original_hypothesis_tested=False, tested_instead=NOTHING_TRAINED)
    bundle.update_result(**fields)


def write_restoration(bundle: EvidenceBundle, r: restoration.RestorationResult) -> None:
    """The preflight's six files and the result's `initialization_provenance` (a diagnostic's, which
    excludes arms, keeps only what each arm's OWN responses exposed) and its metrics."""
    from dppo_harness.train.clients import datum_arrays  # the SDK: loaded by the stage already

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
    outputs = {
        "batch_sha256": r.batch_sha256,
        "dtype": {a: str(lp[0].dtype) for a, lp in r.initial_logprobs.items()},
        "output_sha256": r.output_sha256,
        "comparison": r.provenance["group"]["initial_output_comparison"],
        "hash": "sha256 over every datum's per-token logprobs at the returned precision; see "
        "restoration.logprobs_sha256",
        "logprobs": {a: [x.tolist() for x in lp] for a, lp in r.initial_logprobs.items()},
    }
    bundle.register_json(INITIAL_OUTPUT_FILE, "tensors", outputs)
    bundle.register_json(RESPONSES_FILE, "log", r.responses)
    bundle.register_json(PROBE_FILE, "metrics", r.probe.to_json())
    bundle.register_json(LR_SCALING_FILE, "metrics", r.lr_scaling.to_json())
    bundle.register_json(PROVENANCE_FILE, "manifest", r.provenance)
    posted: restoration.InitializationProvenance = {"version": 1, "arms": r.provenance["arms"]}
    if "excluded_arms" in r.provenance:  # a diagnostic: it trains its treatment arm only
        own = {a: [as_object(own_response_only(c)) for c in e["optimizer_checks"]] for a, e in posted["arms"].items()}
        posted["arms"] = {a: {**e, "optimizer_checks": own[a]} for a, e in posted["arms"].items()}
        posted["excluded_arms"] = r.provenance["excluded_arms"]
    metrics = {"preflight/restoration_wall_seconds": r.wall_seconds, "preflight/restoration_passed": float(r.passed)}
    bundle.update_result(initialization_provenance=posted, metrics=metrics)


def write_correctness(bundle: EvidenceBundle, outcome: CorrectnessPreflight) -> None:
    """The golden file checked, its report, the validator's verdict with the block, the block itself."""
    bundle.register_bytes(outcome.golden.name, "tensors", outcome.golden.read_bytes())
    bundle.register_json("correctness-golden-report.json", "metrics", outcome.golden_report_json())
    bundle.register_json("correctness-preflight.json", "metrics", outcome.preflight_json())
    bundle.update_result(correctness_preflight=outcome.block)


def write_correctness_validator(bundle: EvidenceBundle, out: JsonObject, exit_code: int) -> None:
    """The brief's validator on the written block: its output and exit code."""
    bundle.register_json("correctness-validator.json", "report", out)
    bundle.update_result(metrics={"correctness/validator_exit_code": float(exit_code)})


def write_feasibility(bundle: EvidenceBundle, r: feasibility.FeasibilityResult) -> None:
    """The pilot file, the result's `feasibility` block and its metrics."""
    bundle.register_json(PILOT_FILE, "metrics", r.pilot)
    p = r.projection
    metrics = {"feasibility/pilot_wall_seconds": r.wall_seconds, "feasibility/projected_wall_seconds": p.total_seconds}
    metrics.update({"feasibility/remaining_wall_budget_seconds": p.budget_seconds, "feasibility/fits": float(p.fits)})
    if p.gpu_hours is not None:
        metrics["feasibility/projected_gpu_hours"] = p.gpu_hours
    bundle.update_result(feasibility=r.block, metrics=metrics)


def write_gate(bundle: EvidenceBundle, report: gate.GateReport) -> None:
    """Each pilot step's loss records (as the pilot journaled them), the report, `activation_calibration`."""
    for e in bundle.journal.entries("record", "gate"):
        if e.blob is None:
            raise EvidenceError(f"{e.ref}: a gate pilot step's entry holds no loss records")
        bundle.register_bytes(f"gate-pilot-step{e.data}.npz", "tensors", e.blob)
    bundle.register_json(GATE_REPORT_FILE, "report", report.to_json())
    p = report.pilot
    note = (
        f"{p['steps_completed']}/{p['steps']}-step pilot of {p['arm']} ({p['loss']}, "
        f"{p['normalization']}), fresh sampling each step from the current weights, "
        f"{p['groups_per_batch']} groups x {p['group_size']} at T={p['temperature']}, max_tokens {p['max_tokens']}, "
        f"{p['updates_per_batch']} complete-group minibatch updates per batch, AdamW lr {p['adam']['learning_rate']:g}; "
        f"backend {p['backend']}; gate {'passed' if report.passed else 'FAILED'}"
    )
    values = {k: (v if v is not None else "missing") for k, v in report.values.items()}
    bundle.update_result(activation_calibration={"values": values, "note": note})


def write_comparison(bundle: EvidenceBundle, r: ComparisonResult) -> None:
    """The training's files, stopped or not (the run's manifest, its rows, its state after training),
    a stopped run's `final`; then what was evaluated: the evaluator, each scored model's predictions,
    the `evaluation` block and accuracies; once decided, the observations, the decision and report.md."""
    from dppo_harness.evaluation import greedy  # the SDK: loaded by the stage already
    from dppo_harness.evidence import report  # matplotlib: for the comparison only
    from dppo_harness.stages.comparison.step_rows import jsonl  # torch: loaded by the stage already

    n = r.manifest["resumed_sessions"]
    bundle.register_json(f"comparison-run-{n}.json", "manifest", r.manifest)
    bundle.register_bytes(f"comparison-steps-{n}.jsonl" if n else STEPS_FILE, "metrics", jsonl(r.rows))
    bundle.register_json(f"comparison-state-r{n}-end.json", "manifest", r.end_state)
    if r.stopped is not None:  # stopped with evidence (capacity, wall clock...): the result says why now
        bundle.update_result(**r.final)
    if (e := r.evaluator) is None:
        return
    evaluator = {"evaluator_id": e.evaluator_id, "provenance": e.provenance, "code_manifest": e.code_manifest}
    bundle.register_json(f"evaluator-{e.evaluator_id[:16]}.json", "manifest", {**evaluator, "deviation": e.deviation})
    scores: list[JsonObject] = []
    for res in r.evaluated:
        name = f"predictions-{res.arm}-seed{res.seed}-{res.evaluator_id[:8]}.jsonl"
        bundle.register_bytes(name, "predictions", res.predictions_jsonl())
        scores.append(res.score(name))
    if scores:
        accuracy = {f"eval/accuracy/{res.arm}": res.accuracy for res in r.evaluated}
        comparisons: list[JsonObject] = [{"metric": c.metric, "arms": [c.baseline, c.treatment]} for c in r.criteria]
        bundle.update_result(evaluation=greedy.evaluation_object(e, scores, comparisons), metrics=accuracy)
    if r.decision is None:
        return
    # the arms' observations (the base model is scored first), the bytes the decision hashed
    bundle.register_bytes(OBSERVATIONS_FILE, "metrics", greedy.observations_jsonl(r.evaluated[1:]))
    bundle.register_json(DECISION_FILE, "metrics", r.decision)
    bundle.update_result(decision=r.decision, metrics=r.decision_metrics)
    resume = (bundle.result.get("initialization_provenance") or {}).get("resume") if n else None
    rows = [as_object(x) for x in r.rows]
    report.write_comparison_report(bundle, rows, scores, r.decision, r.backend, max_tokens=e.max_tokens, resume=resume)

"""The restoration preflight's outcome as evidence: the group's initialization provenance, the
copy the result posts, and the evidence files.

The contract: `group_provenance` is initialization-provenance.json (every arm's entry, the arms
left out, the group's proof, passed and failures); `posted_provenance` is the result's
`initialization_provenance`; `record_evidence` registers the preflight's evidence files and result
fields in one place, so every run writes the same set.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.stages.restoration.checkpoint import RESPONSES_FILE, Recorder
from dppo_harness.stages.restoration.lr_probe import LR_SCALING_FILE
from dppo_harness.stages.restoration.provenance import ArmProvenance, InitializationProvenance
from dppo_harness.stages.restoration.records import LrScalingBlock, RestoreProbeResult
from dppo_harness.train.optimizer_checks import own_response_only

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle

PROVENANCE_FILE = "initialization-provenance.json"
PROBE_FILE = "restoration-probe.json"


def group_provenance(
    arms: dict[str, ArmProvenance],
    excluded: Mapping[str, str],
    *,
    trained: Sequence[str],
    initial_checkpoint: str,
    initial_output_comparison: JsonObject,
    adapter_sha256_method: str,
    failures: Sequence[str],
) -> InitializationProvenance:
    """initialization-provenance.json: the arms' entries, the arms left out (if any), where the
    group's proof lives, and the verdict."""
    provenance: InitializationProvenance = {"version": 1, "arms": arms}
    if excluded:
        provenance["excluded_arms"] = dict(excluded)
    provenance["group"] = {
        "arms": list(trained),
        "initial_checkpoint": initial_checkpoint,
        "initial_output_comparison": initial_output_comparison,
        "adapter_sha256_method": adapter_sha256_method,
        "restore_probe": PROBE_FILE,
        "server_responses": RESPONSES_FILE,
    }
    provenance["passed"], provenance["failures"] = not failures, list(failures)
    return provenance


def posted_provenance(
    arms: dict[str, ArmProvenance], excluded: Mapping[str, str], trained_arms: Sequence[str] | None
) -> InitializationProvenance:
    """The result's initialization_provenance: with `trained_arms`, each posted check keeps only
    what the arm's OWN responses exposed."""
    if trained_arms is None:
        return {"version": 1, "arms": arms}
    return {
        "version": 1,
        "arms": {
            a: ArmProvenance(
                initialization=e["initialization"],
                restore_count=e["restore_count"],
                optimizer_checks=[as_object(own_response_only(c)) for c in e["optimizer_checks"]],
                initial_output=e["initial_output"],
            )
            for a, e in arms.items()
        },
        "excluded_arms": dict(excluded),
    }


def record_evidence(
    bundle: EvidenceBundle,
    rec: Recorder,
    probe: RestoreProbeResult,
    lr_block: LrScalingBlock,
    provenance: InitializationProvenance,
    posted: InitializationProvenance,
    t0: float,
) -> float:
    """The preflight's evidence files and result fields; returns the preflight's wall seconds."""
    bundle.register_json(RESPONSES_FILE, "log", rec.responses)
    bundle.register_json(PROBE_FILE, "metrics", probe.to_json())
    bundle.register_json(LR_SCALING_FILE, "metrics", lr_block.to_json())
    bundle.register_json(PROVENANCE_FILE, "manifest", provenance)
    wall = time.monotonic() - t0
    bundle.update_result(
        initialization_provenance=posted,
        metrics={
            "preflight/restoration_wall_seconds": wall,
            "preflight/restoration_passed": 1.0 if provenance["passed"] else 0.0,
        },
    )
    return wall

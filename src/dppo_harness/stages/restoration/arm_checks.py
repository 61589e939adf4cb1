"""The checks on the loaded arms: adapters as loaded, initial outputs before any update, and each
arm's initialization entry with its optimizer checks.

The contract: every check records what it measured and the failures it found, so the preflight can
fail on any of them; `initial_outputs` also registers the logprobs and their comparison as
evidence (`INITIAL_OUTPUT_FILE`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import tinker

from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.stages.restoration.checkpoint import RESPONSES_FILE, InitialCheckpoint, Recorder, load_ref
from dppo_harness.stages.restoration.provenance import ArmProvenance, initialization_entry
from dppo_harness.stages.restoration.records import RestoreProbeResult
from dppo_harness.train.clients import full_logprobs
from dppo_harness.train.fingerprints import compare_logprobs, logprobs_sha256
from dppo_harness.train.optimizer_checks import optimizer_check
from dppo_harness.train.restore import Restore

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans.models import RestorationArm
    from dppo_harness.stages.restoration.update_norm import LocalCheckpointReader

INITIAL_OUTPUT_FILE = "restoration-initial-logprobs.json"
SOURCE_OUTPUT_KEY = "initial_checkpoint_source"
ADAPTERS_UNMEASURED = "not measurable over the Tinker API on this backend"
ADAPTERS_MEASURED = (
    "local_hash: sha256 of the LoRA tensors in a save_state of each arm taken right "
    "after its load, read from the embedded server's run_dir"
)


@dataclass(frozen=True)
class AdapterHashes:
    """Each arm's adapter sha256 as loaded (None where unmeasurable), how it was measured, and
    every arm whose adapter differs from its checkpoint's."""

    by_arm: dict[str, str | None]
    method: str
    failures: list[str]


@dataclass(frozen=True)
class InitialOutputs:
    """Each arm's output sha256 on the fixed batch before any update, the pairwise comparisons
    (by `first_vs_other`), and every pair outside the tolerance."""

    output_sha256: dict[str, str]
    comparison: JsonObject
    failures: list[str]


def adapter_hashes(
    reader: LocalCheckpointReader | None,
    arms: Mapping[str, Restore],
    source_of: Mapping[str, str],
    tag: str,
    rec: Recorder,
) -> AdapterHashes:
    """Adapter hashes as loaded (local backend: read back from a save of each arm; not an update)."""
    hashes: dict[str, str | None] = dict.fromkeys(arms)
    if reader is None:
        return AdapterHashes(hashes, ADAPTERS_UNMEASURED, [])
    failures = []
    for a, arm in arms.items():
        snap = arm.client.save_state(f"{tag}-{a}-as-loaded").result()
        rec.keep(f"save_{a}_as_loaded", snap)
        hashes[a] = as_loaded = reader.adapter_sha256(snap.path)
        src_sha = reader.adapter_sha256(source_of[a])
        if as_loaded != src_sha:
            failures.append(f"{a}: adapter as loaded ({as_loaded[:12]}) differs from its checkpoint's ({src_sha[:12]})")
    return AdapterHashes(hashes, ADAPTERS_MEASURED, failures)


def initial_outputs(
    bundle: EvidenceBundle,
    arms: Mapping[str, Restore],
    fixed_batch: Sequence[tinker.Datum],
    b_sha: str,
    atol: float,
    source: Sequence[np.ndarray] | None = None,
) -> InitialOutputs:
    """Step 3: full logprobs of every arm on the fixed batch before any update, compared. With a
    single arm, `source` (the setup client's logprobs, taken before its first update) is what it
    is compared with, so the check can still fail."""
    names = list(arms)
    logprobs = {a: full_logprobs(arms[a].client, fixed_batch) for a in names}
    out_sha = {a: logprobs_sha256(lp) for a, lp in logprobs.items()}
    pairs: list[tuple[str, str, Sequence[np.ndarray]]] = [(names[0], other, logprobs[other]) for other in names[1:]]
    if len(names) == 1 and source is not None:
        pairs = [(names[0], SOURCE_OUTPUT_KEY, source)]
    cmp: JsonObject = {}
    failures: list[str] = []
    for first, other, lp in pairs:
        c = compare_logprobs(logprobs[first], lp, atol)
        cmp[f"{first}_vs_{other}"] = as_object(c)
        if not c["within_tolerance"]:
            failures.append(
                f"initial logprobs differ between {first} and {other}: max |diff| "
                f"{c['max_abs_diff']} > {atol}" + (f" ({c['problem']})" if "problem" in c else "")
            )
    stored = dict(logprobs)
    if len(names) == 1 and source is not None:
        stored[SOURCE_OUTPUT_KEY] = list(source)
    bundle.register_json(
        INITIAL_OUTPUT_FILE,
        "tensors",
        {
            "batch_sha256": b_sha,
            "dtype": {a: str(lp[0].dtype) for a, lp in stored.items()},
            "output_sha256": out_sha,
            "comparison": cmp,
            "hash": "sha256 over every datum's per-token logprobs at the returned precision; see "
            "restoration.logprobs_sha256",
            "logprobs": {a: [x.tolist() for x in lp] for a, lp in stored.items()},
        },
    )
    return InitialOutputs(out_sha, cmp, failures)


def provenance_entries(
    arms_cfg: Sequence[RestorationArm],
    base_model: str,
    sources: Mapping[str, InitialCheckpoint],
    source_label: Mapping[str, str],
    loaded: Mapping[str, Restore],
    probes: Mapping[str, RestoreProbeResult],
    b_sha: str,
    out_sha: Mapping[str, str],
    adapter_sha: Mapping[str, str | None],
) -> dict[str, ArmProvenance]:
    """Step 5: each arm's initialization entry with optimizer checks at creation (0) and restore (1),
    against the echo of the probe that ran the arm's own optimizer config."""
    entries: dict[str, ArmProvenance] = {}
    for arm in arms_cfg:
        a = arm.name
        if a not in loaded:
            continue
        probe = probes[a]
        echo = probe.echoed_config or None
        check = partial(
            optimizer_check,
            requested_optimizer=arm.optimizer,
            requested_config=arm.optimizer_config.model_dump(exclude_none=True),
            echoed=echo,
            echo_ref=probe.echo_ref,
            echo_observed_on=probe.echo_observed_on,
        )
        checks = [
            check(
                after_restore=0, info=sources[a].info, info_ref=f"{RESPONSES_FILE}#create_{source_label[a]}.get_info"
            ),
            check(after_restore=1, info=loaded[a].info, info_ref=f"{RESPONSES_FILE}#load_{a}.get_info"),
        ]
        entries[a] = initialization_entry(
            base_checkpoint=base_model,
            checkpoint_uri=sources[a].path,
            checkpoint_immutable=sources[a].immutable,
            checkpoint_immutable_reason=sources[a].immutable_reason or None,
            loaded_checkpoint_uri=loaded[a].loaded_path,
            load_succeeded=True,  # the service answered the load (what it loaded is checked by its path)
            evidence_ref=load_ref(a),
            restore_count=1,
            optimizer_checks=checks,
            initial_output={
                "available": True,
                "batch_sha256": b_sha,
                "output_sha256": out_sha[a],
                "evidence_ref": INITIAL_OUTPUT_FILE,
                "before_first_update": True,
            },
            adapter_sha256=adapter_sha[a],
        )
    return entries

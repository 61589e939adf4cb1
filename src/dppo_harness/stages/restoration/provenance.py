"""Initialization provenance: each arm's entry in the version-1 shape of result.json's
`initialization_provenance`, and its proof.

The contract: `initialization_entry` builds one arm's `initialization_provenance` entry (the
checkpoint it was created from, what the server's load response says was loaded, the optimizer
checks, the initial output); `check_provenance` lists every failure of the group's proof (loads,
immutability, loaded URIs, optimizer-check coverage and mismatches, one shared checkpoint, adapter
and fixed batch). An empty list means the group is proved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NotRequired, TypedDict

from dppo_harness.json_types import JsonObject, as_object, items, num


class ArmProvenance(TypedDict):
    """One arm's `initialization_provenance` entry (version 1)."""

    initialization: JsonObject
    restore_count: int
    optimizer_checks: list[JsonObject]  # train.optimizer_checks.OptimizerCheck entries, as JSON
    initial_output: JsonObject


class InitializationProvenance(TypedDict):
    """initialization-provenance.json; the result's `initialization_provenance` has `version`,
    `arms` and (when some arm does not train) `excluded_arms`."""

    version: int
    arms: dict[str, ArmProvenance]
    excluded_arms: NotRequired[dict[str, str]]
    group: NotRequired[JsonObject]
    passed: NotRequired[bool]
    failures: NotRequired[list[str]]


def initialization_entry(
    *,
    base_checkpoint: str,
    checkpoint_uri: str,
    checkpoint_immutable: bool | None,
    loaded_checkpoint_uri: str | None,
    load_succeeded: bool,
    evidence_ref: str,
    restore_count: int,
    optimizer_checks: Sequence[Mapping[str, object]],
    initial_output: JsonObject,
    adapter_sha256: str | None = None,
    checkpoint_immutable_reason: str | None = None,
) -> ArmProvenance:
    """One arm's `initialization_provenance` entry (version 1).

    `checkpoint_immutable` is None when the duplicate save proved nothing (no explicit refusal);
    `checkpoint_immutable_reason` says what the duplicate save got either way."""
    init: JsonObject = {
        "base_checkpoint": base_checkpoint,
        "checkpoint_uri": checkpoint_uri,
        "checkpoint_immutable": checkpoint_immutable,
        "checkpoint_scope": "full_initialization",
        "loaded_checkpoint_uri": loaded_checkpoint_uri,
        "load_succeeded": load_succeeded,
        "source": "server_response",
        "evidence_ref": evidence_ref,
        "before_first_update": True,
    }
    if checkpoint_immutable_reason is not None:
        init["checkpoint_immutable_reason"] = checkpoint_immutable_reason
    if adapter_sha256 is not None:
        init["adapter_sha256"] = adapter_sha256
    return {
        "initialization": init,
        "restore_count": restore_count,
        "optimizer_checks": [as_object(c) for c in optimizer_checks],
        "initial_output": initial_output,
    }


def check_provenance(provenance: InitializationProvenance, arms: Sequence[str]) -> list[str]:
    """Every failure of the group's initialization proof; empty means the group is proved."""
    failures: list[str] = []
    entries = provenance.get("arms", {})
    for arm in arms:
        if arm not in entries:
            failures.append(f"{arm}: no initialization_provenance entry")
    present = [a for a in arms if a in entries]
    for arm in present:
        e = entries[arm]
        init = e["initialization"]
        if not init.get("load_succeeded"):
            failures.append(f"{arm}: checkpoint load did not succeed")
        immutable = init.get("checkpoint_immutable")
        if immutable is None:
            failures.append(
                f"{arm}: checkpoint_immutable unverified: "
                + str(init.get("checkpoint_immutable_reason") or "no explicit refusal to overwrite")
            )
        elif not immutable:
            failures.append(
                f"{arm}: initial checkpoint not shown immutable"
                + (f": {init['checkpoint_immutable_reason']}" if init.get("checkpoint_immutable_reason") else "")
            )
        if init.get("loaded_checkpoint_uri") is None:
            failures.append(f"{arm}: no loaded checkpoint URI in the server's load response")
        elif init["loaded_checkpoint_uri"] != init["checkpoint_uri"]:
            failures.append(
                f"{arm}: server loaded {init['loaded_checkpoint_uri']!r}, expected {init['checkpoint_uri']!r}"
            )
        checks = e.get("optimizer_checks", [])
        covered = sorted(int(num(c["after_restore"])) for c in checks)
        if covered != list(range(e["restore_count"] + 1)):
            failures.append(f"{arm}: optimizer checks cover restores {covered}, need 0..{e['restore_count']}")
        for c in checks:
            if c["mismatches"]:
                failures.append(
                    f"{arm}: optimizer mismatch after restore {c['after_restore']}: "
                    + "; ".join(str(m) for m in items(c["mismatches"]))
                )
        if not e["initial_output"].get("available"):
            failures.append(f"{arm}: initial output unavailable")
    # Shared identity: one checkpoint, one loaded URI, one batch, same outputs.
    for key, label in (
        ("checkpoint_uri", "initial checkpoint"),
        ("loaded_checkpoint_uri", "loaded checkpoint"),
        ("base_checkpoint", "base checkpoint"),
    ):
        values = {entries[a]["initialization"].get(key) for a in present}
        if len(values) > 1:
            failures.append(f"arms do not share one {label}: {sorted(map(str, values))}")
    hashes = {str(h) for a in present if (h := entries[a]["initialization"].get("adapter_sha256")) is not None}
    if len(hashes) > 1:
        failures.append(f"arms' adapter_sha256 differ: {sorted(hashes)}")
    batches = {entries[a]["initial_output"].get("batch_sha256") for a in present}
    if len(batches) > 1:
        failures.append(f"arms' fixed batches differ: {sorted(map(str, batches))}")
    return failures

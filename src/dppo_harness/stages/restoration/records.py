"""What the restoration preflight records: the server responses it keeps, each arm's initialization
provenance and the group's proof, the probes' results, `RestorationResult`, its evidence file names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

import tinker
from pydantic import JsonValue

from dppo_harness.json_types import JsonObject, as_object, items, num
from dppo_harness.train.clients import dump_response

if TYPE_CHECKING:
    from dppo_harness.train.restore import Restore

RESPONSES_FILE = "restoration-server-responses.json"
PROBE_FILE = "restoration-probe.json"
PROVENANCE_FILE = "initialization-provenance.json"
LR_SCALING_FILE = "lr-scaling-probe.json"
INITIAL_OUTPUT_FILE = "restoration-initial-logprobs.json"
FIXED_BATCH_FILE = "restoration-fixed-batch.json"


@dataclass
class Recorder:
    """Server responses kept for evidence, each under a stable reference id; `prefixed` keeps one
    more probe's responses in the same file without clashing with the first's."""

    responses: dict[str, JsonValue] = field(default_factory=dict)
    prefix: str = ""

    def keep(self, ref: str, obj: object) -> str:
        self.responses[f"{self.prefix}{ref}"] = dump_response(obj)
        return f"{RESPONSES_FILE}#{self.prefix}{ref}"

    def prefixed(self, prefix: str) -> Recorder:
        return Recorder(self.responses, self.prefix + prefix)


def load_ref(arm: str) -> str:
    """Where the evidence keeps an arm's load response."""
    return f"{RESPONSES_FILE}#load_{arm}"


PROBE_UPDATES = ["cross_entropy on even datums + optim_step", "cross_entropy on odd datums + optim_step"]
SETUP_CLIENT_ECHO = (
    "probe client (the setup client that saved the initial checkpoint, nothing applied "
    "since) (optim_step response metrics)"
)
SETUP_CLIENT = "the setup client that saved the initial checkpoint (no update before update 1)"


@dataclass(kw_only=True)
class RestoreProbeResult:
    """One create-save-restore probe (`restore_probe`): what it loaded, compared and measured; its
    fields in the order restoration-probe.json writes them."""

    initial_checkpoint: str
    mid_checkpoint: str
    loaded_checkpoint_uri: str | None
    adam_params: JsonObject
    restored_vs_uninterrupted: JsonObject  # compare_logprobs of the two clients after update 2
    second_update_effect: JsonObject  # compare_logprobs of the uninterrupted client before / after update 2
    optim_metrics: dict[str, dict[str, float]]  # update1, update2_uninterrupted, update2_restored
    echoed_config: dict[str, float]
    echo_ref: str
    echo_observed_on: str = SETUP_CLIENT_ECHO
    uninterrupted_client: str = SETUP_CLIENT
    base_lr_update_norm: float | None
    failures: list[str]
    own_config_probes: dict[str, RestoreProbeResult] = field(default_factory=dict)  # other trained arms' configs

    def to_json(self) -> JsonObject:
        """restoration-probe.json (`own_config_probes` only when another arm's config was probed)."""
        out = as_object(asdict(self))
        if not self.own_config_probes:
            del out["own_config_probes"]
        return {**{k: out.pop(k) for k in list(out)[:3]}, "updates": list(PROBE_UPDATES), **out}


@dataclass(frozen=True)
class LrScalingUnavailable:
    """The LR-scaling probe could not measure update norms on this backend, and why."""

    reason: str
    learning_rates: list[float] = field(default_factory=list)
    available: Literal[False] = False

    def to_json(self) -> JsonObject:
        """lr-scaling-probe.json when unmeasured."""
        rates: list[JsonValue] = [*self.learning_rates]
        return {"available": False, "reason": self.reason, "learning_rates": rates, "lr_scaling": [], "passed": None}


@dataclass(frozen=True, kw_only=True)
class LrScalingMeasured:
    """Update norms from a fresh state per learning rate, and whether norm / LR stayed constant;
    its fields in the order lr-scaling-probe.json writes them."""

    available: Literal[True] = True
    measure: str | None = None
    reset: str | None = None
    gradient: str | None = None
    lr_scaling: list[dict[str, float]]  # {"learning_rate", "update_norm"} per probe, in LR order
    relative_error: list[float | None] | None = None
    rtol: float | None = None
    passed: bool | None = None
    problem: str | None = None

    def to_json(self) -> JsonObject:
        """lr-scaling-probe.json when measured."""
        return as_object(asdict(self))


LrScalingBlock = LrScalingUnavailable | LrScalingMeasured


@dataclass
class RestorationResult:
    initial_checkpoint: str
    loaded_paths: dict[str, str]
    clients: dict[str, tinker.TrainingClient]
    fixed_batch: list[tinker.Datum]
    batch_sha256: str
    output_sha256: dict[str, str]
    provenance: InitializationProvenance  # initialization-provenance.json
    passed: bool
    failures: list[str]
    lr_scaling: LrScalingBlock
    probe: RestoreProbeResult
    wall_seconds: float
    loaded: dict[str, Restore]  # each loaded arm: client, load response, get_info

    def failure_message(self) -> str:
        return "restoration preflight failed:\n  - " + "\n  - ".join(self.failures)

    def preflight_service_work(self) -> dict[str, dict[str, int]]:
        """Optimizer updates the preflight issued on its throwaway probe clients, from its own records:
        the restore-continuity probe (one update on the uninterrupted client, then one on each of the
        uninterrupted and the restored client) and one update per measured LR probe, less the one at
        the planned LR, which is the continuity probe's first update. No sampling."""
        lr, shared = self.lr_scaling, int(self.probe.base_lr_update_norm is not None)
        lr_updates = max(0, len(lr.lr_scaling) - shared) if isinstance(lr, LrScalingMeasured) else 0
        return {
            "restore_continuity_probe": {"optimizer_updates": 3, "sampling_batches": 0},
            "lr_scaling_probe": {"optimizer_updates": lr_updates, "sampling_batches": 0},
            "feasibility_pilot": {"optimizer_updates": 0, "sampling_batches": 0},
        }


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

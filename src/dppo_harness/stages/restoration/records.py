"""What the restoration preflight hands to later stages: the restore probe's result, the LR-scaling
block and `RestorationResult`, each a record whose `to_json()` writes the evidence file's dict
(same keys, same order) that the bundle registers.

`RestorationResult.preflight_service_work` is the stage rule that counts the optimizer updates the preflight issued
on its throwaway probe clients (the diagnostic's service-work ledger starts from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import tinker

from dppo_harness.json_types import JsonObject

if TYPE_CHECKING:
    from dppo_harness.stages.restoration.provenance import InitializationProvenance
    from dppo_harness.train.restore import Restore


PROBE_UPDATES = ["cross_entropy on even datums + optim_step", "cross_entropy on odd datums + optim_step"]
SETUP_CLIENT_ECHO = (
    "probe client (the setup client that saved the initial checkpoint, nothing applied "
    "since) (optim_step response metrics)"
)
SETUP_CLIENT = "the setup client that saved the initial checkpoint (no update before update 1)"


@dataclass
class RestoreProbeResult:
    """One create-save-restore probe (`restore_probe`): what it loaded, compared and measured."""

    initial_checkpoint: str
    mid_checkpoint: str
    loaded_checkpoint_uri: str | None
    adam_params: JsonObject
    restored_vs_uninterrupted: JsonObject  # compare_logprobs of the two clients after update 2
    second_update_effect: JsonObject  # compare_logprobs of the uninterrupted client before / after update 2
    optim_metrics: dict[str, dict[str, float]]  # update1, update2_uninterrupted, update2_restored
    echoed_config: dict[str, float]
    echo_ref: str
    base_lr_update_norm: float | None
    failures: list[str]
    echo_observed_on: str = SETUP_CLIENT_ECHO
    uninterrupted_client: str = SETUP_CLIENT
    own_config_probes: dict[str, RestoreProbeResult] = field(default_factory=dict)  # other trained arms' configs

    def to_json(self) -> JsonObject:
        """restoration-probe.json (`own_config_probes` only when another arm's config was probed)."""
        out: JsonObject = {
            "initial_checkpoint": self.initial_checkpoint,
            "mid_checkpoint": self.mid_checkpoint,
            "loaded_checkpoint_uri": self.loaded_checkpoint_uri,
            "updates": list(PROBE_UPDATES),
            "adam_params": self.adam_params,
            "restored_vs_uninterrupted": self.restored_vs_uninterrupted,
            "second_update_effect": self.second_update_effect,
            "optim_metrics": {k: dict(v) for k, v in self.optim_metrics.items()},
            "echoed_config": dict(self.echoed_config),
            "echo_ref": self.echo_ref,
            "echo_observed_on": self.echo_observed_on,
            "uninterrupted_client": self.uninterrupted_client,
            "base_lr_update_norm": self.base_lr_update_norm,
            "failures": list(self.failures),
        }
        if self.own_config_probes:
            out["own_config_probes"] = {a: p.to_json() for a, p in self.own_config_probes.items()}
        return out


@dataclass(frozen=True)
class LrScalingUnavailable:
    """The LR-scaling probe could not measure update norms on this backend, and why."""

    reason: str
    learning_rates: list[float] = field(default_factory=list)
    available: Literal[False] = False

    def to_json(self) -> JsonObject:
        """lr-scaling-probe.json when unmeasured."""
        return {
            "available": False,
            "reason": self.reason,
            "learning_rates": list(self.learning_rates),
            "lr_scaling": [],
            "passed": None,
        }


@dataclass(frozen=True)
class LrScalingMeasured:
    """Update norms from a fresh state per learning rate, and whether norm / LR stayed constant."""

    lr_scaling: list[dict[str, float]]  # {"learning_rate", "update_norm"} per probe, in LR order
    passed: bool | None = None
    rtol: float | None = None
    relative_error: list[float | None] | None = None
    measure: str | None = None
    reset: str | None = None
    gradient: str | None = None
    problem: str | None = None
    available: Literal[True] = True

    def to_json(self) -> JsonObject:
        """lr-scaling-probe.json when measured."""
        return {
            "available": True,
            "measure": self.measure,
            "reset": self.reset,
            "gradient": self.gradient,
            "lr_scaling": [dict(p) for p in self.lr_scaling],
            "relative_error": None if self.relative_error is None else list(self.relative_error),
            "rtol": self.rtol,
            "passed": self.passed,
            "problem": self.problem,
        }


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
    lr_scaling: LrScalingBlock | None = None
    probe: RestoreProbeResult | None = None
    wall_seconds: float = 0.0
    loaded: dict[str, Restore] = field(default_factory=dict)  # each loaded arm: client, load response, get_info

    def failure_message(self) -> str:
        return "restoration preflight failed:\n  - " + "\n  - ".join(self.failures)

    def preflight_service_work(self) -> dict[str, dict[str, int]]:
        """Optimizer updates the preflight issued on its throwaway probe clients, from its own records:
        the restore-continuity probe (one update on the uninterrupted client, then one on each of the
        uninterrupted and the restored client) and one update per measured LR probe, less the one at
        the planned LR, which is the continuity probe's first update. No sampling."""
        lr, probe = self.lr_scaling, self.probe
        shared = 1 if probe is not None and probe.base_lr_update_norm is not None else 0
        lr_updates = max(0, len(lr.lr_scaling) - shared) if isinstance(lr, LrScalingMeasured) else 0
        return {
            "restore_continuity_probe": {"optimizer_updates": 3 if probe is not None else 0, "sampling_batches": 0},
            "lr_scaling_probe": {"optimizer_updates": lr_updates, "sampling_batches": 0},
            "feasibility_pilot": {"optimizer_updates": 0, "sampling_batches": 0},
        }

"""The restoration preflight: one shared immutable initial state for both arms, proved, not assumed.

Modules, in the order the preflight uses them: `group` (the initialization group's arms, the
trained ones, their seed), `batch` (the fixed tokenized batch), `checkpoint` (the fresh setup
client's initial checkpoint, its immutability, each arm's load with optimizer, the server responses
kept as evidence), `arm_checks` (the loaded arms' adapters, initial outputs and initialization
entries), `probe` (the create-save-restore probe and the one fixed-gradient update every probe
applies), `update_norm` (update-norm measures where a backend allows them; `local_checkpoints` does
the local backend's checkpoint arithmetic), `lr_probe` (the LR-scaling probe and the correctness
block's `lr_scaling`), `provenance` (each arm's initialization entry and the group's proof),
`outcome` (the group's provenance and the evidence files), `records` (the probe result, the
LR-scaling block, `RestorationResult` and the preflight's service work) and `preflight`
(`run_restoration_preflight`, the six steps in order).
"""

from dppo_harness.stages.restoration.arm_checks import INITIAL_OUTPUT_FILE, SOURCE_OUTPUT_KEY
from dppo_harness.stages.restoration.checkpoint import RESPONSES_FILE, duplicate_save_outcome, load_ref
from dppo_harness.stages.restoration.group import restoration_arms
from dppo_harness.stages.restoration.outcome import PROBE_FILE, PROVENANCE_FILE
from dppo_harness.stages.restoration.preflight import backend_update_norm, run_restoration_preflight
from dppo_harness.stages.restoration.records import (
    LrScalingBlock,
    LrScalingMeasured,
    LrScalingUnavailable,
    RestorationResult,
    RestoreProbeResult,
)
from dppo_harness.train.clients import RestorationError

__all__ = [
    "INITIAL_OUTPUT_FILE",
    "PROBE_FILE",
    "PROVENANCE_FILE",
    "RESPONSES_FILE",
    "SOURCE_OUTPUT_KEY",
    "LrScalingBlock",
    "LrScalingMeasured",
    "LrScalingUnavailable",
    "RestorationError",
    "RestorationResult",
    "RestoreProbeResult",
    "backend_update_norm",
    "duplicate_save_outcome",
    "load_ref",
    "restoration_arms",
    "run_restoration_preflight",
]

"""The restoration preflight: one shared immutable initial state for both arms, proved, not assumed.

`preflight` runs it (`run_restoration_preflight`, the six steps in order, and writes its evidence),
`probe` holds the restore and LR-scaling probes, `records` what it records.
"""

from dppo_harness.stages.restoration.preflight import (
    SOURCE_OUTPUT_KEY,
    backend_update_norm,
    duplicate_save_outcome,
    restoration_arms,
    run_restoration_preflight,
)
from dppo_harness.stages.restoration.records import (
    INITIAL_OUTPUT_FILE,
    PROVENANCE_FILE,
    RESPONSES_FILE,
    RestorationResult,
)
from dppo_harness.train.clients import RestorationError

__all__ = [
    "INITIAL_OUTPUT_FILE",
    "PROVENANCE_FILE",
    "RESPONSES_FILE",
    "SOURCE_OUTPUT_KEY",
    "RestorationError",
    "RestorationResult",
    "backend_update_norm",
    "duplicate_save_outcome",
    "restoration_arms",
    "run_restoration_preflight",
]

"""Evidence bundle: registered immutable files, result.json in its structured-output shape, verify
CLI (`python -m dppo_harness.evidence verify DIR`). The layout is in docs/evidence.md."""

from dppo_harness.evidence.bundle import EvidenceBundle
from dppo_harness.evidence.files import (
    MAX_FILES,
    EvidenceError,
    ImmutableNameError,
    LimitError,
    ResultShapeError,
    UnwritableEvidenceError,
)
from dppo_harness.evidence.result import REHEARSAL_PREFIX
from dppo_harness.evidence.verify import verify_bundle
from dppo_harness.service.secrets_scan import SecretLeakError

__all__ = [
    "MAX_FILES",
    "REHEARSAL_PREFIX",
    "EvidenceBundle",
    "EvidenceError",
    "ImmutableNameError",
    "LimitError",
    "ResultShapeError",
    "SecretLeakError",
    "UnwritableEvidenceError",
    "verify_bundle",
]

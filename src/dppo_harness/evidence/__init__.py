"""Evidence bundle: registered immutable files, result.json in its structured-output shape, verify CLI.

Layout of one run (`<root>/<run_id>/`):
    result.json       the structured output, rewritten atomically after every update
    files/<name>      every registered evidence file (name, kind, sha256, size in result.json)
    ledger.json       the budget ledger sidecar (also registered as budget-ledger.json at finish)
`<root>/LATEST` holds the newest run_id.

Every byte that leaves memory (files and result.json) is scanned first for the live secret
values in the environment; a match blocks the write and raises SecretLeakError.

    python -m dppo_harness.evidence verify DIR     # DIR: a run dir, or a root with LATEST
"""

from dppo_harness.evidence.bundle import EvidenceBundle
from dppo_harness.evidence.errors import (
    EvidenceError,
    ImmutableNameError,
    LimitError,
    ResultShapeError,
    UnwritableEvidenceError,
)
from dppo_harness.evidence.files import MAX_FILES
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

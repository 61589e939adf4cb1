"""Evidence bundle: registered immutable files, result.json in its structured-output shape, verify CLI.

Layout of one run (`<root>/<run_id>/`):
    result.json       the structured output, rewritten atomically after every update
    files/<name>      every registered evidence file (name, kind, sha256, size in result.json)
    ledger.json       the budget ledger sidecar (also registered as budget-ledger.json at finish)
`<root>/LATEST` holds the newest run_id.

Every byte that leaves memory (files and result.json) is scanned first for the live secret
values in the environment; a match blocks the write and raises SecretLeakError.

    python -m dppo_harness.evidence verify DIR     # DIR: a run dir, or a root with LATEST

Modules: files (file registry + limits), result (result.json shape and merge rules), ledger
(budget), session (what a pytest session records), provenance (git revision), verify (CLI),
bundle (EvidenceBundle, which composes them).
"""

from dppo_harness.evidence.bundle import EvidenceBundle
from dppo_harness.evidence.errors import (
    EvidenceError,
    ImmutableNameError,
    LimitError,
    ResultShapeError,
    UnwritableEvidenceError,
)
from dppo_harness.evidence.files import (
    KINDS,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_TOTAL_BYTES,
    FileEntry,
    atomic_write,
    sha256_bytes,
)
from dppo_harness.evidence.provenance import code_revision
from dppo_harness.evidence.result import (
    OUTCOME_REASONS,
    REHEARSAL_PREFIX,
    STATUSES,
    VERDICTS,
    ResultModel,
    initial_result,
    validate_result,
)
from dppo_harness.evidence.verify import main, verify_bundle
from dppo_harness.plans.models import DEVIATION_FIELDS
from dppo_harness.service.secrets_scan import SecretLeakError

__all__ = [
    "DEVIATION_FIELDS",
    "KINDS",
    "MAX_FILES",
    "MAX_FILE_BYTES",
    "MAX_TOTAL_BYTES",
    "OUTCOME_REASONS",
    "REHEARSAL_PREFIX",
    "STATUSES",
    "VERDICTS",
    "EvidenceBundle",
    "EvidenceError",
    "FileEntry",
    "ImmutableNameError",
    "LimitError",
    "ResultModel",
    "ResultShapeError",
    "SecretLeakError",
    "UnwritableEvidenceError",
    "atomic_write",
    "code_revision",
    "initial_result",
    "main",
    "sha256_bytes",
    "validate_result",
    "verify_bundle",
]

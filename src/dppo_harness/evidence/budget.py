"""The evidence budget: the bundle's limits (64 files, 10 MiB a file, 40 MiB in all) are checked at
every registration (`EvidenceBundle.register_bytes`), nothing is counted ahead from the plan. One
reserve, set before any other file (`EvidenceBundle.reserve_closing`), keeps a slot for each closing
record and for the last stage-end snapshot, and CLOSING_BYTES, so no stage can starve the close;
optional files ask `free_slots()` first and are skipped, the ledger saying so. The rest sizes single
files, or keeps slots for writes a running stage knows are still to come.
"""

from __future__ import annotations

from dataclasses import dataclass

from dppo_harness.evidence.files import MAX_FILE_BYTES, MAX_FILES, MAX_TOTAL_BYTES
from dppo_harness.json_types import JsonObject

MIB = 1024 * 1024

# Written when the session closes, reserved in the bundle from the session's start.
CLOSING_RECORDS = ("client-identities.json", "client-releases.json", "unit-parity-summary.json", "budget-ledger.json")
# Besides them, one slot only a stage-end snapshot may take: the last stage's end always fits.
STAGE_END_SLOTS = 1
CLOSING_BYTES = 2 * MIB

# Result snapshots while a call waits on the service, at most (service.wait.waiter.BundlePoster).
WAIT_SNAPSHOTS = 2
# The diagnostic posts a result snapshot every this many updates.
SNAPSHOT_EVERY_UPDATES = 4
UPDATES_PER_ARCHIVE = 8  # update records per archive file, unless the bytes bound says fewer
# A record's bytes per token position, at most: 5 eight-byte columns (logprobs, anchor, advantage,
# mask, target) and 3 one-byte decisions, before compression (what decides the records per file).
RECORD_BYTES_PER_TOKEN = 43
RECORD_OVERHEAD_BYTES = 64 * 1024  # the JSON meta (context, stats, histograms) and zip headers
# Prompt tokens per sequence, at most: the longest GSM8K train question is 212 tokens; the chat
# template adds tens.
PROMPT_TOKENS_BOUND = 384

# The comparison's files after its last step: steps JSONL, end state, evaluator, observations,
# decision, report.md and its 4 plots; per arm its predictions (plus the base model's).
COMPARISON_END_FIXED = 10
COMPARISON_END_PER_ARM = 1
MID_STEP_RESTORES_PER_ARM = 1  # slots kept for a state registered by a restore inside a step


def record() -> JsonObject:
    """What ledger.json keeps under `evidence_budget`: the limits and the closing reserve."""
    return {
        "limit_files": MAX_FILES,
        "limit_file_bytes": MAX_FILE_BYTES,
        "limit_bytes": MAX_TOTAL_BYTES,
        "checked": "at each registration",
        "closing_records": [*CLOSING_RECORDS, "the last stage-end snapshot"],
        "closing_bytes": CLOSING_BYTES,
    }


@dataclass(frozen=True)
class DiagnosticSize:
    """The figures of a bounded diagnostic that bound one update record's bytes."""

    max_updates: int
    groups_per_minibatch: int
    group_size: int
    max_tokens: int


def record_bytes_bound(size: DiagnosticSize) -> int:
    """The most bytes one update's record can take before compression."""
    tokens = size.groups_per_minibatch * size.group_size * (size.max_tokens + PROMPT_TOKENS_BOUND)
    return tokens * RECORD_BYTES_PER_TOKEN + RECORD_OVERHEAD_BYTES


def updates_per_archive(size: DiagnosticSize) -> int:
    """Update records per archive file: UPDATES_PER_ARCHIVE, fewer when their bound would pass the
    per-file limit; 0 when even one record cannot fit a file."""
    return min(UPDATES_PER_ARCHIVE, MAX_FILE_BYTES // record_bytes_bound(size))


def comparison_end_files(arms: int) -> int:
    """Files the comparison registers after its last step (steps, end state, evaluation, report)."""
    return COMPARISON_END_FIXED + COMPARISON_END_PER_ARM * arms + 1  # + the base model's predictions


def comparison_reserve(arms: int, mid_step_restores_left: int) -> int:
    """File slots a running comparison keeps free beyond the bundle's closing reserve (which holds
    its stage-end snapshot's): its end files and the mid-step restores it may still register."""
    return comparison_end_files(arms) + mid_step_restores_left

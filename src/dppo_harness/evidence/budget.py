"""The evidence budget: the bundle's limits are checked at every registration, nothing is counted
ahead from the plan. One reserve, set before any other file, keeps the close from being starved;
the rest sizes single files (the diagnostic's update archives). In-loop writes go to the journal
and take no slot.
"""

from __future__ import annotations

from dppo_harness.evidence.files import MAX_FILE_BYTES, MAX_FILES, MAX_TOTAL_BYTES
from dppo_harness.json_types import JsonObject

MIB = 1024 * 1024

# Written when the session closes, reserved in the bundle from the session's start.
CLOSING_RECORDS = ("client-identities.json", "client-releases.json", "unit-parity-summary.json", "budget-ledger.json")
CLOSING_BYTES = 2 * MIB

# The diagnostic journals a result snapshot every this many updates.
SNAPSHOT_EVERY_UPDATES = 4
UPDATES_PER_ARCHIVE = 8  # update records per archive file, unless the bytes bound says fewer
# A record's bytes per token position, at most: 5 eight-byte columns (logprobs, anchor, advantage,
# mask, target) and 3 one-byte decisions, before compression (what decides the records per file).
RECORD_BYTES_PER_TOKEN = 43
RECORD_OVERHEAD_BYTES = 64 * 1024  # the JSON meta (context, stats, histograms) and zip headers
# Prompt tokens per sequence, at most: the longest GSM8K train question is 212 tokens; the chat
# template adds tens.
PROMPT_TOKENS_BOUND = 384


# What ledger.json keeps under `evidence_budget`: the limits and the closing reserve.
RECORD: JsonObject = {
    "limit_files": MAX_FILES,
    "limit_file_bytes": MAX_FILE_BYTES,
    "limit_bytes": MAX_TOTAL_BYTES,
    "checked": "at each registration",
    "closing_records": list(CLOSING_RECORDS),
    "closing_bytes": CLOSING_BYTES,
}


def record_bytes_bound(sequences_per_update: int, max_tokens: int) -> int:
    """The most bytes one update's record can take before compression."""
    return sequences_per_update * (max_tokens + PROMPT_TOKENS_BOUND) * RECORD_BYTES_PER_TOKEN + RECORD_OVERHEAD_BYTES


def updates_per_archive(sequences_per_update: int, max_tokens: int) -> int:
    """Update records per archive file: UPDATES_PER_ARCHIVE, fewer when their bound would pass the
    per-file limit; 0 when even one record cannot fit a file."""
    return min(UPDATES_PER_ARCHIVE, MAX_FILE_BYTES // record_bytes_bound(sequences_per_update, max_tokens))

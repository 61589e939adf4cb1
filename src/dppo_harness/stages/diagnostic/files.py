"""The bounded diagnostic's own evidence file names (the ones replay and the session also read
live in `instrument.pooled`, which must not import the diagnostic)."""

from __future__ import annotations

SELFTEST_FILE = "diagnostic-selftest.json"
SENTINEL_FILE = "diagnostic-sentinels.json"
REFERENCES_FILE = "diagnostic-prior-references.json"
NEXT_ACTION_FILE = "diagnostic-next-action.json"
ORIGINAL_GATE_REPORT_FILE = "original-gate-report.json"
SERVICE_WORK_FILE = "service-work-ledger.json"
REPLAY_OUTPUT_FILE = "diagnostic-replay.txt"
FEASIBILITY_SOURCE = "diagnostic-analysis.json#timings"


def update_record_name(update_index: int) -> str:
    """A file holding update `update_index`'s recorded loss call alone (replay reads any record
    file; the diagnostic registers its records in archives, `update_archive_name`)."""
    return f"diagnostic-update-{update_index:02d}.npz"


def update_archive_name(first: int, last: int) -> str:
    """The file holding the recorded loss calls of updates `first` to `last` (one archive)."""
    return f"diagnostic-updates-{first:02d}-{last:02d}.npz"

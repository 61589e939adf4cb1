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
    """The file holding update `update_index`'s recorded loss call."""
    return f"diagnostic-update-{update_index:02d}.npz"

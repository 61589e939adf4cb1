"""Immutable result snapshots while the run works, so a session that ends early still leaves its
results: the current result.json, exactly as posted, under the next free name `result-0001.json`,
`result-0002.json`, ... It never takes the file slots kept for later evidence or the bundle's
closing reserve (a stage-end snapshot may take the slot the reserve keeps for the last one).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from dppo_harness.evidence.budget import STAGE_END_SLOTS
from dppo_harness.evidence.files import MAX_FILES

if TYPE_CHECKING:
    from dppo_harness.evidence.bundle import EvidenceBundle

SNAPSHOT_RE = re.compile(r"^result-(\d{4})\.json$")
DEFAULT_RESERVE = 10  # slots kept for the files a stage writes at its end


def snapshot_names(bundle: EvidenceBundle) -> list[str]:
    return sorted(e["name"] for e in bundle.files() if SNAPSHOT_RE.match(e["name"]))


def post_snapshot(
    bundle: EvidenceBundle, label: str, *, reserve: int = DEFAULT_RESERVE, stage_end: bool = False
) -> str | None:
    """Register the current result as the next `result-NNNN.json`; returns its name, or None when
    the file limit (less `reserve`) leaves no room (recorded in the ledger as skipped)."""
    names = snapshot_names(bundle)
    ledger = bundle.ledger()
    log: list[dict[str, Any]] = list(ledger.get("snapshots", []))
    # `reserve` counts the closing records; the slot kept for the last stage-end snapshot comes on top.
    kept = reserve + (0 if stage_end else STAGE_END_SLOTS)
    if len(bundle.files()) + 1 > MAX_FILES - kept or bundle.free_slots(stage_end=stage_end) < 1:
        skipped = f"file limit: {len(bundle.files())} of {MAX_FILES} files used, {kept} kept for later evidence"
        log.append({"label": label, "name": None, "skipped": skipped})
        bundle.note_ledger(snapshots=log)
        return None
    last = SNAPSHOT_RE.match(names[-1]) if names else None  # every name matches: snapshot_names filters by it
    name = f"result-{int(last.group(1)) + 1 if last else 1:04d}.json"
    bundle.register_json(name, "metrics", bundle.result, stage_end=stage_end)
    log.append({"label": label, "name": name, "elapsed_s": round(bundle.elapsed_seconds(), 3)})
    bundle.note_ledger(snapshots=log)
    return name

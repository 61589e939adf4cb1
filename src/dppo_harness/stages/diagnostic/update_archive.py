"""The diagnostic's update records, a few per evidence file, so the run's file count does not grow
with its updates (`diagnostic-updates-01-08.npz` holds updates 1 to 8).

Each record is persisted before the optimizer step it feeds: the open archive's records are
rewritten, atomically, to a staging file beside the bundle (`.diagnostic-updates.staged.npz`, scanned
for secrets like every sidecar) and registered, with its sha256, once the archive is full or the run
stops. An archive whose bytes would pass the per-file limit is split; a single record that does
not fit one file is refused (LimitError), never truncated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dppo_harness.evidence.files import MAX_FILE_BYTES
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.stages.diagnostic.write import STAGING_FILE, update_archive_name

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle


@dataclass
class UpdateArchive:
    """Collects update records into archives of `per_file` records (see the module docstring)."""

    bundle: EvidenceBundle
    per_file: int
    pending: list[ins.LossCallRecord] = field(default_factory=list)
    registered: list[str] = field(default_factory=list)

    @property
    def staging_path(self) -> Path:
        return self.bundle.dir / STAGING_FILE

    def add(self, record: ins.LossCallRecord) -> None:
        """Persist `record` (durable before this returns); register the archive once it is full."""
        self.pending.append(record)
        self.bundle.write_beside(STAGING_FILE, ins.records_to_npz(self.pending))
        if len(self.pending) >= max(1, self.per_file):
            self.flush()

    def flush(self) -> list[str]:
        """Register the pending records as archive file(s); returns the names registered now."""
        names: list[str] = []
        while self.pending:
            take = len(self.pending)
            data = ins.records_to_npz(self.pending[:take])
            while len(data) > MAX_FILE_BYTES and take > 1:  # split: fewer records per file
                take -= 1
                data = ins.records_to_npz(self.pending[:take])
            first, last = (int(r.context["update_index"]) for r in (self.pending[0], self.pending[take - 1]))
            name = update_archive_name(first, last)
            self.bundle.register_bytes(name, "tensors", data)
            names.append(name)
            del self.pending[:take]
        self.registered += names
        if self.staging_path.exists():
            self.staging_path.unlink()
        return names

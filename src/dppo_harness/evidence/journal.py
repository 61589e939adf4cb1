"""The journal: a run's in-loop durability, one append-only JSONL file beside the bundle
(`journal.jsonl`, scanned like every sidecar). A running stage appends what must survive a kill (a
step row, a loss record, a run state, a result snapshot) and names no file; each entry is one line,
scanned for secrets and fsynced before `append` returns, so a killed run keeps every entry but a
torn last line, which `entries` drops. Entries take no file slot: only a stage's writer registers
files, at its end, so the evidence budget needs no in-loop reserve.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dppo_harness.evidence.files import EvidenceError, sha256_bytes
from dppo_harness.json_types import JsonValue

if TYPE_CHECKING:
    from dppo_harness.evidence.bundle import EvidenceBundle

JOURNAL_FILE = "journal.jsonl"
EntryKind = Literal["row", "record", "state", "snapshot"]


class JournalError(EvidenceError):
    """A journal line other than the last is not an entry: the journal was altered."""


@dataclass(frozen=True)
class Entry:
    seq: int  # 1, 2, ... in append order
    prev: str  # the sha256 of the entry before ("" for the first)
    stage: str
    kind: EntryKind
    label: str
    elapsed_s: float
    data: JsonValue
    blob: bytes | None  # binary payload (a loss record's npz), kept base64 in the line
    sha256: str  # of the entry's line: what a later session cites to name this entry

    @property
    def ref(self) -> str:
        return f"{JOURNAL_FILE}#{self.seq}"


class Journal:
    """Appends to, and reads back, one bundle's journal."""

    def __init__(self, bundle: EvidenceBundle):
        self.bundle = bundle
        self.path = bundle.dir / JOURNAL_FILE
        self._seq, self._prev = _head(self.path)
        if self.path.exists() and not (data := self.path.read_bytes()).endswith(b"\n"):
            with open(self.path, "r+b") as f:  # a torn tail: its append never returned; the next starts a line
                f.truncate(data.rfind(b"\n") + 1)
        self._size = _size(self.path)  # what this object last saw: another Journal of the bundle may append too

    def append(
        self, stage: str, kind: EntryKind, label: str, data: JsonValue = None, blob: bytes | None = None
    ) -> Entry:
        """One entry, durable before this returns."""
        with self.bundle.lock:
            if (size := _size(self.path)) != self._size:
                self._seq, self._prev = _head(self.path)
            elapsed = round(self.bundle.elapsed_seconds(), 3)
            line = _line(self._seq + 1, self._prev, stage, kind, label, elapsed, data, blob)
            self.bundle.append_beside(JOURNAL_FILE, line)
            entry = Entry(self._seq + 1, self._prev, stage, kind, label, elapsed, data, blob, sha256_bytes(line))
            self._seq, self._prev, self._size = entry.seq, entry.sha256, size + len(line)
            return entry

    def snapshot(self, stage: str, label: str) -> Entry:
        """The result as it stands now (result.json is replaced at every update; this keeps it)."""
        return self.append(stage, "snapshot", label, self.bundle.result)

    def entries(self, kind: EntryKind | None = None, stage: str | None = None) -> list[Entry]:
        return [
            e
            for e in read_entries(self.path)
            if (kind is None or e.kind == kind) and (stage is None or e.stage == stage)
        ]


def _head(path: Path) -> tuple[int, str]:
    """(entries, the last entry's sha256, "" when none): what the next entry follows."""
    entries = read_entries(path)
    return len(entries), entries[-1].sha256 if entries else ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _line(
    seq: int, prev: str, stage: str, kind: str, label: str, elapsed_s: float, data: JsonValue, blob: bytes | None
) -> bytes:
    # `prev`, the previous line's sha256, chains the entries: an edited line breaks the next one's link
    entry: dict[str, JsonValue] = {"seq": seq, "prev": prev, "stage": stage, "kind": kind, "label": label}
    entry |= {"elapsed_s": elapsed_s, "data": data}
    if blob is not None:
        entry |= {"blob_sha256": sha256_bytes(blob), "blob_b64": base64.b64encode(blob).decode("ascii")}
    return (json.dumps(entry, allow_nan=False, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _entry(line: bytes) -> Entry:
    obj = json.loads(line)
    blob = None if "blob_b64" not in obj else base64.b64decode(obj["blob_b64"], validate=True)
    if blob is not None and sha256_bytes(blob) != obj["blob_sha256"]:
        raise ValueError("blob_sha256 does not match the blob")
    fields = (obj["seq"], obj["prev"], obj["stage"], obj["kind"], obj["label"], obj["elapsed_s"], obj["data"])
    return Entry(*fields, blob=blob, sha256=sha256_bytes(line))


def read_entries(path: Path) -> list[Entry]:
    """The journal's entries in order; [] when there is none. A torn last line (a kill mid-append)
    (no newline yet) is dropped; any other line that is not the next entry, chained to the one before,
    fails with the line's number."""
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    out: list[Entry] = []
    for i, line in enumerate(lines, 1):
        try:
            entry = _entry(line)
            if entry.seq != i or entry.prev != (out[-1].sha256 if out else "") or not line.endswith(b"\n"):
                raise ValueError(f"expected entry {i}, chained to the line before, a whole line")
        except (ValueError, KeyError, TypeError) as exc:
            if i == len(lines) and not line.endswith(b"\n"):
                break  # torn by a kill while it was appended: the append never returned
            raise JournalError(f"{path}: line {i} is not journal entry {i} ({exc})") from None
        out.append(entry)
    return out

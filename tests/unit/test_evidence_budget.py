"""The evidence budget is checked at write time: the closing records keep their reserve however much
a stage writes, a journal snapshot takes no file slot (it lands when only the reserve is left),
and a required write over a limit stops the run with one LimitError line."""

from __future__ import annotations

from pathlib import Path

import pytest

from dppo_harness.evidence import EvidenceBundle, LimitError, budget
from dppo_harness.evidence.files import MAX_FILE_BYTES, MAX_FILES, MAX_TOTAL_BYTES
from dppo_harness.evidence.verify import verify_bundle

RESERVED = len(budget.CLOSING_RECORDS)


def _closing_bundle(tmp_path: Path) -> EvidenceBundle:
    b = EvidenceBundle.create(tmp_path, "run", env={})
    b.reserve_closing()
    return b


def _fill(b: EvidenceBundle) -> None:
    """A stage writing until the bundle refuses: everything but the reserve."""
    i = 0
    while b.free_slots() > 0:
        b.register_bytes(f"f{i:02d}.txt", "log", b"x%d" % i)
        i += 1


def test_the_reserve_holds_for_the_closing_records_after_a_stage_writes_up_to_the_limit(tmp_path: Path) -> None:
    b = _closing_bundle(tmp_path)
    _fill(b)
    assert len(b.files()) == MAX_FILES - RESERVED
    with pytest.raises(LimitError, match="reserved for the closing records") as exc:
        b.register_bytes("one-more.txt", "log", b"y")
    assert f"already written: {MAX_FILES - RESERVED} files" in str(exc.value)
    for name in budget.CLOSING_RECORDS:
        b.register_json(name, "log", {"name": name})
    assert len(b.files()) == MAX_FILES
    assert b.ledger()["evidence_budget"]["closing_records"] == list(budget.CLOSING_RECORDS)


def test_the_closing_bytes_are_reserved_too(tmp_path: Path) -> None:
    b = _closing_bundle(tmp_path)
    chunk = MAX_FILE_BYTES
    for i in range((MAX_TOTAL_BYTES - budget.CLOSING_BYTES) // chunk):
        b.register_bytes(f"big{i}.bin", "log", bytes([i]) * chunk)
    with pytest.raises(LimitError, match=r"bytes are reserved for the closing records; already written: \d+ files"):
        b.register_bytes("last.bin", "log", b"z" * chunk)
    for name in budget.CLOSING_RECORDS:
        b.register_json(name, "log", {"name": name})


def test_a_snapshot_lands_in_the_journal_when_only_the_reserve_is_left(tmp_path: Path) -> None:
    b = _closing_bundle(tmp_path)
    _fill(b)
    before = b.files()
    entry = b.journal.snapshot("comparison", "waiting: sample on arm0")
    assert b.files() == before and b.free_slots() == 0  # no file slot taken
    assert b.journal.entries("snapshot") == [entry] and entry.data == b.result
    assert verify_bundle(b.dir) == []


@pytest.mark.parametrize(
    ("setup", "name", "size", "limit"),
    [
        (0, "huge.bin", MAX_FILE_BYTES + 1, f"the limit is {MAX_FILE_BYTES} bytes (10 MiB) per file"),
        (MAX_FILES, "f64.txt", 1, f"the limit is {MAX_FILES} files per run"),
    ],
)
def test_a_required_write_over_a_limit_raises_one_limit_error_line(
    tmp_path: Path, setup: int, name: str, size: int, limit: str
) -> None:
    b = EvidenceBundle.create(tmp_path, "run", env={})  # no reserve: the hard limits themselves
    for i in range(setup):
        b.register_bytes(f"f{i:02d}.txt", "log", b"%d" % i)
    written = len(b.files())
    with pytest.raises(LimitError) as exc:
        b.register_bytes(name, "log", b"q" * size)
    line = str(exc.value)
    assert "\n" not in line and f"file {name!r}" in line and limit in line
    assert f"already written: {written} files" in line
    assert b.entry(name) is None and len(b.files()) == written
    assert verify_bundle(b.dir) == []


def test_the_total_bytes_limit_names_the_file_the_limit_and_what_was_written(tmp_path: Path) -> None:
    b = EvidenceBundle.create(tmp_path, "run", env={})
    for i in range(MAX_TOTAL_BYTES // MAX_FILE_BYTES):
        b.register_bytes(f"big{i}.bin", "log", bytes([i]) * MAX_FILE_BYTES)
    with pytest.raises(LimitError) as exc:
        b.register_bytes("over.bin", "log", b"o")
    line = str(exc.value)
    assert "\n" not in line and "'over.bin'" in line and f"the limit is {MAX_TOTAL_BYTES} bytes" in line
    assert f"already written: {len(b.files())} files, {MAX_TOTAL_BYTES} bytes" in line


def test_the_archive_size_rule_keeps_each_archive_within_one_file() -> None:
    assert budget.updates_per_archive(4 * 8, 512) * budget.record_bytes_bound(4 * 8, 512) <= MAX_FILE_BYTES
    assert budget.updates_per_archive(32 * 8, 32768) == 0

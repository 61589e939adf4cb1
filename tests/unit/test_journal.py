"""The journal beside a bundle: entries scanned before they land, a torn tail dropped, an altered
line failing verify in one line, and `journal.jsonl#<seq>` references checked against its entries."""

from __future__ import annotations

from pathlib import Path

import pytest

from dppo_harness.evidence import EvidenceBundle, SecretLeakError
from dppo_harness.evidence.journal import JOURNAL_FILE, Journal
from dppo_harness.evidence.verify import verify_bundle

FAKE_KEY = "tml-FAKE-journal-canary-41c2"


def test_a_secret_in_a_journal_append_is_refused_before_it_lands(tmp_path: Path) -> None:
    b = EvidenceBundle.create(tmp_path, "run", env={"TINKER_API_KEY": FAKE_KEY})
    b.journal.append("comparison", "row", "step 0", {"loss": 1.0})
    before = (b.dir / JOURNAL_FILE).read_bytes()
    with pytest.raises(SecretLeakError, match="TINKER_API_KEY"):
        b.journal.append("comparison", "row", "step 1", {"note": f"key={FAKE_KEY}"})
    assert (b.dir / JOURNAL_FILE).read_bytes() == before and b.result["status"] == "failed"
    assert [e.label for e in Journal(b).entries()] == ["step 0"]


def test_a_torn_tail_is_dropped_and_an_altered_line_fails_verify_in_one_line(tmp_path: Path) -> None:
    b = EvidenceBundle.create(tmp_path, "run", env={})
    for step in range(3):
        b.journal.append("comparison", "row", f"step {step}", {"step": step})
    path = b.dir / JOURNAL_FILE
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # a kill mid-append: the last line torn
    assert verify_bundle(b.dir, env={}) == [] and len(Journal(b).entries()) == 2
    lines = whole.splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1].replace(b'"step":1', b'"step":9', 1)[:-3] + b"\n" + lines[2])
    (problem,) = verify_bundle(b.dir, env={})
    assert "\n" not in problem and f"{JOURNAL_FILE}: line 2 is not journal entry 2" in problem


def test_a_reference_to_a_journal_entry_verifies_when_the_entry_exists(tmp_path: Path) -> None:
    b = EvidenceBundle.create(tmp_path, "run", env={})
    ref = b.journal.append("comparison", "state", "s1", {"step": 1}).ref
    b.update_result(initialization_provenance={"dppo": {"initial_output": {"evidence_ref": ref}}})
    assert verify_bundle(b.dir, env={}) == []
    b.update_result(initialization_provenance={"dppo": {"initial_output": {"evidence_ref": f"{JOURNAL_FILE}#2"}}})
    assert verify_bundle(b.dir, env={}) == [
        f"initialization_provenance.dppo.initial_output.evidence_ref: references '{JOURNAL_FILE}#2', "
        "which is not a journal entry"
    ]


def test_two_journal_objects_of_one_bundle_keep_one_sequence(tmp_path: Path) -> None:
    b = EvidenceBundle.create(tmp_path, "run", env={})
    other = Journal(b)  # a stage that opens its own: the bundle's appends and its own interleave
    refs = [j.append("gate", "row", str(i)).ref for i, j in enumerate((b.journal, other, b.journal, other))]
    assert refs == [f"{JOURNAL_FILE}#{i}" for i in range(1, 5)]
    assert [e.label for e in b.journal.entries()] == ["0", "1", "2", "3"]


def test_a_well_formed_edit_breaks_the_chain_and_a_whole_bad_last_line_is_not_taken_for_torn(tmp_path: Path) -> None:
    b = EvidenceBundle.create(tmp_path, "run", env={})
    for step in range(3):
        b.journal.append("comparison", "state", f"s{step}", {"step": step})
    path = b.dir / JOURNAL_FILE
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1].replace(b'"step":1}', b'"step":7}', 1) + lines[2])  # still valid JSON
    (problem,) = verify_bundle(b.dir, env={})
    assert f"{JOURNAL_FILE}: line 3 is not journal entry 3" in problem and "chained" in problem
    path.write_bytes(lines[0] + lines[1] + lines[2][:-9] + b"\n")  # a whole last line, cut: not a torn append
    (problem,) = verify_bundle(b.dir, env={})
    assert "line 3 is not journal entry 3" in problem
    path.write_bytes(b"".join(lines))
    assert verify_bundle(b.dir, env={}) == [] and [e.data for e in Journal(b).entries()] == [
        {"step": s} for s in range(3)
    ]

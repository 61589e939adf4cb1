"""The evidence budget: needs computed from the plan, closing records reserved first, a plan that
cannot fit refused at load in one line before any client exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dppo_harness.evidence import EvidenceBundle, LimitError, budget
from dppo_harness.evidence.files import MAX_FILE_BYTES, MAX_FILES
from dppo_harness.plans import load_plan

ROOT = Path(__file__).resolve().parents[2]
DIAGNOSTIC_PLAN = ROOT / "plans" / "exp_e6b0965af3-diagnostic-r1.json"
SPEC_PLAN = ROOT / "plans" / "exp_e6b0965af3.json"
DIAGNOSTIC_STAGES = ("unit", "preflight", "diagnostic")
COMPARISON_STAGES = ("unit", "preflight", "gate", "comparison")


def test_the_shipped_diagnostic_fits_with_slack_and_its_archives_fit_one_file() -> None:
    needs = budget.plan_needs(load_plan(DIAGNOSTIC_PLAN), DIAGNOSTIC_STAGES)
    assert budget.refusal(needs, "diag") is None
    # required + every optional snapshot still leaves real slack under 64
    assert needs.required_files + needs.optional_files <= 48
    size = budget.DiagnosticSize(16, 4, 8, 512)
    assert budget.updates_per_archive(size) * budget.record_bytes_bound(size) <= MAX_FILE_BYTES
    assert budget.diagnostic_need(size).files == budget.DIAGNOSTIC_FIXED_FILES + 2  # 2 archives of 8 updates
    record = needs.as_record()
    assert record["required_files"] == needs.required_files and record["limit_files"] == MAX_FILES
    assert [s["stage"] for s in record["stages"]] == ["session", "preflight", "diagnostic"]
    json.dumps(record)


def test_needs_grow_with_updates_arms_saves_and_resumes() -> None:
    small = budget.DiagnosticSize(16, 4, 8, 512)
    big = budget.DiagnosticSize(160, 4, 8, 512)
    assert budget.diagnostic_need(big).files == budget.diagnostic_need(small).files + 18  # 20 archives, not 2
    two = budget.ComparisonSize(arms=2, steps=50, save_every=5)
    three = budget.ComparisonSize(arms=3, steps=50, save_every=5)
    assert budget.comparison_need(three).files == budget.comparison_need(two).files + 2  # predictions, restore
    assert budget.comparison_need(budget.ComparisonSize(2, 50, 1)).optional_files == 100
    resumed = budget.ComparisonSize(arms=2, steps=50, save_every=5, resumed=True)
    assert budget.comparison_need(resumed).files == budget.comparison_need(two).files + budget.RESUME_FILES
    # what the comparison keeps free after its last step, computed from its arms
    assert budget.comparison_reserve(2, 0) + len(budget.CLOSING_RECORDS) == 18
    assert budget.comparison_reserve(3, 3) + len(budget.CLOSING_RECORDS) == 22


def test_a_record_too_large_for_one_file_is_one_per_file_and_refused_by_bytes() -> None:
    huge = budget.DiagnosticSize(16, 32, 8, 32768)
    assert budget.updates_per_archive(huge) == 0
    line = budget.refusal(budget.session_needs(DIAGNOSTIC_STAGES, diagnostic=huge), "huge.json")
    assert line is not None and "MiB" in line and "\n" not in line


def test_refusal_names_the_numbers_in_one_line() -> None:
    size = budget.DiagnosticSize(400, 1, 2, 16)
    line = budget.refusal(budget.session_needs(DIAGNOSTIC_STAGES, diagnostic=size), "big.json")
    assert line is not None and "\n" not in line
    assert f"the bundle holds {MAX_FILES}" in line and "diagnostic" in line and "400 updates" in line
    assert budget.refusal(budget.session_needs(("unit",)), "unit.json") is None


def _closing_bundle(tmp_path: Path) -> EvidenceBundle:
    b = EvidenceBundle.create(tmp_path, "run")
    b.reserve_closing()
    return b


def test_the_closing_records_are_reserved_first(tmp_path: Path) -> None:
    b = _closing_bundle(tmp_path)
    reserved = len(budget.CLOSING_RECORDS)
    for i in range(MAX_FILES - reserved):
        b.register_bytes(f"f{i}.txt", "log", b"x%d" % i)
    assert b.free_slots() == 0
    with pytest.raises(LimitError, match="reserved for the closing records"):
        b.register_bytes("one-more.txt", "log", b"y")
    for name in budget.CLOSING_RECORDS:
        b.register_json(name, "log", {"name": name})
    assert len(b.files()) == MAX_FILES


def _run_pytest(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, "--evidence-dir", str(tmp_path / "evidence")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _diagnostic_with_updates(tmp_path: Path, epochs: int) -> Path:
    """The requester's plan, unchanged but for its epochs over the frozen batch (8 updates each)."""
    raw = json.loads(DIAGNOSTIC_PLAN.read_text())
    updates = epochs * raw["schedule"]["minibatches_per_epoch"]
    raw["schedule"]["epochs"] = epochs
    raw["schedule"]["max_optimizer_updates"] = updates
    work = raw["service_work"]
    for item in work["items"]:
        if item["stage"] == "diagnostic":
            work["max_total_optimizer_updates"] += updates - item["optimizer_updates"]
            item["optimizer_updates"] = updates
    path = tmp_path / f"diagnostic-{updates}-updates.json"
    path.write_text(json.dumps(raw, indent=2))
    return path


def test_more_updates_fit_in_archives_until_they_do_not(tmp_path: Path) -> None:
    """Today every update is its own file: 19 updates already pass 64 files. Archived, 24 fit."""
    fits = budget.plan_needs(load_plan(_diagnostic_with_updates(tmp_path, 3)), DIAGNOSTIC_STAGES)
    assert budget.refusal(fits, "24 updates") is None and fits.required_files + fits.optional_files <= 52
    over = budget.plan_needs(load_plan(_diagnostic_with_updates(tmp_path, 50)), DIAGNOSTIC_STAGES)
    assert over.required_files > MAX_FILES and budget.refusal(over, "400 updates") is not None


def test_an_overflowing_diagnostic_plan_is_refused_at_load_before_any_client(tmp_path: Path) -> None:
    """`pytest -m diagnostic --plan P` with the requester's plan at 400 updates: one line at load,
    no stage run, no server started, no bundle written."""
    big = _diagnostic_with_updates(tmp_path, 50)
    proc = _run_pytest(["-m", "diagnostic", "--plan", str(big)], tmp_path)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if "evidence budget" in ln]
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-2000:]
    assert len(lines) == 1 and "400 updates" in lines[0] and f"holds {MAX_FILES}" in lines[0], out[-2000:]
    assert "Traceback" not in out and "local server" not in out and "passed" not in out
    assert not (tmp_path / "evidence").exists()


def test_an_overflowing_diagnostic_plan_run_by_its_test_paths_is_refused_at_load(tmp_path: Path) -> None:
    """`pytest tests/preflight tests/diagnostic --plan P` (stages chosen by path, no -m): the same
    one line at load as with `-m diagnostic`, nothing run."""
    big = _diagnostic_with_updates(tmp_path, 50)
    proc = _run_pytest(["tests/preflight", "tests/diagnostic", "--plan", str(big)], tmp_path)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if "evidence budget" in ln]
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-2000:]
    assert len(lines) == 1 and "diagnostic 66" in lines[0] and "400 updates" in lines[0], out[-2000:]
    assert "Traceback" not in out and "passed" not in out and not (tmp_path / "evidence").exists()


def test_a_comparison_whose_gate_pilot_cannot_fit_is_refused_at_load(tmp_path: Path) -> None:
    """The saved spec with a 40-step gate pilot (one record file per pilot step) cannot fit."""
    text = SPEC_PLAN.read_text().replace("A 5-step pilot", "A 40-step pilot")
    spec = tmp_path / "spec-40-step-pilot.json"
    spec.write_text(text)
    resolution = json.loads(SPEC_PLAN.with_name(SPEC_PLAN.name + ".resolution.json").read_text())
    pilot = resolution["values"]["gate_pilot_steps"]
    pilot.update(value=40, sentence=pilot["sentence"].replace("A 5-step pilot", "A 40-step pilot"))
    spec.with_name(spec.name + ".resolution.json").write_text(json.dumps(resolution))
    needs = budget.plan_needs(load_plan(spec), COMPARISON_STAGES, save_every=5)
    assert needs.required_files > MAX_FILES
    proc = _run_pytest(["-m", "comparison", "--plan", str(spec)], tmp_path)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if "evidence budget" in ln]
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-2000:]
    assert len(lines) == 1 and "gate" in lines[0] and "40 pilot steps" in lines[0], out[-2000:]
    assert not (tmp_path / "evidence").exists()

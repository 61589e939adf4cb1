"""The diagnostic's requested evidence items: declared service work, journal snapshots, original gate report, validator CLI."""

import json
import os
from pathlib import Path

import pytest

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.evidence.journal import read_entries
from dppo_harness.loss import correctness, correctness_golden
from dppo_harness.plans import PlanError, load_plan
from dppo_harness.stages.diagnostic import write
from dppo_harness.stages.diagnostic.loop import RunState
from dppo_harness.stages.diagnostic.write import FEASIBILITY_SOURCE, ORIGINAL_GATE_REPORT_FILE

ROOT = Path(__file__).parents[2]
PLAN = load_plan(ROOT / "plans/exp_e6b0965af3-diagnostic-r1.json")


def test_plan_declares_every_probe_update_with_reason_and_count():
    sw = PLAN.raw["service_work"]
    ids = {i["id"]: i for i in sw["items"]}
    assert (
        ids["restore_continuity_probe"]["optimizer_updates"] == 3 and ids["lr_scaling_probe"]["optimizer_updates"] == 3
    )
    assert ids["feasibility_pilot"]["optimizer_updates"] == 0 and ids["feasibility_pilot"]["sampling_batches"] == 0
    assert ids["bounded_diagnostic"]["optimizer_updates"] == 16 and sw["max_total_sampling_batches"] == 1
    assert all(i["reason"] for i in sw["items"])


def test_plan_totals_must_match(tmp_path):
    raw = json.loads(PLAN.data)
    raw["service_work"]["max_total_optimizer_updates"] = 16
    f = tmp_path / "p.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="max_total_optimizer_updates"):
        load_plan(f)


def test_service_work_ledger_flags_undeclared_and_excess_work():
    ok = write.service_work_ledger(
        PLAN.diagnostic.service_work,
        {
            "restore_continuity_probe": {"optimizer_updates": 3},
            "lr_scaling_probe": {"optimizer_updates": 3},
            "bounded_diagnostic": {"optimizer_updates": 16, "sampling_batches": 1},
        },
    )
    assert ok["within_declaration"] and ok["executed_totals"] == {"optimizer_updates": 22, "sampling_batches": 1}
    # The old behaviour: a feasibility pilot with 2 updates and 16 rollouts under the diagnostic plan.
    bad = write.service_work_ledger(
        PLAN.diagnostic.service_work,
        {
            "feasibility_pilot": {"optimizer_updates": 2, "sampling_batches": 1},
            "bounded_diagnostic": {"optimizer_updates": 16, "sampling_batches": 1},
        },
    )
    assert not bad["within_declaration"] and any("feasibility_pilot" in p for p in bad["problems"])
    assert any(
        "undeclared_probe" in p
        for p in write.service_work_ledger(
            PLAN.diagnostic.service_work, {"undeclared_probe": {"optimizer_updates": 1}}
        )["problems"]
    )
    # The ledger's declared rows are the plan's items as the plan file states them.
    assert [r["declared"] for r in ok["items"]] == PLAN.raw["service_work"]["items"]


def test_original_gate_report_is_a_real_file_saying_unavailable():
    r = write.original_gate_report(PLAN.diagnostic)
    assert r["available"] is False and "run_19badd842c" in r["reason"] and r["overwritten"] is False
    reasons = " ".join(d["reason"] for d in PLAN.raw["deviations"])
    assert "kept separately" not in reasons and ORIGINAL_GATE_REPORT_FILE in reasons


def test_feasibility_from_the_diagnostics_own_measurements():
    state = RunState(restore_seconds=5.0, sampling_seconds=60.0, sampled_sequences=256, update_seconds=[10.0] * 16)
    f = write.diagnostic_feasibility(PLAN.diagnostic, state, {}, "x")
    m = f["measurements"]
    assert m["training"]["seconds"] == 220.0 and m["training"]["units"] == 16 and m["training"]["samples"] == 768
    assert m["evaluation"]["planned_units"] == 0 and f["source"] == FEASIBILITY_SOURCE


def test_snapshots_are_numbered_journal_entries_that_keep_earlier_numbers_and_take_no_file(tmp_path):
    b = EvidenceBundle.create(tmp_path, "s", env={})
    b.update_result(metrics={"diagnostic/updates_done": 4.0})
    assert b.journal.snapshot("diagnostic", "after 4").ref == "journal.jsonl#1"
    b.update_result(metrics={"diagnostic/updates_done": 8.0})
    assert b.journal.snapshot("diagnostic", "after 8").ref == "journal.jsonl#2"
    first, second = read_entries(b.dir / "journal.jsonl")  # as a reader after a kill sees them
    assert first.data["metrics"]["diagnostic/updates_done"] == 4.0  # unchanged by later updates
    assert second.data["metrics"]["diagnostic/updates_done"] == 8.0 and b.files() == []


@pytest.mark.integration  # a CLI in a subprocess: the default run, not unit parity
def test_validator_cli_exit_code():
    report = correctness_golden.check_golden(ROOT / "tests/fixtures/dppo_golden_v1.json", modes=("float64",))
    block = correctness.build_preflight_block(
        report, PLAN.raw and json.loads((ROOT / "plans/exp_e6b0965af3.json").read_text())
    )
    spec = (ROOT / "plans/exp_e6b0965af3.json").read_bytes()
    assert correctness.run_validator_cli(spec, block)["exit_code"] == 0
    block["paths"][0]["errors"] = {}
    out = correctness.run_validator_cli(spec, block)
    assert out["exit_code"] != 0 and "FAIL" in out["stdout"]


@pytest.mark.integration
def test_the_validator_subprocess_gets_no_credential(monkeypatch):
    """The validator reads two files: no credential of the harness's environment reaches it."""
    import subprocess

    planted = {
        "TINKER_API_KEY": "tml-planted-validator-key-0001",
        "HF_TOKEN": "hf_planted_validator_token_0001",
        "MODAL_PROXY_TOKEN_SECRET": "planted-modal-secret-0001",
        "AWS_SECRET_ACCESS_KEY": "planted/aws/0001",
    }
    for k, v in planted.items():
        monkeypatch.setenv(k, v)
    seen: list[dict] = []
    real_run = subprocess.run

    def run(*args, **kwargs):
        seen.append(dict(kwargs.get("env") if kwargs.get("env") is not None else os.environ))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    report = correctness_golden.check_golden(ROOT / "tests/fixtures/dppo_golden_v1.json", modes=("float64",))
    spec = (ROOT / "plans/exp_e6b0965af3.json").read_bytes()
    block = correctness.build_preflight_block(report, json.loads(spec))
    assert correctness.run_validator_cli(spec, block)["exit_code"] == 0  # it still validates
    assert len(seen) == 1 and not set(planted) & set(seen[0]) and "PATH" in seen[0]
    assert not any(v in json.dumps(seen[0]) for v in planted.values())

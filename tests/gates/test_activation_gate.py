"""Stage `gate`: the original spec's activation gate (5-step treatment pilot, 2 updates per batch).

On the embedded backend `executed_base_model` is the stand-in model's name, so the gate fails
that check there, as it must; the comparison stage is then blocked.
"""

import json

import pytest

from dppo_harness import gate
from dppo_harness.evidence import ImmutableNameError


def test_gate_report_is_its_own_immutable_evidence_file(gate_report, evidence_bundle):
    entry = evidence_bundle.entry(gate.GATE_REPORT_FILE)
    assert entry is not None and entry["kind"] == "report"
    on_disk = json.loads(evidence_bundle.file_path(gate.GATE_REPORT_FILE).read_text())
    assert on_disk["passed"] == gate_report.passed
    assert [c["metric"] for c in on_disk["checks"]] == [c.metric for c in gate_report.checks]
    with pytest.raises(ImmutableNameError):
        evidence_bundle.register_json(gate.GATE_REPORT_FILE, "report", {**on_disk, "passed": not on_disk["passed"]})
    calibration = evidence_bundle.result["activation_calibration"]
    assert set(calibration["values"]) == {c.metric for c in gate_report.checks} and calibration["note"]
    # Every pilot step that sampled says how many responses stopped at max_tokens or had no answer.
    sampled = [r for r in on_disk["per_step"] if r["optim_steps"]]
    assert sampled and all({"truncated_frac", "no_answer_frac", "mean_response_tokens"} <= set(r) for r in sampled)
    y = on_disk["pilot"]["rollout_yield"]
    assert y["max_tokens"] == on_disk["pilot"]["max_tokens"] and y["n"] == sum(r["responses"] for r in sampled)


def test_activation_gate_passes(gate_report):
    assert gate_report.passed, "activation gate failed:\n  " + "\n  ".join(gate_report.failures())

"""Stage `gate`: the plan's activation gate (the pilot its gate states, of its treatment arm).

On the embedded backend `executed_base_model` is the stand-in model's name, so the gate fails
that check there, as it must; the comparison stage is then blocked.
"""

import json

import pytest

from dppo_harness.evidence import ImmutableNameError
from dppo_harness.stages import write


def test_gate_report_is_its_own_immutable_evidence_file(gate_report, evidence_bundle, plan):
    """The report of the plan's one treatment arm."""
    (treatment,) = plan.spec_plan.run.treatments
    assert gate_report.pilot["arm"] == treatment.name
    name = write.GATE_REPORT_FILE
    entry = evidence_bundle.entry(name)
    assert entry is not None and entry["kind"] == "report"
    on_disk = json.loads(evidence_bundle.file_path(name).read_text())
    assert on_disk["passed"] == gate_report.passed and on_disk["pilot"]["arm"] == treatment.name
    assert [c["metric"] for c in on_disk["checks"]] == [c.metric for c in gate_report.checks]
    assert [c["metric"] for c in on_disk["checks"]] == [c.metric for c in plan.spec_plan.run.gate_checks]
    with pytest.raises(ImmutableNameError):
        evidence_bundle.register_json(name, "report", {**on_disk, "passed": not on_disk["passed"]})
    # Every pilot step that sampled says how many responses stopped at max_tokens or had no answer.
    sampled = [r for r in on_disk["per_step"] if r["optim_steps"]]
    assert sampled and all({"truncated_frac", "no_answer_frac", "mean_response_tokens"} <= set(r) for r in sampled)
    y = on_disk["pilot"]["rollout_yield"]
    assert y["max_tokens"] == on_disk["pilot"]["max_tokens"] and y["n"] == sum(r["responses"] for r in sampled)
    assert on_disk["pilot"]["loaded_checkpoint"] == on_disk["pilot"]["initial_checkpoint"]
    calibration = evidence_bundle.result["activation_calibration"]
    assert set(calibration["values"]) == {c.metric for c in gate_report.checks} and calibration["note"]


def test_activation_gate_passes(gate_report):
    assert gate_report.passed, "activation gate failed:\n  " + "\n  ".join(gate_report.failures())

"""Stage `gate`: the plan's activation gate (the pilot its gate states, of each treatment arm).

On the embedded backend `executed_base_model` is the stand-in model's name, so the gate fails
that check there, as it must; the comparison stage is then blocked.
"""

import json

import pytest

from dppo_harness.evidence import ImmutableNameError
from dppo_harness.stages import gate


def test_gate_report_is_its_own_immutable_evidence_file(gate_report, evidence_bundle, plan):
    """One report per piloted treatment arm (the plan's treatments, in spec order)."""
    reports = getattr(gate_report, "reports", (gate_report,))
    assert [r.pilot["arm"] for r in reports] == [a.name for a in plan.spec_plan.run.treatments]
    for report in reports:
        name = gate.report_file(plan.spec_plan.run, report.pilot["arm"])
        entry = evidence_bundle.entry(name)
        assert entry is not None and entry["kind"] == "report"
        on_disk = json.loads(evidence_bundle.file_path(name).read_text())
        assert on_disk["passed"] == report.passed and on_disk["pilot"]["arm"] == report.pilot["arm"]
        assert [c["metric"] for c in on_disk["checks"]] == [c.metric for c in report.checks]
        assert [c["metric"] for c in on_disk["checks"]] == [c.metric for c in plan.spec_plan.run.gate_checks]
        with pytest.raises(ImmutableNameError):
            evidence_bundle.register_json(name, "report", {**on_disk, "passed": not on_disk["passed"]})
        # Every pilot step that sampled says how many responses stopped at max_tokens or had no answer.
        sampled = [r for r in on_disk["per_step"] if r["optim_steps"]]
        assert sampled and all({"truncated_frac", "no_answer_frac", "mean_response_tokens"} <= set(r) for r in sampled)
        y = on_disk["pilot"]["rollout_yield"]
        assert y["max_tokens"] == on_disk["pilot"]["max_tokens"] and y["n"] == sum(r["responses"] for r in sampled)
    calibration = evidence_bundle.result["activation_calibration"]
    assert set(calibration["values"]) == {c.metric for c in reports[0].checks} and calibration["note"]


def test_activation_gate_passes(gate_report):
    assert gate_report.passed, "activation gate failed:\n  " + "\n  ".join(gate_report.failures())

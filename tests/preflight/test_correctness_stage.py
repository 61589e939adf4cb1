"""Stage `preflight`: the correctness preflight (golden parity of the custom loss path) with the
LR-scaling probe of the restoration preflight, written as `correctness_preflight`."""

from __future__ import annotations

import json
from pathlib import Path

from dppo_harness import correctness
from dppo_harness import restoration as R
from dppo_harness.progress import Watchdog

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "dppo_golden_v1.json"


def test_correctness_preflight_passes_and_is_recorded(restoration, spec_plan, evidence_bundle, harness_progress):
    with Watchdog(harness_progress, every_s=10.0) as watch:
        report = correctness.check_golden(GOLDEN, tolerances=correctness.spec_tolerances(spec_plan.raw),
                                          progress=watch.say)
    block = R.attach_lr_scaling(correctness.build_preflight_block(report, spec_plan.raw), restoration.lr_scaling)
    status, messages = correctness.validate_preflight(spec_plan.raw, block)
    evidence_bundle.register_file(GOLDEN.name, "tensors", GOLDEN)
    evidence_bundle.register_json("correctness-golden-report.json", "metrics", report.to_json())
    evidence_bundle.register_json("correctness-preflight.json", "metrics",
                                  {"status": status, "messages": messages, "correctness_preflight": block})
    evidence_bundle.update_result(correctness_preflight=block)
    assert report.n_failed == 0, "\n".join(r.line() for r in report.results if not r.passed)
    assert status == "passed", "\n".join(messages)
    assert evidence_bundle.result["correctness_preflight"] == json.loads(json.dumps(block))


def test_correctness_validator_exit_code_is_recorded(spec_plan, evidence_bundle, harness_progress):
    """Issue 11 point 8: the brief's validator runs on the written preflight; its exit code is evidence."""
    block = evidence_bundle.result["correctness_preflight"]
    assert block, "the correctness preflight was not written"
    with Watchdog(harness_progress, every_s=10.0) as watch:
        watch.say("[preflight] correctness: running `python -m dppo_harness.correctness validate` on the written block")
        out = correctness.run_validator_cli(spec_plan.data, block)
        watch.say(f"[preflight] correctness: validator exit code {out['exit_code']}")
    evidence_bundle.register_json("correctness-validator.json", "report", out)
    evidence_bundle.update_result(metrics={"correctness/validator_exit_code": float(out["exit_code"])})
    assert out["exit_code"] == 0, out["stdout"] + out["stderr"]

"""Stage `preflight`: the correctness preflight (golden parity of the custom loss path) with the
LR-scaling probe of the restoration preflight, written as `correctness_preflight`, and the
registry parity of every loss the plan's arms train."""

from __future__ import annotations

import json
from pathlib import Path

from dppo_harness import correctness
from dppo_harness import restoration as R
from dppo_harness.progress import Watchdog

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "dppo_golden_v1.json"


def test_correctness_preflight_passes_and_is_recorded(restoration, plan, evidence_bundle, harness_progress):
    spec = plan.spec_json()
    with Watchdog(harness_progress, every_s=10.0) as watch:
        report = correctness.check_golden(GOLDEN, tolerances=correctness.spec_tolerances(spec), progress=watch.say)
    block = R.attach_lr_scaling(correctness.build_preflight_block(report, spec), restoration.lr_scaling)
    status, messages = correctness.validate_preflight(spec, block)
    # Each arm's registered loss: its numpy reference reproduces its golden cases, and the packed
    # path it trains with matches the reference.
    parity = [correctness.registered_loss_parity(n, ROOT) for n in sorted({a.loss for a in plan.spec_plan.run.arms})]
    evidence_bundle.register_file(GOLDEN.name, "tensors", GOLDEN)
    evidence_bundle.register_json("correctness-golden-report.json", "metrics", {**report.to_json(), "loss_registry_parity": {
        "tolerance": correctness.REGISTRY_TOLERANCE,
        "losses": [{"loss": r.loss, "cases": r.cases, "passed": r.passed, "failures": list(r.failures)} for r in parity]}})
    evidence_bundle.register_json("correctness-preflight.json", "metrics",
                                  {"status": status, "messages": messages, "correctness_preflight": block})
    evidence_bundle.update_result(correctness_preflight=block)
    assert report.n_failed == 0, "\n".join(r.line() for r in report.results if not r.passed)
    assert all(r.passed for r in parity), [f for r in parity for f in r.failures] or [r.loss for r in parity]
    assert status == "passed", "\n".join(messages)
    assert evidence_bundle.result["correctness_preflight"] == json.loads(json.dumps(block))


def test_correctness_validator_exit_code_is_recorded(plan, evidence_bundle, harness_progress):
    """Issue 11 point 8: the brief's validator runs on the written preflight; its exit code is evidence."""
    block = evidence_bundle.result["correctness_preflight"]
    assert block, "the correctness preflight was not written"
    with Watchdog(harness_progress, every_s=10.0) as watch:
        watch.say("[preflight] correctness: running `python -m dppo_harness.correctness validate` on the written block")
        out = correctness.run_validator_cli(plan.spec_plan.spec_bytes, block)
        watch.say(f"[preflight] correctness: validator exit code {out['exit_code']}")
    evidence_bundle.register_json("correctness-validator.json", "report", out)
    evidence_bundle.update_result(metrics={"correctness/validator_exit_code": float(out["exit_code"])})
    assert out["exit_code"] == 0, out["stdout"] + out["stderr"]

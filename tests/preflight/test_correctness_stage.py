"""Stage `preflight`: the correctness preflight (golden parity of the custom loss path) with the
LR-scaling probe of the restoration preflight, written as `correctness_preflight`, and the
registry parity of every loss the plan's arms train."""

from __future__ import annotations

import json
from pathlib import Path

from dppo_harness.evidence.progress import Watchdog
from dppo_harness.loss import correctness
from dppo_harness.stages import write
from dppo_harness.stages.correctness_preflight import run_correctness_preflight

ROOT = Path(__file__).resolve().parents[2]


def test_correctness_preflight_passes_and_is_recorded(restoration, plan, evidence_bundle, harness_progress):
    trained = {arm.loss for arm in plan.spec_plan.run.arms}
    with Watchdog(harness_progress, every_s=10.0) as watch:
        outcome = run_correctness_preflight(
            plan.spec_plan.spec, restoration.lr_scaling, trained, ROOT, progress=watch.say
        )
    write.write_correctness(evidence_bundle, outcome)
    assert outcome.passed, "\n".join(outcome.failures())
    assert evidence_bundle.result["correctness_preflight"] == json.loads(json.dumps(outcome.block))


def test_correctness_validator_exit_code_is_recorded(plan, evidence_bundle, harness_progress):
    """The brief's validator runs on the written preflight; its exit code is evidence."""
    block = evidence_bundle.result["correctness_preflight"]
    assert block, "the correctness preflight was not written"
    with Watchdog(harness_progress, every_s=10.0) as watch:
        watch.say(
            "[preflight] correctness: running `python -m dppo_harness.loss.correctness validate` on the written block"
        )
        out = correctness.run_validator_cli(plan.spec_plan.spec_bytes, block)
        watch.say(f"[preflight] correctness: validator exit code {out['exit_code']}")
    write.write_correctness_validator(evidence_bundle, out, int(out["exit_code"]))
    assert out["exit_code"] == 0, out["stdout"] + out["stderr"]

"""`run_correctness_preflight`: passes on the shared golden file and the plan's spec, records the
same block the steps give one by one, and fails on a tampered golden value, a mutated DPPO rule,
a missing registry golden file and an LR probe the spec cannot accept."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from dppo_harness.loss import correctness, correctness_golden, loss_registry, losses
from dppo_harness.stages.correctness_preflight import GOLDEN_FIXTURE, run_correctness_preflight
from dppo_harness.stages.restoration import LrScalingMeasured, LrScalingUnavailable, attach_lr_scaling

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / GOLDEN_FIXTURE
SPEC = json.loads((ROOT / "plans" / "exp_e6b0965af3.json").read_text())
TRAINED = (loss_registry.GRPO_LOSS, loss_registry.DPPO_LOSS)
UNMEASURED = LrScalingUnavailable("backend reports no update norms", [1e-5, 2e-5])


def _tampered_golden(tmp_path: Path) -> Path:
    raw = json.loads(GOLDEN.read_text())
    case = next(c for c in raw["cases"] if c["name"] == "zero_and_mixed_advantages")
    case["dppo"]["loss"] += 1e-3
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps(raw))
    return bad


def test_passes_on_the_shared_golden_file_and_records_the_steps_block():
    outcome = run_correctness_preflight(SPEC, UNMEASURED, TRAINED, ROOT)
    assert outcome.passed and outcome.failures() == [], outcome.failures()
    assert outcome.golden == GOLDEN and outcome.status == "passed"
    assert [p.loss for p in outcome.parity] == sorted(TRAINED) and all(p.cases > 0 for p in outcome.parity)
    # The same block as golden parity -> preflight block -> LR probe attached, step by step.
    report = correctness_golden.check_golden(GOLDEN, tolerances=correctness.spec_tolerances(SPEC))
    assert outcome.block == attach_lr_scaling(correctness.build_preflight_block(report, SPEC), UNMEASURED)
    assert outcome.report.to_json() == report.to_json()
    assert (outcome.status, list(outcome.messages)) == correctness.validate_preflight(SPEC, outcome.block)
    (path,) = outcome.block["paths"]
    assert [e["learning_rate"] for e in path["lr_scaling"]] == UNMEASURED.learning_rates
    assert all(e["available"] is False and e["update_norm"] is None for e in path["lr_scaling"])
    pre = json.loads(json.dumps(outcome.preflight_json()))
    assert set(pre) == {"status", "messages", "correctness_preflight"} and pre["correctness_preflight"] == outcome.block
    gold = json.loads(json.dumps(outcome.golden_report_json()))
    assert gold["failed"] == 0 and gold["passed"] == len(report.results)
    assert gold["loss_registry_parity"]["tolerance"] == correctness_golden.REGISTRY_TOLERANCE
    assert [e["loss"] for e in gold["loss_registry_parity"]["losses"]] == sorted(TRAINED)


def test_fails_on_a_tampered_golden_value(tmp_path):
    outcome = run_correctness_preflight(
        SPEC, UNMEASURED, TRAINED, ROOT, golden=_tampered_golden(tmp_path), modes=("float64",)
    )
    assert not outcome.passed
    assert outcome.report.n_failed > 0
    assert any(line.startswith("FAIL zero_and_mixed_advantages [float64]") for line in outcome.failures())
    # The worst-case error recorded in the block is the failing one, so the validator fails it too.
    assert outcome.status == "failed" and "validator: failed" in outcome.failures()
    assert outcome.golden_report_json()["failed"] == outcome.report.n_failed


def test_fails_on_a_mutated_dppo_rule(monkeypatch):
    original = losses.token_terms

    def symmetric_drop(logprobs_N, sampler_logprobs_N, advantages_N, mask_N, cfg):
        # |p - q| > delta drops tokens of either advantage sign: the rule's direction is lost.
        terms = original(logprobs_N, sampler_logprobs_N, advantages_N, mask_N, cfg)
        return dataclasses.replace(terms, dppo_keep_N=terms.loss_token_N & ~(terms.prob_diff_N.abs() > cfg.dppo_delta))

    monkeypatch.setattr(losses, "token_terms", symmetric_drop)
    outcome = run_correctness_preflight(SPEC, UNMEASURED, TRAINED, ROOT, modes=("float64",))
    assert not outcome.passed
    assert any(line.startswith("FAIL recovery_direction") for line in outcome.failures())
    dppo_parity = next(p for p in outcome.parity if p.loss == loss_registry.DPPO_LOSS)
    assert not dppo_parity.passed and any("packed" in f for f in dppo_parity.failures)


def test_fails_when_a_trained_loss_has_no_golden_cases(tmp_path):
    outcome = run_correctness_preflight(SPEC, UNMEASURED, TRAINED, tmp_path, golden=GOLDEN, modes=("float64",))
    assert outcome.report.n_failed == 0 and outcome.status == "passed"  # golden parity itself passes
    assert not outcome.passed
    assert all(not p.passed and p.cases == 0 for p in outcome.parity)
    assert any("unreadable" in line for line in outcome.failures())


def test_fails_when_the_spec_sets_an_lr_tolerance_the_probe_could_not_meet():
    spec = copy.deepcopy(SPEC)
    spec["correctness_preflight"]["paths"][0]["tolerances"]["lr_scaling"] = {"max_relative_error": 0.05}
    unmeasured = run_correctness_preflight(spec, UNMEASURED, TRAINED, ROOT, modes=("float64",))
    assert unmeasured.report.n_failed == 0 and not unmeasured.passed and unmeasured.status == "failed"
    assert any("lr_scaling unavailable" in line for line in unmeasured.failures())
    off = LrScalingMeasured(
        lr_scaling=[{"learning_rate": 1e-5, "update_norm": 2.0}, {"learning_rate": 2e-5, "update_norm": 3.0}]
    )
    assert not run_correctness_preflight(spec, off, TRAINED, ROOT, modes=("float64",)).passed
    good = LrScalingMeasured(
        lr_scaling=[{"learning_rate": 1e-5, "update_norm": 2.0}, {"learning_rate": 2e-5, "update_norm": 4.02}]
    )
    assert run_correctness_preflight(spec, good, TRAINED, ROOT, modes=("float64",)).passed


def test_a_spec_without_the_path_names_it():
    with pytest.raises(ValueError, match="grpo_dppo_custom_loss"):
        run_correctness_preflight({"correctness_preflight": {"required": True, "paths": []}}, UNMEASURED, TRAINED, ROOT)

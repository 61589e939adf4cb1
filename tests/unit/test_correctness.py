"""Independent padded implementation, golden parity through real Datums, preflight block, CLIs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dppo_harness.json_types import as_object
from dppo_harness.loss import correctness as cx
from dppo_harness.loss import correctness_golden, golden, references
from dppo_harness.loss.loss_registry import DPPO_LOSS, get_loss

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "dppo_golden_v1.json"
SPEC = {
    "correctness_preflight": {
        "required": True,
        "paths": [
            {
                "id": "grpo_dppo_custom_loss",
                "kind": "loss",
                "tolerances": copy.deepcopy(golden.DEFAULT_TOLERANCES),
            }
        ],
    }
}
_, CASES = golden.load_golden(GOLDEN)
DPPO_PARAMS = get_loss(DPPO_LOSS).params  # delta: the plan's, as the golden file was generated at


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_independent_reference_reproduces_golden_in_float64(case):
    r = references.ref_dppo(case.lp_BT, case.mu_BT, case.adv_BT, case.mask_BT, "token_mean", **DPPO_PARAMS)
    assert np.array_equal(r.decision_BT, case.dppo_mask_BT > 0)
    assert r.loss == pytest.approx(case.dppo_loss, rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(r.grad_BT, case.dppo_grad_BT, rtol=1e-12, atol=1e-15)
    v = references.ref_ppo(
        case.lp_BT, case.mu_BT, case.adv_BT, case.mask_BT, "token_mean", log_ratio_clamp=20.0, dual_clip_c=1e4
    )
    assert v.loss == pytest.approx(case.grpo_loss, rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(v.grad_BT, case.grpo_grad_BT, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", golden.MODES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_packed_path_parity_every_case_every_mode(case, mode):
    res = correctness_golden.check_case(case, mode)
    assert res.passed, res.line()
    names = {s.name for s in res.subchecks}
    assert {"dppo", "grpo_baseline"} <= names
    if mode == "float64":
        dppo = next(s for s in res.subchecks if s.name == "dppo")
        assert dppo.detail.endswith("vs golden")  # exact inputs: compared to golden, never to our reference
        err = dppo.errors["reference_gradient"]
        assert err["max_abs_error"] <= 1e-12 * max(err["reference_max_abs"], 1.0)


def test_packing_has_prompt_junk_varied_lengths_and_an_empty_row():
    case = next(c for c in CASES if c.name == "padding")
    packed = correctness_golden.pack_case(case)
    assert len(set(packed.prompt_lens)) > 1
    assert 0 in packed.response_lens  # the fully padded row becomes a prompt-only datum
    for p, mask, adv in zip(packed.prompt_lens, packed.mask_T, packed.adv_T):
        assert not mask[: p - 1].any() and np.all(adv[: p - 1] != 0)
    datums = correctness_golden.to_datums(packed)
    assert all(d.model_input.length == len(m) for d, m in zip(datums, packed.mask_T))


def test_parity_errors_and_acceptance_rule():
    e = golden.parity_errors([1.0, 2.0], [1.0, 2.0])
    assert e == {
        "max_abs_error": 0.0,
        "reference_max_abs": 2.0,
        "relative_l2_error": 0.0,
        "cosine_similarity": pytest.approx(1.0),
    }
    z = golden.parity_errors([0.0, 0.0], [0.0, 0.0])
    assert z["relative_l2_error"] is None and z["cosine_similarity"] is None
    tol = {"atol": 1e-5, "rtol": 1e-3, "min_cosine": 0.9999}
    assert golden.errors_pass(golden.parity_errors([1.0 + 1.0e-3], [1.0]), tol)[0]  # 1e-3 <= 1e-5 + 1e-3 * 1
    assert not golden.errors_pass(golden.parity_errors([1.0 + 1.02e-3], [1.0]), {"atol": 1e-5, "rtol": 1e-3})[0]
    assert not golden.errors_pass(
        golden.parity_errors([1.0, -1.0], [1.0, 1.0]), {"atol": 10.0, "rtol": 0.0, "min_cosine": 0.9999}
    )[0]
    assert not golden.errors_pass(golden.parity_errors([1e-6, 0.0], [0.0, 0.0]), tol)[0]  # zero reference: no cosine


def test_measures_json_is_parity_errors_as_written():
    """The preflight block writes each ErrorMeasures record with the same keys, order and values."""
    for got, want in (([1.0, 2.0], [1.0, 2.5]), ([0.0], [0.0])):
        e = golden.parity_errors(got, want)
        assert list(as_object(e).items()) == list(e.items())


def test_validate_tolerances_are_numbers():
    path = {"id": "grpo_dppo_custom_loss", "tolerances": {"loss": {"atol": 1}}}
    spec = {"correctness_preflight": {"required": True, "paths": [path]}}
    assert cx.spec_tolerances(spec) == {"loss": {"atol": 1}}
    spec["correctness_preflight"]["paths"][0]["tolerances"]["loss"]["atol"] = "1e-5"
    with pytest.raises(ValueError, match="tolerance atol: expected a number"):
        cx.spec_tolerances(spec)


def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dppo_harness.loss.correctness", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


@pytest.mark.integration  # a CLI in a subprocess: the default run, not unit parity
def test_check_golden_cli_passes_on_the_shared_file(tmp_path):
    out = tmp_path / "report.json"
    r = _run_cli("check-golden", str(GOLDEN), "--json", str(out))
    lines = r.stdout.strip().splitlines()
    n = len(CASES) * len(golden.MODES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert lines[-1] == f"{n} passed, 0 failed"
    assert len(lines) == n + 1 and all(line.startswith("PASS ") for line in lines[:-1])
    assert json.loads(out.read_text())["failed"] == 0


@pytest.mark.parametrize(
    "path,delta",
    [
        (("dppo", "grad_log_prob", 0, 1), 1e-3),
        pytest.param(("dppo", "loss"), 1e-3, marks=pytest.mark.integration),  # the subprocess CLI
        (("dppo", "mask", 1, 2), "flip"),
        (("grpo_no_dual_clip", "grad_log_prob", 0, 0), 1e-3),
    ],
)
def test_check_golden_cli_fails_on_tampered_expected_values(tmp_path, path, delta, capsys):
    raw = json.loads(GOLDEN.read_text())
    case = next(c for c in raw["cases"] if c["name"] == "zero_and_mixed_advantages")
    obj = case
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = (1.0 - obj[path[-1]]) if delta == "flip" else obj[path[-1]] + delta
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps(raw))
    if path[-1] == "loss":  # one variant through the real subprocess CLI, the rest in-process
        r = _run_cli("check-golden", str(bad), "--modes", "float64")
    else:
        rc = cx.main(["check-golden", str(bad), "--modes", "float64"])
        r = subprocess.CompletedProcess([], rc, capsys.readouterr().out, "")
    last = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 1
    assert last.endswith("failed") and not last.endswith(" 0 failed"), r.stdout
    assert any(line.startswith("FAIL zero_and_mixed_advantages") for line in r.stdout.splitlines())


def test_bad_case_data_gives_a_failed_line_not_a_crash(tmp_path, capsys):
    raw = json.loads(GOLDEN.read_text())
    raw["cases"][0]["log_prob"][0][0] = float("nan")  # on a loss token
    f = tmp_path / "nan.json"
    f.write_text(json.dumps(raw))
    assert cx.main(["check-golden", str(f), "--modes", "float64,float32"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("FAIL basic_both_signs [float64]") and "non-finite current logprob" in lines[0]
    assert lines[-1] == f"{2 * len(CASES) - 2} passed, 2 failed"


def test_check_golden_accepts_any_file_in_the_schema(tmp_path):
    raw = json.loads(GOLDEN.read_text())
    raw["cases"] = list(reversed(raw["cases"][2:5]))
    f = tmp_path / "subset.json"
    f.write_text(json.dumps(raw))
    report = correctness_golden.check_golden(f)
    assert report.n_failed == 0 and len(report.results) == 3 * len(golden.MODES)


def test_malformed_golden_file_names_the_problem(tmp_path, capsys):
    raw = json.loads(GOLDEN.read_text())
    del raw["cases"][1]["dppo"]["grad_log_prob"]
    f = tmp_path / "broken.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(golden.GoldenError, match="zero_and_mixed_advantages.*dppo.grad_log_prob"):
        golden.load_golden(f)
    assert cx.main(["check-golden", str(f)]) == 1
    captured = capsys.readouterr()
    assert "dppo.grad_log_prob" in captured.err and captured.out.strip().endswith("0 passed, 1 failed")
    raw["schema"] = "other"
    f.write_text(json.dumps(raw))
    with pytest.raises(golden.GoldenError, match="schema"):
        golden.load_golden(f)


@pytest.fixture(scope="module")
def good_block():
    return cx.build_preflight_block(correctness_golden.check_golden(GOLDEN, modes=("float64", "float32")), SPEC)


def test_preflight_block_has_the_briefs_shape(good_block):
    assert set(good_block) == {"required", "paths"} and good_block["required"] is True
    (p,) = good_block["paths"]
    assert set(p) == {
        "id",
        "fixed_input",
        "baseline_revision",
        "reference_revision",
        "implementation_revision",
        "precision",
        "normalization",
        "errors",
        "lr_scaling",
    }
    assert p["id"] == "grpo_dppo_custom_loss" and p["lr_scaling"] == []
    assert p["fixed_input"]["sha256"] == golden.file_sha256(GOLDEN)
    assert p["implementation_revision"] == cx.implementation_revision()
    assert set(p["errors"]) == set(golden.CHECK_NAMES)
    for e in p["errors"].values():
        assert set(e) == {"max_abs_error", "reference_max_abs", "relative_l2_error", "cosine_similarity"}


def _validate(tmp_path, spec, block, capsys=None):
    """Subprocess CLI when capsys is None, else the same entry point in-process (fast)."""
    s, b = tmp_path / "spec.json", tmp_path / "pre.json"
    s.write_text(json.dumps(spec))
    b.write_text(json.dumps(block))
    if capsys is None:
        return _run_cli("validate", str(s), str(b))
    rc = cx.main(["validate", str(s), str(b)])
    return subprocess.CompletedProcess([], rc, capsys.readouterr().out, "")


def test_validate_cli_passes_on_good_block_and_plan_spec(tmp_path, good_block):
    r = _validate(tmp_path, SPEC, good_block)
    assert r.returncode == 0 and r.stdout.strip().endswith("passed"), r.stdout
    plan = ROOT / "plans" / "exp_e6b0965af3.json"
    if plan.exists():
        b = tmp_path / "pre2.json"
        b.write_text(json.dumps({"status": "running", "correctness_preflight": good_block}))
        r = _run_cli("validate", str(plan), str(b))
        assert r.returncode == 0, r.stdout


def _mutated(block, fn):
    b = copy.deepcopy(block)
    fn(b["paths"][0])
    return b


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p["errors"].pop("reference_gradient"),
        lambda p: p["errors"]["baseline_loss"].update(max_abs_error=1.0, reference_max_abs=1.0),
        lambda p: p["errors"]["reference_gradient"].update(cosine_similarity=0.99),
        lambda p: p["errors"]["baseline_gradient"].update(cosine_similarity=None),
        lambda p: p["errors"]["reference_loss"].update(max_abs_error="0"),
        lambda p: p.update(reference_revision="UNRESOLVED: pin it"),
        lambda p: p["fixed_input"].update(sha256="abc"),
        lambda p: p.update(id="other_path"),
        lambda p: p.update(lr_scaling=[{"learning_rate": 1e-5, "update_norm": -1.0}]),
    ],
    ids=[
        "missing_check",
        "loss_error",
        "low_cosine",
        "null_cosine",
        "non_numeric",
        "unresolved_revision",
        "bad_sha",
        "missing_path",
        "bad_lr_probe",
    ],
)
def test_validate_cli_fails_on_bad_or_missing_evidence(tmp_path, good_block, mutate, capsys):
    r = _validate(tmp_path, SPEC, _mutated(good_block, mutate), capsys)
    assert r.returncode == 1, r.stdout
    assert r.stdout.strip().endswith("failed")


def test_validate_not_applicable_and_unreadable(tmp_path, good_block, capsys):
    r = _validate(
        tmp_path, {"correctness_preflight": {"required": False, "paths": []}}, {"required": False, "paths": []}, capsys
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("not_applicable")
    with pytest.raises(SystemExit, match="cannot read"):
        cx.main(["validate", str(tmp_path / "nope.json"), str(tmp_path / "nope.json")])


def test_validate_checks_lr_scaling_when_the_spec_sets_a_tolerance(good_block):
    spec = copy.deepcopy(SPEC)
    spec["correctness_preflight"]["paths"][0]["tolerances"]["lr_scaling"] = {"max_relative_error": 0.05}
    assert cx.validate_preflight(spec, good_block)[0] == "failed"  # no probes recorded yet
    ok = _mutated(
        good_block,
        lambda p: p.update(
            lr_scaling=[{"learning_rate": 1e-5, "update_norm": 2.0}, {"learning_rate": 2e-5, "update_norm": 4.02}]
        ),
    )
    assert cx.validate_preflight(spec, ok)[0] == "passed"
    bad = _mutated(
        good_block,
        lambda p: p.update(
            lr_scaling=[{"learning_rate": 1e-5, "update_norm": 2.0}, {"learning_rate": 2e-5, "update_norm": 3.0}]
        ),
    )
    assert cx.validate_preflight(spec, bad)[0] == "failed"


def test_a_golden_key_that_holds_a_dot_is_read_by_its_key_path():
    """A loss name may hold a dot (`grpo_clip_eps0.28`): its golden entry is read by a key path, and
    a missing field still names the full path."""
    case = {"name": "c", "grpo_clip_eps0.28": {"loss": 0.5}}
    assert float(golden.case_value(case, ("grpo_clip_eps0.28", "loss"))) == 0.5
    with pytest.raises(golden.GoldenError, match=r"grpo_clip_eps0\.28\.loss missing"):
        golden.case_value(case, "grpo_clip_eps0.28.loss")  # a dotted string splits the name
    with pytest.raises(golden.GoldenError, match="grad_log_prob missing"):
        golden.case_value(case, ("grpo_clip_eps0.28", "grad_log_prob"), (1, 1))

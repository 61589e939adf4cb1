"""The correctness preflight's path ids come from the spec: a spec naming a path the harness does
not implement is refused at load in one line, and the preflight block carries the spec's ids."""

import copy
import json
from pathlib import Path

import pytest

from dppo_harness.loss import correctness
from dppo_harness.plans import PlanError, parse_plan

ROOT = Path(__file__).resolve().parents[2]
SPEC = json.loads((ROOT / "plans" / "exp_e6b0965af3.json").read_text())


def _load(spec: dict) -> object:
    return parse_plan(json.dumps(spec).encode(), ROOT / "plans" / "exp_e6b0965af3.json", repo_root=ROOT)


def _with_paths(paths: list[dict]) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["correctness_preflight"]["paths"] = paths
    return spec


def test_the_saved_spec_names_the_implemented_path():
    assert [p["id"] for p in SPEC["correctness_preflight"]["paths"]] == ["grpo_dppo_custom_loss"]
    _load(SPEC)


def test_a_path_id_the_harness_does_not_implement_is_refused_in_one_line():
    path = copy.deepcopy(SPEC["correctness_preflight"]["paths"][0])
    path["id"] = "dppo_custom_loss_parity"
    with pytest.raises(PlanError) as exc:
        _load(_with_paths([path]))
    line = str(exc.value)
    assert "\n" not in line
    assert "correctness_preflight.paths[0].id: 'dppo_custom_loss_parity' is not a correctness path" in line
    assert "grpo_dppo_custom_loss" in line  # what would settle it


def test_an_unimplemented_second_path_or_kind_is_refused():
    good = SPEC["correctness_preflight"]["paths"][0]
    extra = {**copy.deepcopy(good), "id": "sampler_logprob_parity"}
    with pytest.raises(PlanError, match=r"paths\[1\]\.id: 'sampler_logprob_parity'"):
        _load(_with_paths([copy.deepcopy(good), extra]))
    with pytest.raises(PlanError, match=r"paths\[0\]\.kind: 'optimizer'"):
        _load(_with_paths([{**copy.deepcopy(good), "kind": "optimizer"}]))
    with pytest.raises(PlanError, match=r"paths\[1\]\.id: 'grpo_dppo_custom_loss' is named twice"):
        _load(_with_paths([copy.deepcopy(good), copy.deepcopy(good)]))


def test_a_required_preflight_naming_no_path_is_refused():
    with pytest.raises(PlanError, match=r"correctness_preflight\.paths: the spec requires a correctness preflight"):
        _load(_with_paths([]))


def test_the_block_carries_the_spec_path_ids_and_tolerances():
    from dppo_harness.loss import correctness_golden

    report = correctness_golden.check_golden(ROOT / "tests" / "fixtures" / "dppo_golden_v1.json", modes=("float64",))
    block = correctness.build_preflight_block(report, SPEC)
    assert [p["id"] for p in block["paths"]] == ["grpo_dppo_custom_loss"]
    assert [p["id"] for p in correctness.build_preflight_block(report)["paths"]] == ["grpo_dppo_custom_loss"]

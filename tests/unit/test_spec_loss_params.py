"""Loss parameters a spec states (the GRPO clip eps, the DPPO delta and ratio cap) are read whole
from its text and cross-checked against the registered loss its arms train: a disagreement is
refused in one line quoting the statement and the registered value."""

import copy
import json
from pathlib import Path

import pytest

from dppo_harness.plans import PlanError, loss_params, parse_plan

ROOT = Path(__file__).resolve().parents[2]
SPEC = json.loads((ROOT / "plans" / "exp_e6b0965af3.json").read_text())


def _load(spec: dict) -> object:
    return parse_plan(json.dumps(spec).encode(), ROOT / "plans" / "variant.json", repo_root=ROOT)


def _variant(field: str, old: str, new: str) -> dict:
    spec = copy.deepcopy(SPEC)
    assert old in spec[field], (field, old)
    spec[field] = spec[field].replace(old, new, 1)
    return spec


def _refused(spec: dict) -> str:
    with pytest.raises(PlanError) as exc:
        _load(spec)
    line = str(exc.value)
    assert "\n" not in line and "\\b" not in line and "(?" not in line
    return line


def test_the_saved_spec_states_the_registered_eps():
    stated = loss_params.stated_loss_params(loss_params.spec_model(SPEC))
    eps = stated["ppo_eps"]
    assert {s.value for s in eps} == {0.2}
    assert {s.field for s in eps} >= {"baseline", "method", "command"}
    assert "dppo_delta" not in stated and "ratio_cap" not in stated  # the spec leaves them to the pinned reference
    _load(SPEC)


@pytest.mark.parametrize(
    "field, old, new, needle",
    [
        ("baseline", "(eps=0.2)", "(eps=0.3)", "'GRPO clipped-ratio loss (eps=0.3)"),
        ("baseline", "(eps=0.2)", "(epsilon = 0.25)", "epsilon = 0.25"),
        ("method", "clip(r, 1-0.2, 1+0.2)", "clip(r, 1-0.3, 1+0.3)", "clip(r, 1-0.3, 1+0.3)"),
        ("command", "clip(r, 0.8, 1.2)", "clip(r, 0.7, 1.3)", "clip(r, 0.7, 1.3)"),
    ],
)
def test_an_eps_other_than_the_registered_one_is_refused_quoting_both(field, old, new, needle):
    line = _refused(_variant(field, old, new))
    assert f"variant.json: {field}: " in line and needle in line
    assert "grpo_clip_eps0.2" in line and "0.2" in line


@pytest.mark.parametrize(
    "sentence, needle",
    [
        ("The mask threshold is delta = 0.2.", "delta = 0.2"),
        ("The DPPO ratio cap is C = 5, as in the paper's text.", "C = 5"),
        ("Importance weights use a ratio cap of 5.", "ratio cap of 5"),
    ],
)
def test_a_dppo_parameter_other_than_the_registered_one_is_refused(sentence, needle):
    line = _refused(_variant("method", "Training: LoRA rank", f"{sentence}\n\nTraining: LoRA rank"))
    assert "variant.json: method: " in line and needle in line and "dppo_divergence_mask" in line


def test_stated_values_equal_to_the_registered_ones_load():
    ok = _variant(
        "method",
        "Training: LoRA rank",
        "The mask threshold is delta = 0.15 and the ratio cap C = 10.\n\nTraining: LoRA rank",
    )
    _load(ok)
    stated = loss_params.stated_loss_params(loss_params.spec_model(ok))
    assert stated["dppo_delta"][0].value == 0.15 and stated["ratio_cap"][0].value == 10.0


def test_a_history_sentence_is_not_a_statement():
    _load(_variant("method", "Training: LoRA rank", "An earlier draft used eps=0.3.\n\nTraining: LoRA rank"))


@pytest.mark.parametrize(
    "field, old, new, needle",
    [
        ("baseline", "(eps=0.2)", "(eps=0.2x)", "cannot read"),
        ("baseline", "(eps=0.2)", "(eps=0.2.5)", "cannot read"),
        ("command", "clip(r, 0.8, 1.2)", "clip(r, 0.8, 1.25)", "not symmetric"),
        ("method", "clip(r, 1-0.2, 1+0.2)", "clip(r, 1-0.2, 1+0.25)", "not symmetric"),
    ],
)
def test_an_unreadable_or_one_sided_statement_is_refused(field, old, new, needle):
    line = _refused(_variant(field, old, new))
    assert f"variant.json: {field}: " in line and needle in line


def test_a_parameter_no_arm_trains_with_is_refused():
    spec = copy.deepcopy(SPEC)
    spec["arms"][1]["loss"] = "grpo_clip_eps0.2"
    spec = _variant_of(
        spec, "method", "Training: LoRA rank", "The mask threshold is delta = 0.15.\n\nTraining: LoRA rank"
    )
    line = loss_params_refusal(spec)
    assert "DPPO mask delta 0.15" in line and "no arm" in line


def _variant_of(spec: dict, field: str, old: str, new: str) -> dict:
    spec[field] = spec[field].replace(old, new, 1)
    return spec


def loss_params_refusal(spec: dict) -> str:
    with pytest.raises(PlanError) as exc:
        loss_params.check_loss_params(loss_params.spec_model(spec))
    return str(exc.value)

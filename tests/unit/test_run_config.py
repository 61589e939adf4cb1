"""The typed run config built at plan load: the values the resolution file states with the
sentences they quote, cross-field refusals (one line naming the field), roles, N arms, the dataset
seam."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dppo_harness.evidence.backend import Backend
from dppo_harness.evidence.session import effective_config
from dppo_harness.loss.loss_registry import loss_names
from dppo_harness.plans import PlanError, load_plan, parse_plan
from dppo_harness.stages.comparison.decision import decide_criteria, verdict

REGISTERED = ", ".join(loss_names())  # whatever losses are registered

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_plan(ROOT / "plans" / "exp_e6b0965af3.json")
RESOLUTION = "exp_e6b0965af3.json.resolution.json"
VARIANT = load_plan(ROOT / "tests" / "fixtures" / "plans" / "spec-variant.json")


def _parse(raw) -> object:
    """A changed copy of the saved spec, read with the saved spec's resolution file."""
    return parse_plan(json.dumps(raw).encode(), SPEC.path)


def _spec(mutate) -> dict:
    raw = copy.deepcopy(SPEC.raw)
    mutate(raw)
    return raw


def test_saved_spec_schedule_values_carry_their_sentences():
    run = SPEC.run
    first = "Each step samples groups_per_batch=32 GSM8K train prompts with group_size=8 rollouts at temperature 1.0 and max_tokens=512."
    assert {
        k: (v.value, v.field, v.source)
        for k, v in run.stated.items()
        if k != "minibatches_per_batch" and k != "gate_pilot_steps"
    } == {
        k: (val, RESOLUTION, first)
        for k, val in (("groups_per_batch", 32), ("group_size", 8), ("temperature", 1.0), ("max_tokens", 512))
    }
    assert (run.stated["minibatches_per_batch"].value, run.stated["minibatches_per_batch"].source) == (
        2,
        "The rollout batch is split into 2 minibatches.",
    )
    assert (run.gate_pilot_steps, run.stated["gate_pilot_steps"].field) == (5, RESOLUTION)
    assert "A 5-step pilot" in run.stated["gate_pilot_steps"].source
    assert (run.rollout_steps, run.optimizer_steps, run.batch_size, run.eval_items, run.dataset) == (
        50,
        100,
        256,
        1319,
        "gsm8k",
    )
    cfg = effective_config(
        SPEC, Backend(kind="tinker", requested_model="Qwen/Qwen3.5-2B", served_model="Qwen/Qwen3.5-2B")
    )
    prose = cfg["config"]["run"]["stated_in_prose"]
    assert prose["group_size"] == {"value": 8, "field": RESOLUTION, "source": first}
    assert cfg["config"]["max_tokens"] == 512 and cfg["config"]["run"]["temperature"] == 1.0
    json.dumps(cfg, allow_nan=False)


def test_roles_come_from_the_resolution_file_and_the_decision_weights():
    assert [(a.name, a.role) for a in SPEC.run.arms] == [("grpo_seed0", "baseline"), ("dppo_seed0", "treatment")]
    assert SPEC.run.baseline_source == f"baseline_arm in {RESOLUTION}"
    assert [(a.name, a.role) for a in VARIANT.run.arms] == [("clip_ref_s7", "baseline"), ("tv_mask_s7", "treatment")]
    assert VARIANT.run.baseline_source == "baseline_arm in spec-variant.json.resolution.json"
    assert [(c.treatment, c.baseline) for c in SPEC.run.criteria] == [("dppo_seed0", "grpo_seed0")]


def test_variant_fixture_differs_from_the_saved_spec_everywhere_it_should():
    v, s = VARIANT.run, SPEC.run
    assert {a.name for a in v.arms}.isdisjoint({a.name for a in s.arms})
    assert (v.seed, v.lora_rank, v.arms[0].lr, v.group_size, v.groups_per_batch, v.max_tokens) == (
        7,
        16,
        3e-5,
        4,
        8,
        96,
    )
    assert (s.seed, s.lora_rank, s.arms[0].lr, s.group_size, s.groups_per_batch, s.max_tokens) == (
        0,
        32,
        2e-5,
        8,
        32,
        512,
    )
    assert v.criteria[0].margin == 0.05 and s.criteria[0].margin == 0.0
    assert [c.model_dump(exclude_none=True) for c in v.gate_checks] != [
        c.model_dump(exclude_none=True) for c in s.gate_checks
    ]
    assert v.gate_pilot_steps == 2


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(batch_size=128), "batch_size: 128 != groups_per_batch 32 x group_size 8 (" + RESOLUTION),
        (lambda r: r.update(steps=101), "steps: 101 optimizer steps is not a multiple of updates_per_batch 2"),
        (
            lambda r: [a.update(updates_per_batch=4) for a in r["arms"]],
            "arms: updates_per_batch 4 != the 2 minibatches the rollout batch is split into (" + RESOLUTION,
        ),
        (lambda r: r.update(max_seq_len=512), "max_seq_len: 512 leaves no room for a prompt before max_tokens=512"),
        (
            lambda r: r["arms"][0].update(loss="ppo_dual_clip"),
            "arms[0].loss: 'ppo_dual_clip' is not a registered loss (registered: " + REGISTERED + ")",
        ),
        (
            lambda r: r["dataset"].update(name="math500"),
            "dataset.name: 'math500' is not a registered dataset (registered: gsm8k",
        ),
        (lambda r: r["dataset"].update(hf_path="gsm8k/mirror"), "dataset.hf_path: 'gsm8k/mirror' is not the source"),
        (
            lambda r: r["dataset"].update(n_examples=100),
            "dataset.n_examples: 100 train prompts, but 50 rollout steps x 32",
        ),
        (lambda r: r["eval"].update(n_examples=2000), "eval.n_examples: 2000 exceeds the 1319 items of gsm8k test"),
        (
            lambda r: r["activation_gate"]["checks"][0].update(metric="kl_to_reference"),
            "activation_gate.checks[0].metric: 'kl_to_reference' is provided by no registered loss",
        ),
        (
            lambda r: r["decision_rule"]["criteria"][0].update(weights={"treatment": 1, "baseline": -0.5}),
            "decision_rule.criteria[0].weights: {'treatment': 1.0, 'baseline': -0.5}: only a paired difference",
        ),
        (
            lambda r: r["decision_rule"]["criteria"][0].update(weights={"dppo_seed0": 1, "control": -1}),
            "decision_rule.criteria[0].weights: 'control' is neither an arm",
        ),
        (
            lambda r: r["decision_rule"]["criteria"][0].update(metric="pass@8"),
            "decision_rule.criteria[0].metric: 'pass@8'",
        ),
        (
            lambda r: r["decision_rule"].update(seeds=[1]),
            "decision_rule.seeds: [1] does not schedule the arms' seed [0]",
        ),
        (lambda r: r["arms"][1].update(name="grpo_seed0"), "arms: arm names must be unique"),
        (
            lambda r: r["restoration_preflight"]["groups"][0]["arms"][1].update(name="other"),
            "restoration_preflight.groups: names arms that are not in arms: ['other']",
        ),
    ],
)
def test_a_spec_the_harness_cannot_run_as_written_is_refused_at_load(mutate, message):
    with pytest.raises(PlanError) as e:
        _parse(_spec(mutate))
    assert str(e.value).removeprefix(f"{SPEC.path}: ").startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def _three_arms(criteria) -> dict:
    raw = copy.deepcopy(SPEC.raw)
    extra = dict(raw["arms"][1], name="dppo_seed0_b")
    raw["arms"].append(extra)
    group = raw["restoration_preflight"]["groups"][0]["arms"]
    group.append(dict(group[1], name="dppo_seed0_b"))
    raw["decision_rule"]["criteria"] = criteria
    return raw


def _criterion(cid, treatment):
    return {"id": cid, "metric": "accuracy", "weights": {treatment: 1, "baseline": -1}, "margin": 0.0, "bounds": [0, 1]}


def test_n_arms_one_baseline_several_treatments_each_criterion_on_its_own():
    plan = _parse(_three_arms([_criterion("a", "dppo_seed0"), _criterion("b", "dppo_seed0_b")]))
    run = plan.run
    assert [(a.name, a.role) for a in run.arms] == [
        ("grpo_seed0", "baseline"),
        ("dppo_seed0", "treatment"),
        ("dppo_seed0_b", "treatment"),
    ]
    assert [(c.id, c.treatment, c.baseline) for c in run.criteria] == [
        ("a", "dppo_seed0", "grpo_seed0"),
        ("b", "dppo_seed0_b", "grpo_seed0"),
    ]
    assert [a.name for a in run.treatments] == ["dppo_seed0", "dppo_seed0_b"]
    rows = []
    for i in range(400):  # treatment a clearly better, treatment b equal to the baseline
        for arm, v in (("dppo_seed0", 1), ("dppo_seed0_b", i % 2), ("grpo_seed0", i % 2)):
            rows.append(
                {"item_id": f"i{i}", "arm": arm, "seed": 0, "metric": "accuracy", "value": v, "evaluator_id": "e"}
            )
    decided = decide_criteria(rows, run.criteria, alpha=run.alpha)
    assert decided[0].lower > 0 and decided[1].lower < 0 < decided[1].upper
    assert verdict(decided, rehearsal=False)[:2] == ("inconclusive", "mixed_criteria")
    with pytest.raises(
        PlanError,
        match=r"^\S+: decision_rule.criteria\[0\].weights: names the role 'treatment', but the spec "
        r"has 2 treatment arms \(\['dppo_seed0', 'dppo_seed0_b'\]\); name the arm",
    ):
        _parse(_three_arms(SPEC.raw["decision_rule"]["criteria"]))


def test_the_gate_refuses_a_plan_with_several_treatments_in_one_line():
    """No plan has two treatments; a gate deciding for several is not built, so such a plan stops."""
    from dppo_harness.stages import gate

    three = _parse(_three_arms([_criterion("a", "dppo_seed0"), _criterion("b", "dppo_seed0_b")]))
    with pytest.raises(gate.GateError) as refused:
        gate.pilot_arm(three.name, three.run)
    line = str(refused.value)
    assert "\n" not in line and "pilots one treatment arm; this plan has 2 (dppo_seed0, dppo_seed0_b)" in line
    assert gate.pilot_arm(SPEC.name, SPEC.run).name == "dppo_seed0"


def test_diagnostic_plan_names_a_registered_dataset_and_an_arm_of_its_original(tmp_path):
    raw = json.loads((ROOT / "plans" / "exp_e6b0965af3-diagnostic-r1.json").read_text())
    raw["fixed_settings"]["sampling"]["dataset"] = "math500"
    with pytest.raises(PlanError, match=r"^fixed_settings.sampling.dataset: 'math500' is not a registered dataset"):
        parse_plan(json.dumps(raw).encode())
    raw["fixed_settings"]["sampling"]["dataset"] = "gsm8k"
    raw["fixed_settings"]["treatment"]["arm"] = "grpo_seed0"
    for name in ("exp_e6b0965af3.json", RESOLUTION):
        (tmp_path / name).write_bytes((ROOT / "plans" / name).read_bytes())
    (tmp_path / "d.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="fixed_settings.treatment.arm: 'grpo_seed0' trains 'grpo_clip_eps0.2'"):
        load_plan(tmp_path / "d.json")
    raw["fixed_settings"]["treatment"]["arm"] = "tv_seed0"
    (tmp_path / "d.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="fixed_settings.treatment.arm: 'tv_seed0' is not an arm of the original plan"):
        load_plan(tmp_path / "d.json")

"""The typed run config built at plan load: prose values with their sentences, cross-field
refusals (one line naming the field), roles from the spec, N arms, the dataset seam."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dppo_harness.plans import BackendInfo, PlanError, effective_config, load_plan, parse_plan
from dppo_harness.stages.comparison.decision import decide_criteria, verdict

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_plan(ROOT / "plans" / "exp_e6b0965af3.json")
VARIANT = load_plan(ROOT / "tests" / "fixtures" / "plans" / "spec-variant.json")


def _parse(raw) -> object:
    return parse_plan(json.dumps(raw).encode())


def _spec(mutate) -> dict:
    raw = copy.deepcopy(SPEC.raw)
    mutate(raw)
    return raw


def _method(old: str, new: str):
    def mutate(r):
        assert old in r["method"], old
        r["method"] = r["method"].replace(old, new)

    return mutate


def test_saved_spec_prose_values_carry_their_sentences():
    run = SPEC.run
    first = "Each step samples groups_per_batch=32 GSM8K train prompts with group_size=8 rollouts at temperature 1.0 and max_tokens=512."
    assert {
        k: (v.value, v.field, v.source)
        for k, v in run.schedule_values().items()
        if k != "minibatches_per_batch" and k != "gate_pilot_steps"
    } == {
        k: (val, "method", first)
        for k, val in (("groups_per_batch", 32), ("group_size", 8), ("temperature", 1.0), ("max_tokens", 512))
    }
    assert (run.minibatches_per_batch.value, run.minibatches_per_batch.source) == (
        2,
        "The rollout batch is split into 2 minibatches.",
    )
    assert (run.gate_pilot_steps.value, run.gate_pilot_steps.field) == (5, "activation_gate.reason")
    assert (run.rollout_steps, run.optimizer_steps, run.batch_size, run.eval_items, run.dataset) == (
        50,
        100,
        256,
        1319,
        "gsm8k",
    )
    cfg = effective_config(SPEC, BackendInfo("tinker", "Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-2B"))
    prose = cfg["config"]["run"]["stated_in_prose"]
    assert prose["group_size"] == {"value": 8, "field": "method", "source": first}
    assert cfg["config"]["max_tokens"] == 512 and cfg["config"]["run"]["temperature"] == 1.0
    json.dumps(cfg, allow_nan=False)


def test_roles_come_from_the_baseline_text_and_the_decision_weights():
    assert [(a.name, a.role) for a in SPEC.run.arms] == [("grpo_seed0", "baseline"), ("dppo_seed0", "treatment")]
    assert "'GRPO'" in SPEC.run.baseline_source  # the label the baseline text names first
    assert [(a.name, a.role) for a in VARIANT.run.arms] == [("clip_ref_s7", "baseline"), ("tv_mask_s7", "treatment")]
    assert VARIANT.run.baseline_source == "the baseline text names arm 'clip_ref_s7'"
    # a baseline text naming the other arm, while the hypothesis and the estimand still measure
    # DPPO minus GRPO, is refused: the criterion would measure the opposite of the hypothesis
    with pytest.raises(
        PlanError,
        match=r"^hypothesis: 'DPPO minus GRPO' compares against arm 'grpo_seed0', but "
        r"the baseline text names arm 'dppo_seed0'",
    ):
        _parse(_spec(lambda r: r.__setitem__("baseline", "Arm dppo_seed0 is the reference arm.")))

    # swapped everywhere it is said, the other arm is the baseline
    def swap(r):
        r["baseline"] = "Arm dppo_seed0 is the reference arm."
        r["hypothesis"] = (
            r["hypothesis"]
            .replace("DPPO minus GRPO", "GRPO minus DPPO")
            .replace(
                "the DPPO loss reaches higher greedy exact-match accuracy on the 1319-item GSM8K test set than the GRPO "
                "clipped-ratio loss",
                "the GRPO loss reaches higher greedy exact-match accuracy on the 1319-item GSM8K "
                "test set than the DPPO loss",
            )
        )
        r["decision_rule"]["estimand"] = r["decision_rule"]["estimand"].replace("DPPO minus GRPO", "GRPO minus DPPO")

    swapped = _parse(_spec(swap))
    assert [(a.name, a.role) for a in swapped.run.arms] == [("dppo_seed0", "baseline"), ("grpo_seed0", "treatment")]
    assert [(c.treatment, c.baseline) for c in swapped.run.criteria] == [("grpo_seed0", "dppo_seed0")]


def test_variant_fixture_differs_from_the_saved_spec_everywhere_it_should():
    v, s = VARIANT.run, SPEC.run
    assert {a.name for a in v.arms}.isdisjoint({a.name for a in s.arms})
    assert (v.seed, v.lora_rank, v.arms[0].lr, v.group_size.value, v.groups_per_batch.value, v.max_tokens.value) == (
        7,
        16,
        3e-5,
        4,
        8,
        96,
    )
    assert (s.seed, s.lora_rank, s.arms[0].lr, s.group_size.value, s.groups_per_batch.value, s.max_tokens.value) == (
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
    assert v.gate_pilot_steps.value == 2


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(batch_size=128), "batch_size: 128 != groups_per_batch 32 x group_size 8 (method: "),
        (lambda r: r.update(steps=60), "steps: 60 != 50 rollout steps x updates_per_batch 2 (method: "),
        (_method("(100 optim steps)", "(90 optim steps)"), "steps: 100 != the 90 optimizer steps the method states"),
        (
            _method("split into 2 minibatches", "split into 4 minibatches"),
            "arms: updates_per_batch 2 != the 4 minibatches the rollout batch is split into",
        ),
        (_method("group_size=8 ", "eight rollouts "), "method: does not state group_size"),
        (_method("max_tokens=512", "long answers"), "method: does not state max_tokens"),
        (_method("temperature 1.0", "the default temperature"), "method: does not state temperature"),
        (
            _method("Advantages are", "With group_size=4, advantages are"),
            "method: states group_size twice with different values",
        ),
        (_method("LoRA rank 32", "LoRA rank 64"), "lora_rank: 32 but the method states 64"),
        (_method("AdamW lr 2e-5", "AdamW lr 1e-4"), "optimizer.lr: 2e-05 but the method states 0.0001"),
        (_method("per arm, seed 0", "per arm, seed 3"), "arms[*].seed: 0 but the method states 3"),
        (_method("all 1319 GSM8K", "all 1000 GSM8K"), "eval.n_examples: 1319 but the method states 1000"),
        (lambda r: r.update(max_seq_len=512), "max_seq_len: 512 leaves no room for a prompt before max_tokens=512"),
        (
            lambda r: r["arms"][0].update(loss="ppo_dual_clip"),
            "arms[0].loss: 'ppo_dual_clip' is not a registered loss (registered: dppo_divergence_mask, grpo_clip_eps0.2)",
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
        (lambda r: r["eval"].update(n_examples=2000), "eval.n_examples: 2000 but the method states 1319"),
        (
            lambda r: r["activation_gate"]["checks"][0].update(metric="kl_to_reference"),
            "activation_gate.checks[0].metric: 'kl_to_reference' is provided by no registered loss",
        ),
        (lambda r: r.update(baseline="The usual reference loss."), "baseline: names no arm"),
        (lambda r: r.update(baseline="grpo_seed0 and dppo_seed0 share everything."), "baseline: names several arms"),
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
    assert str(e.value).startswith(message), str(e.value)
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
        match=r"^decision_rule.criteria\[0\].weights: names the role 'treatment', but the spec "
        r"has 2 treatment arms \(\['dppo_seed0', 'dppo_seed0_b'\]\); name the arm",
    ):
        _parse(_three_arms(SPEC.raw["decision_rule"]["criteria"]))


def test_each_treatments_gate_report_is_one_a_resume_takes_over():
    """A resume re-registers and re-checks every gate report of the run (comparison_resume), so
    every name gate.report_file gives, one treatment or several, must be recognized as one."""
    from dppo_harness.stages import gate

    three = _parse(_three_arms([_criterion("a", "dppo_seed0"), _criterion("b", "dppo_seed0_b")])).run
    names = [gate.report_file(three, a.name) for a in three.treatments] + [gate.report_file(SPEC.run, "dppo_seed0")]
    assert names == [
        "activation-gate-report-dppo_seed0.json",
        "activation-gate-report-dppo_seed0_b.json",
        gate.GATE_REPORT_FILE,
    ]
    assert all(gate.is_report_file(n) for n in names)
    assert not any(
        gate.is_report_file(n)
        for n in ("original-gate-report.json", "activation-gate-report.md", "comparison-state-r1-end.json")
    )


def test_diagnostic_plan_names_a_registered_dataset_and_an_arm_of_its_original(tmp_path):
    raw = json.loads((ROOT / "plans" / "exp_e6b0965af3-diagnostic-r1.json").read_text())
    raw["fixed_settings"]["sampling"]["dataset"] = "math500"
    with pytest.raises(PlanError, match=r"^fixed_settings.sampling.dataset: 'math500' is not a registered dataset"):
        _parse(raw)
    raw["fixed_settings"]["sampling"]["dataset"] = "gsm8k"
    raw["fixed_settings"]["treatment"]["arm"] = "grpo_seed0"
    (tmp_path / "exp_e6b0965af3.json").write_bytes((ROOT / "plans" / "exp_e6b0965af3.json").read_bytes())
    (tmp_path / "d.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="fixed_settings.treatment.arm: 'grpo_seed0' trains 'grpo_clip_eps0.2'"):
        load_plan(tmp_path / "d.json")
    raw["fixed_settings"]["treatment"]["arm"] = "tv_seed0"
    (tmp_path / "d.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="fixed_settings.treatment.arm: 'tv_seed0' is not an arm of the original plan"):
        load_plan(tmp_path / "d.json")

"""What a reader of a run sees: the renderer's thinking mode and the loss normalization declared in
effective-config.json, the measured truncation next to them in both reports, counterfactual labels,
the truncation plot and the informational interval in the comparison section."""

from __future__ import annotations

from pathlib import Path

import pytest

from dppo_harness import constants
from dppo_harness.evaluation import stats
from dppo_harness.evidence import EvidenceBundle, report, verify_bundle
from dppo_harness.evidence.backend import Backend, ServedModel
from dppo_harness.evidence.files import EFFECTIVE_CONFIG_FILE
from dppo_harness.evidence.session import effective_config
from dppo_harness.loss import loss_registry
from dppo_harness.plans import CriterionConfig, load_plan
from dppo_harness.plans.run_config import NORMALIZATION as HARNESS_NORMALIZATION
from dppo_harness.stages.comparison.decision import decide_criteria, decision_block, verdict
from dppo_harness.stages.comparison.step_rows import fraction_names

PLANS = Path(__file__).resolve().parents[2] / "plans"


@pytest.mark.parametrize(
    "name", ["exp_e6b0965af3.json", "exp_e6b0965af3-diagnostic-r1.json", "rehearsal/comparison-local.json"]
)
def test_effective_config_declares_renderer_thinking_and_normalization(name):
    cfg = effective_config(
        load_plan(PLANS / name), Backend(kind="local", requested_model=constants.BASE_MODEL, served_model="tiny")
    )
    r = cfg["renderer"]
    assert r["name"] == constants.RENDERER_NAME and r["thinking"] == "enabled"
    assert r["generation_prompt_suffix"].endswith("<think>\n") and "max_tokens" in r["note"]
    n = cfg["loss_normalization"]
    assert n["mode"] == "token_mean" and "loss tokens" in n["definition"] and "summed" in n["cookbook_ppo"]


@pytest.mark.parametrize("name", ["exp_e6b0965af3.json", "rehearsal/comparison-local.json"])
def test_the_declared_normalization_is_what_the_arms_and_the_gate_train_with(name):
    plan = load_plan(PLANS / name)
    declared = effective_config(plan, Backend(kind="local", requested_model=constants.BASE_MODEL, served_model="tiny"))[
        "loss_normalization"
    ]["mode"]
    assert declared == plan.run.normalization == HARNESS_NORMALIZATION
    assert plan.run.normalization == declared  # the comparison's arms and the gate read plan.run's


def _rows():
    rows = []
    for arm, loss in (("grpo_seed0", loss_registry.GRPO_LOSS), ("dppo_seed0", loss_registry.DPPO_LOSS)):
        names = fraction_names(loss)
        for step in range(3):
            rows.append(
                {
                    "arm": arm,
                    "step": step,
                    "loss": loss,
                    "reward_mean": 0.1 * step,
                    "format_rate": 0.5,
                    names["dppo_masked_frac"]: 0.065,
                    names["ppo_clip_frac"]: 0.01,
                    "drift_abs_p90": 0.02,
                    "kl_sample_train_v1": 0.001,
                    "entropy": 0.7,
                    "truncated_frac": 0.25,
                    "no_answer_frac": 0.5,
                    "mean_response_tokens": 40.0,
                    "responses": 32,
                    "max_tokens": 64,
                    "loss_tokens": 900,
                    "seconds": 3.0,
                }
            )
    return rows


def _decision():
    ev = "e" * 64
    t = [1] * 19 + [0] * 22
    b = [1] * 14 + [0] * 27
    obs = [
        {"item_id": f"i{i}", "arm": arm, "seed": 0, "metric": "accuracy", "value": v, "evaluator_id": ev}
        for i, (tv, bv) in enumerate(zip(t, b))
        for arm, v in (("dppo_seed0", tv), ("grpo_seed0", bv))
    ]
    rule = [CriterionConfig("primary", "accuracy", "dppo_seed0", "grpo_seed0", 0.0, (0.0, 1.0))]
    crit = decide_criteria(obs, rule, alpha=0.05)
    info = stats.paired_binary_informational(
        obs, rule[0].treatment, rule[0].baseline, alpha=0.05, metric=rule[0].metric
    )
    return decision_block(b"x\n", crit, verdict(crit, rehearsal=True), rehearsal=True, informational=info)


def test_comparison_report_shows_labels_truncation_plot_and_informational_interval(tmp_path):
    bundle = EvidenceBundle.create(tmp_path)
    eff = effective_config(
        load_plan(PLANS / "rehearsal/comparison-local.json"),
        Backend(kind="local", requested_model=constants.BASE_MODEL, served_model="tiny"),
    )
    bundle.register_json(EFFECTIVE_CONFIG_FILE, "effective_config", eff)
    eval_m = {
        "accuracy": 0.4,
        "eval_n": 41.0,
        "eval_invalid_outputs": 12.0,
        "eval_truncated_frac": 0.25,
        "eval_no_answer_frac": 12 / 41,
        "eval_mean_response_tokens": 50.0,
    }
    for arm in ("base", "grpo_seed0", "dppo_seed0"):
        bundle.post_arm_metrics(arm, eval_m)
    scores = [
        {"arm": a, "value": 0.4, "predictions_ref": f"predictions-{a}.jsonl"}
        for a in ("base", "grpo_seed0", "dppo_seed0")
    ]
    names = report.write_comparison_report(bundle, _rows(), scores, _decision(), "local", max_tokens=64)
    assert names["truncation"] == "comparison-truncation-and-answer-yield.png"
    assert bundle.file_path(names["truncation"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = bundle.file_path("report.md").read_text()
    assert "![truncation and answer yield](comparison-truncation-and-answer-yield.png)" in text
    # counterfactual fractions are labelled in the table (GRPO's masked, DPPO's clip), real ones not
    assert "| grpo_seed0 | 1 | 0 | 0.5 | cf 0.065 | 0.01 |" in text
    assert "| dppo_seed0 | 1 | 0 | 0.5 | 0.065 | cf 0.01 |" in text and "counterfactual" in text
    # renderer + thinking + measured truncation on one line; normalization against the cookbook ppo
    setup = text[text.index("- renderer `qwen3_5`") : text.index("## Per step")]
    assert "thinking enabled" in setup.splitlines()[0]
    assert "  - grpo_seed0 rollouts, all steps: 24 of 96 responses (25.0%) truncated at max_tokens 64" in setup
    assert "  - base greedy evaluation: 10 of 41 responses" in setup
    assert any(
        ln.startswith("- loss normalization `token_mean`") and "cookbook's `ppo`" in ln for ln in text.splitlines()
    )
    assert "### Informational paired interval (not the decision rule)" in text
    assert "5 items only dppo_seed0 got right, 0 only grpo_seed0" in text and "exact McNemar p = 0.0625" in text
    assert stats.INFORMATIONAL_LABEL in text
    assert "| base | 0.4 | 41 | 12 | 0.250 | 50 |" in text
    assert "stopped at max_tokens" not in text  # 25% truncated: no warning
    warn = report.truncation_warnings(
        [{"arm": "base"}], {"base": {"eval_truncated_frac": 1.0, "eval_no_answer_frac": 1.0}}, 512
    )
    assert warn == [
        "\n**base: 100.0% of its greedy outputs stopped at max_tokens 512** (100.0% without a parseable "
        "answer): its accuracy measures truncation more than answers."
    ]
    assert verify_bundle(bundle.dir) == []


def test_diagnostic_report_states_truncation_next_to_the_renderer():
    from diagnostic_rehearsal import simulate_records

    from dppo_harness.evaluation import answer_yield
    from dppo_harness.stages.diagnostic.classification import deterministic_selftest
    from dppo_harness.stages.diagnostic.loop import RunState
    from dppo_harness.stages.diagnostic.write import analyse

    plan = load_plan(PLANS / "exp_e6b0965af3-diagnostic-r1.json")
    state = RunState(records=simulate_records(seed=1), updates_done=16, setup_seconds=20.0, wall_seconds=100.0)
    served = ServedModel(plan.planned_model, plan.planned_model)
    res = analyse(plan, state, deterministic_selftest(), {"points": []}, served)
    analysis = res.analysis_json()
    eff = effective_config(plan, Backend(kind="local", requested_model=constants.BASE_MODEL, served_model="tiny"))
    analysis["declared"] = {k: eff[k] for k in ("renderer", "loss_normalization")}
    analysis["rollout_yield"] = answer_yield.response_yield(
        ["length"] * 64 + ["stop"] * 192, [False] * 80 + [True] * 176, [512] * 64 + [100] * 192, max_tokens=512
    ).as_dict()
    text = report.render_markdown(analysis, {}, "local", res.next_action)
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("- renderer `qwen3_5`"))
    assert "thinking enabled" in lines[i] and lines[i + 1] == (
        "  - frozen batch rollouts: 64 of 256 responses (25.0%) truncated at max_tokens 512, 80 (31.2%) without a "
        "parseable answer, mean 203 tokens"
    )
    assert any(ln.startswith("- loss normalization `token_mean`") for ln in text.splitlines())
    # nothing measured, nothing invented
    analysis.pop("rollout_yield")
    assert "measured truncation: not measured" in report.render_markdown(analysis, {}, "local", res.next_action)

"""Bounded diagnostic analysis: plan settings, must-fire/must-not-fire, pooling, criteria, causes."""

from pathlib import Path

import numpy as np
import pytest
from diagnostic_rehearsal import simulate_records

from dppo_harness.evidence.backend import ServedModel
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument.instrumentation import pool_calls
from dppo_harness.loss.losses import LossConfig, make_loss_fn
from dppo_harness.loss.terms import LossStats
from dppo_harness.plans import PlanError, load_plan
from dppo_harness.plans.models import AnalysisCriterion
from dppo_harness.stages.diagnostic.classification import (
    anchor_problems,
    classify,
    deterministic_selftest,
    evaluate_criteria,
    next_action,
    pinned_variant_problems,
)
from dppo_harness.stages.diagnostic.config import DiagnosticError, config_record, loss_config

PLANS = Path(__file__).parents[2] / "plans"
TINY_PLAN = Path(__file__).parents[1] / "fixtures" / "plans" / "diagnostic-ci-tiny.json"
PLAN = load_plan(PLANS / "exp_e6b0965af3-diagnostic-r1.json")
SPEC_PLAN = load_plan(PLANS / "exp_e6b0965af3.json")
SPEC = SPEC_PLAN.experiment
CRITERIA = PLAN.diagnostic.analysis.criteria
CFG = loss_config(PLAN.diagnostic)
REAL = ServedModel(PLAN.planned_model, PLAN.planned_model)


def test_config_is_the_plan_as_written():
    c = config_record(PLAN.diagnostic)
    assert [c[k] for k in ("groups_per_batch", "group_size", "minibatches_per_epoch", "groups_per_minibatch")] == [
        32,
        8,
        8,
        4,
    ]
    assert [c[k] for k in ("epochs", "max_updates", "max_wall_seconds", "max_tokens")] == [2, 16, 720.0, 512]
    assert c["adam"] == {
        "learning_rate": 2e-5,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
    delta = PLAN.raw["fixed_settings"]["treatment"]["delta"]
    assert [c[k] for k in ("delta", "ratio_cap", "ppo_eps", "normalization")] == [delta, 10.0, 0.2, "token_mean"]
    assert c["sentinel_after_updates"] == [0, 1, 2, 4, 8, 16]
    assert (CFG.dppo_delta, CFG.ratio_cap, CFG.ppo_eps, CFG.normalization) == (delta, 10.0, 0.2, "token_mean")
    tiny = config_record(load_plan(TINY_PLAN).diagnostic)  # a smaller run is a smaller plan file
    assert [tiny[k] for k in ("groups_per_batch", "group_size", "max_updates", "max_tokens")] == [2, 4, 2, 32]
    with pytest.raises(PlanError, match="bounded_diagnostic"):
        _ = SPEC_PLAN.diagnostic
    assert pinned_variant_problems(CFG) == []


def test_must_fire_and_must_not_fire_cases_pass_on_the_real_loss():
    st = deterministic_selftest()
    assert st["passed"], {k: v["problems"] for k, v in st["cases"].items() if not v["passed"]}
    assert {"must_fire_both_signs", "must_not_fire_on_policy", "zero_advantage_is_not_engagement"} <= set(st["cases"])


@pytest.mark.parametrize(
    "mutant",
    [
        lambda cfg: make_loss_fn(
            LossConfig(loss="dppo_divergence_mask", normalization=cfg.normalization, dppo_delta=0.99)
        ),  # never fires
        lambda cfg: make_loss_fn(LossConfig(loss="grpo_clip_eps0.2", normalization=cfg.normalization)),  # wrong rule
    ],
    ids=["mask-disabled", "grpo-instead"],
)
def test_selftest_fails_on_a_broken_loss(mutant, request):
    st = deterministic_selftest(loss_fn_factory=mutant)
    assert not st["passed"]
    # The ratio clip is told from the probability difference by a large ratio at a small p - q (any
    # delta) and, while delta < eps / (1 + eps), by a p - q beyond delta at a ratio under 1 + eps.
    high_q = not st["cases"]["must_fire_high_q_small_ratio"]["passed"]
    if "grpo-instead" in request.node.name:
        assert not st["cases"]["must_not_fire_large_ratio_small_prob"]["passed"]
        assert high_q or CFG.dppo_delta >= CFG.ppo_eps / (1 + CFG.ppo_eps)
    else:
        assert high_q


def _analyse(records):
    second = [r for r in records if r.context["epoch"] == 2]
    pooled = pool_calls([ins.record_terms(r) for r in second]) if second else None
    crit = evaluate_criteria(CRITERIA, pooled) if pooled else []
    return second, pooled, crit


def _classify(records, **kw):
    second, pooled, crit = _analyse(records)
    args = dict(
        criteria=crit,
        pooled=pooled,
        selftest=deterministic_selftest(),
        integrity_problems=[],
        variant_problems=[],
        sentinels={},
        updates_done=len(records),
        second_epoch_calls=len(second),
        stop_reason="update cap reached",
        delta=CFG.dppo_delta,
        served=REAL,
    )
    args.update(kw)
    return classify(**args)


def test_on_policy_run_is_an_inactive_regime_not_a_defect():
    records = simulate_records(seed=1, drift_per_update=0.0)
    _, pooled, crit = _analyse(records)
    assert pooled["dppo/removed"] == 0 and pooled["drift/abs_max"] == pytest.approx(0.0, abs=1e-6)
    by_id = {c.id: c for c in crit}
    assert by_id["dppo_masked_fraction"].passed is False and by_id["pooled_abs_drift_q90"].passed is False
    c = _classify(records)
    assert c.state == "inactive" and c.cause == "legitimate_inactive_regime"
    assert f"vs +delta {CFG.dppo_delta}" in c.explanation and "self-test passed" in c.explanation
    action = next_action(c, PLAN.diagnostic, SPEC, REAL, len(records))
    assert action["kind"] == "cheapest_next_action" and not action["executed"]


def test_drifting_run_is_active_and_yields_a_frozen_revised_spec_not_executed():
    records = simulate_records(seed=2, drift_per_update=0.012)
    _, pooled, crit = _analyse(records)
    assert pooled["dppo/removed_pos_adv"] > 0 and pooled["dppo/removed_neg_adv"] > 0
    assert all(c.passed for c in crit if c.applies), [(c.id, c.reason) for c in crit]
    c = _classify(records)
    assert c.active and c.state == "active" and c.cause is None
    action = next_action(c, PLAN.diagnostic, SPEC, REAL, len(records))
    assert action["kind"] == "frozen_revised_comparison_spec" and action["executed"] is False
    assert len(action["spec_sha256"]) == 64
    assert all(a["updates_per_batch"] == 16 for a in action["spec"]["arms"])
    assert SPEC.arms[0].updates_per_batch == 2  # the original spec is untouched
    assert action["spec"]["title"] == SPEC.title + " (revised schedule r2, proposed)"


def test_pooling_weights_by_loss_tokens_not_by_call():
    records = simulate_records(seed=4, drift_per_update=0.02)[8:]
    pooled = pool_calls([ins.record_terms(r) for r in records])
    want = sum(r.stats["dppo/removed"] for r in records) / sum(r.stats["tokens/loss"] for r in records)
    assert pooled["dppo/masked_frac_loss_tokens"] == pytest.approx(want)
    d = np.concatenate([ins.record_terms(r).prob_diff_N.numpy()[r.tensors["mask_N"] != 0] for r in records])
    assert pooled["drift/abs_p90"] == pytest.approx(float(np.quantile(np.abs(d), 0.9)))
    assert sum(sum(h) for h in pooled["hist"].values()) == pooled["tokens/loss"]


def test_criteria_respect_applies_when_and_reject_unknown_pooling():
    pooled = dict.fromkeys(LossStats.scalar_names(), 0) | {
        "tokens/pos_adv": 10,
        "tokens/neg_adv": 0,
        "dppo/removed_pos_adv": 3,
        "dppo/removed_neg_adv": 0,
        "dppo/masked_frac_loss_tokens": 0.01,
        "ppo/clip_frac_loss_tokens": 0.001,
        "drift/abs_p90": 0.01,
    }
    by_id = {c.id: c for c in evaluate_criteria(CRITERIA, pooled)}
    assert by_id["removed_gradient_neg_adv"].applies is False and by_id["removed_gradient_neg_adv"].passed is None
    assert by_id["removed_gradient_pos_adv"].passed is True
    pooled["dppo/removed_pos_adv"] = 0
    assert evaluate_criteria(CRITERIA, pooled)[3].passed is False  # min_exclusive 0
    with pytest.raises(DiagnosticError, match="not implemented"):
        evaluate_criteria(
            [
                AnalysisCriterion.model_construct(
                    id="x", metric="drift/abs_p90", measures="", pooling="mean_of_calls", min=0
                )
            ],
            pooled,
        )


def test_causes_missing_evidence_defect_and_wrong_anchor():
    records = simulate_records(seed=1, drift_per_update=0.0)
    first_epoch = [r for r in records if r.context["epoch"] == 1]
    c = _classify(first_epoch, stop_reason="wall cap")
    assert c.cause == "missing_evidence" and "No second-epoch loss call" in c.explanation
    c = _classify(records, integrity_problems=["update 9: dppo_keep_N differs on 1 tokens"])
    assert c.cause == "code_or_instrumentation_defect" and not c.active
    broken = deterministic_selftest(
        loss_fn_factory=lambda cfg: make_loss_fn(LossConfig(loss="grpo_clip_eps0.2", normalization="sum"))
    )
    assert _classify(records, selftest=broken).cause == "code_or_instrumentation_defect"
    # The anchor equal to the current policy after updates: detected as the wrong reference.
    for r in records:
        r.tensors["sampler_logprobs_N"] = r.tensors["logprobs_N"].copy()
    assert anchor_problems(records, None, moved=False) == []  # zero lr: equality is legitimate
    problems = anchor_problems(records, None, moved=True)
    assert any("anchored on the current policy" in p for p in problems)
    assert _classify(records, variant_problems=problems).cause == "wrong_reference_or_variant"

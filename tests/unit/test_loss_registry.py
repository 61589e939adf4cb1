"""The loss registry: every loss a spec's arm may name is one entry (packed rule, parameters,
the decisions it trains with, gate metrics, numpy reference, golden cases); an unregistered loss is refused at
plan load; adding a loss is an entry, its reference and its golden file, nothing else.

The test-only loss `pg_ratio_test` (token loss -A * r, gradient through r, no clip, no mask) is
registered here with its own reference and hand-derived golden file
(`tests/fixtures/losses/pg_ratio_golden.json`):
- case both_signs_one_pad: r = [0.5/0.25, 0.25/0.5] = [2, 0.5], A = [1, -2]: token losses [-2, 1],
  token mean over 2 loss tokens -0.5, gradient [-2, 1] / 2;
- case two_rows_ratio_three: r = [1, 0.5, 3], A = [0.5, 0.5, -1]: token losses [-0.5, -0.25, 3],
  mean over 3 tokens 0.75, gradient [-1/6, -1/12, 1];
- case zero_advantages: no gradient-bearing token, loss 0.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dppo_harness.loss import correctness_golden, golden, losses, references
from dppo_harness.loss import loss_registry as registry
from dppo_harness.loss.terms import DECISIONS, DPPO_MASK, PPO_CLIP, LossStats
from dppo_harness.plans import PlanError, parse_plan
from dppo_harness.stages.comparison.run import make_loss

ROOT = Path(__file__).resolve().parents[2]
SPEC_PATH = ROOT / "plans" / "exp_e6b0965af3.json"  # a changed copy is read with its resolution file
SPEC = json.loads(SPEC_PATH.read_text())
NAME = "pg_ratio_test"
GOLDEN = "tests/fixtures/losses/pg_ratio_golden.json"


def _pg_token_loss(lp_N, mu_N, adv_N, terms):
    return -(lp_N - mu_N).exp() * adv_N


def _pg_reference(lp_BT, mu_BT, adv_BT, mask_BT, normalization, **_params):
    on = mask_BT > 0
    ratio = np.exp(np.where(on, lp_BT - mu_BT, 0.0))
    grad = np.where(on & (adv_BT != 0), -adv_BT * ratio, 0.0)
    loss = float(np.where(on, -adv_BT * ratio, 0.0).sum())
    n = float(mask_BT.sum()) if normalization == "token_mean" else 1.0
    scale = 1.0 / n if n > 0 else 0.0
    return references.RefResult(loss * scale, grad * scale, on & (adv_BT != 0))


def _entry(**overrides) -> registry.LossEntry:
    fields = dict(
        name=NAME,
        token_loss=_pg_token_loss,
        params={},
        reference=_pg_reference,
        golden=registry.GoldenCases(GOLDEN, "expected", "token_mean"),
        gate_metrics={"pg_ratio_drift_q99": registry.GateMetric("drift/abs_p99")},
    )
    fields.update(overrides)
    return registry.LossEntry(**fields)


@pytest.fixture
def registered():
    entry = registry.register_loss(_entry())
    yield entry
    registry.LOSSES.pop(NAME, None)


def _spec_with_test_loss() -> dict:
    raw = copy.deepcopy(SPEC)
    raw["arms"][1]["loss"] = NAME  # the treatment arm trains the new loss
    raw["activation_gate"]["checks"].append({"metric": "pg_ratio_drift_q99", "measures": "q99 |p - q|", "min": 0.0})
    return raw


def test_the_exchange_losses_are_registered_with_everything_an_entry_holds():
    assert {"dppo_divergence_mask", "grpo_clip_eps0.2"} <= set(registry.loss_names())
    dppo, grpo = registry.get_loss(registry.DPPO_LOSS), registry.get_loss(registry.GRPO_LOSS)
    plan = json.loads((ROOT / registry.DELTA_PLAN).read_text())["fixed_settings"]["treatment"]
    assert dppo.params == {"dppo_delta": plan["delta"], "ratio_cap": 10.0} and grpo.params == {"ppo_eps": 0.2}
    assert dppo.reference is references.ref_dppo and grpo.reference is references.ref_ppo
    assert set(dppo.gate_metrics) == {"dppo_masked_token_fraction", "policy_drift_abs_p_q90"}
    assert grpo.gate_metrics["grpo_clip_fraction"].stat == "ppo/clip_frac_loss_tokens"
    # Each rule trains with one family of decisions, whose statistics are the loss's returned ones.
    assert (dppo.decisions, grpo.decisions) == (DPPO_MASK, PPO_CLIP)
    for d in DECISIONS:
        assert {d.removed, d.fraction(), d.fraction("nonzero_adv")} <= set(LossStats.names(returned=True))
    for name in registry.loss_names():
        parity = correctness_golden.registered_loss_parity(name, ROOT)
        assert parity.passed and parity.cases == 8, parity.failures


def test_an_unregistered_loss_is_refused_at_load_listing_the_registered_ones():
    with pytest.raises(PlanError) as e:
        parse_plan(json.dumps(_spec_with_test_loss()).encode(), SPEC_PATH)
    registered = ", ".join(registry.loss_names())
    assert (
        str(e.value)
        == f"{SPEC_PATH}: arms[1].loss: 'pg_ratio_test' is not a registered loss (registered: {registered})"
    )
    with pytest.raises(ValueError, match="registered twice|already registered"):
        registry.register_loss(_entry(name=registry.DPPO_LOSS))


def test_a_registered_test_loss_runs_with_no_other_change(registered):
    plan = parse_plan(json.dumps(_spec_with_test_loss()).encode(), SPEC_PATH)  # loads: arm, gate metric, roles
    assert [(a.name, a.loss, a.role) for a in plan.run.arms] == [
        ("grpo_seed0", "grpo_clip_eps0.2", "baseline"),
        ("dppo_seed0", NAME, "treatment"),
    ]
    parity = correctness_golden.registered_loss_parity(NAME, ROOT)
    assert parity.passed and parity.cases == 3, parity.failures
    # the training path: the comparison's runner for that arm trains the registered rule
    loss_fn, _recorder = make_loss(plan.run.arms[1], plan.run)
    assert loss_fn.loss_config.loss == NAME
    case = json.loads((ROOT / GOLDEN).read_text())["cases"][1]
    lp = torch.tensor(np.asarray(case["log_prob"]).ravel(), dtype=torch.float64, requires_grad=True)
    mu, adv, mask = (
        torch.tensor(np.asarray(case[k]).ravel(), dtype=torch.float64)
        for k in ("rollout_log_prob", "advantages", "response_mask")
    )
    call = losses.packed_loss_call(lp, mu, adv, mask, loss_fn.loss_config)
    loss, metrics = call.loss, loss_fn.metrics(call.stats)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.75, rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy(), [-1 / 6, -1 / 12, 1.0, 0.0], rtol=1e-12)
    assert metrics["loss/arm_dppo"] == 0.0 and "dppo/removed" in metrics  # the family's diagnostics, counted


def test_registry_parity_fails_on_a_wrong_rule_reference_or_golden(registered, tmp_path):
    registry.LOSSES.pop(NAME, None)
    registry.register_loss(_entry(token_loss=lambda lp, mu, adv, terms: -lp * adv))  # REINFORCE, not -A * r
    bad = correctness_golden.registered_loss_parity(NAME, ROOT)
    assert not bad.passed and any("packed gradient vs reference" in f for f in bad.failures)
    registry.LOSSES.pop(NAME, None)
    registry.register_loss(_entry(reference=lambda *a, **k: references.RefResult(0.0, np.zeros(a[0].shape), a[3] > 0)))
    bad = correctness_golden.registered_loss_parity(NAME, ROOT)
    assert any("reference loss vs golden" in f for f in bad.failures)
    # a tampered golden value of a built-in loss is caught too
    golden = json.loads((ROOT / "tests/fixtures/dppo_golden_v1.json").read_text())
    golden["cases"][0]["dppo"]["loss"] += 1e-3
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    (tmp_path / "tests" / "fixtures" / "dppo_golden_v1.json").write_text(json.dumps(golden))
    bad = correctness_golden.registered_loss_parity(registry.DPPO_LOSS, tmp_path)
    assert next(f.split(": ", 1)[1] for f in bad.failures).startswith("reference loss vs golden differs")
    shutil.rmtree(tmp_path / "tests")
    assert not correctness_golden.registered_loss_parity(
        registry.DPPO_LOSS, tmp_path
    ).passed  # missing file: not passed


def test_gate_metrics_come_from_the_registry(registered):
    from dppo_harness.stages import gate

    sources = registry.gate_metric_sources()
    assert (
        sources["pg_ratio_drift_q99"].stat == "drift/abs_p99"
        and sources["grpo_clip_fraction"].stat == "ppo/clip_frac_loss_tokens"
    )
    registry.LOSSES.pop(NAME, None)
    raw = _spec_with_test_loss()
    raw["arms"][1]["loss"] = registry.DPPO_LOSS  # a registered loss, but no registered loss provides the check
    with pytest.raises(
        PlanError, match=r": activation_gate.checks\[5\].metric: 'pg_ratio_drift_q99' is provided by no "
    ):
        parse_plan(json.dumps(raw).encode(), SPEC_PATH)
    assert "pg_ratio_drift_q99" not in gate.gate_values([], [], None, 1)[0]


def test_the_shipped_golden_cases_are_the_generators_fixed_point(capsys):
    assert golden.main(["--check"]) == 0, capsys.readouterr().out


def test_the_golden_generator_replaces_what_the_references_do_not_reproduce(monkeypatch):
    doc = json.loads((ROOT / "tests/fixtures/dppo_golden_v1.json").read_text())
    file = registry.get_loss(registry.DPPO_LOSS).golden.file
    assert golden.regenerate(doc, file) == doc
    tampered = copy.deepcopy(doc)
    tampered["cases"][0]["dppo"]["loss"] += 1e-6
    fixed = golden.regenerate(tampered, file)
    assert fixed != tampered and fixed["cases"][0]["dppo"]["loss"] == pytest.approx(doc["cases"][0]["dppo"]["loss"])
    # Another delta: the boundary case's rows move to it (p - q == +-0.3 kept, one step beyond removed),
    # its values follow from the references, and params.dppo says it.
    dppo = registry.get_loss(registry.DPPO_LOSS)
    monkeypatch.setitem(
        registry.LOSSES, dppo.name, dataclasses.replace(dppo, params={**dppo.params, "dppo_delta": 0.3})
    )
    moved = golden.regenerate(doc, file)
    assert moved["params"]["dppo"]["clip_ratio"] == 0.3 and golden.regenerate(moved, file) == moved
    case = next(c for c in moved["cases"] if c["name"] == "boundary_exact")
    lp, mu = np.asarray(case["log_prob"]), np.asarray(case["rollout_log_prob"])
    assert (np.exp(lp) - np.exp(mu))[0, [0, 3]].tolist() == [0.3, -0.3]
    assert case["dppo"]["metrics"]["n_invalid_tr_tokens"] == 2 and case["dppo"]["mask"][0] == [1, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "body, match",
    [
        ("{not json", "no readable fixed_settings.treatment.delta"),
        ('{"fixed_settings": {"treatment": {}}}', "no readable fixed_settings.treatment.delta"),
        ('{"fixed_settings": {"treatment": {"delta": "0.15"}}}', "must be a number in \\(0, 1\\), got '0.15'"),
        ('{"fixed_settings": {"treatment": {"delta": 1.5}}}', "must be a number in \\(0, 1\\), got 1.5"),
        ('{"fixed_settings": {"treatment": {"delta": true}}}', "got True"),
    ],
)
def test_a_plan_without_a_usable_delta_is_refused_naming_the_field(tmp_path, body, match):
    plan = tmp_path / "plan.json"
    plan.write_text(body)
    with pytest.raises(registry.PinnedDeltaError, match=match):
        registry.read_pinned_delta(plan)
    with pytest.raises(registry.PinnedDeltaError, match="no readable"):
        registry.read_pinned_delta(tmp_path / "missing.json")


def test_the_registered_delta_is_the_pinned_plans():
    plan = registry.project_root() / registry.DELTA_PLAN
    assert registry.read_pinned_delta(plan) == registry.DPPO_DELTA

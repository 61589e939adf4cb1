"""Issue 11 point 9: the self-test covers the requester's list (exact +-delta boundaries, ratio cap,
PPO-clip counterfactual on both sides, padding); cap hits count only kept tokens; replay
cross-checks the drift statistics even when boundary ties skip the decision counts."""

import dataclasses

import numpy as np
import pytest
import torch
from diagnostic_rehearsal import simulate_records

from dppo_harness.instrument import replay
from dppo_harness.loss import losses
from dppo_harness.stages.diagnostic import classification as selftest

REQUIRED = (
    "boundary_exact_plus_delta_kept",
    "boundary_one_ulp_above_plus_delta_removed",
    "boundary_exact_minus_delta_kept",
    "boundary_one_ulp_below_minus_delta_removed",
    "ratio_cap_hit_on_kept_token",
    "ratio_cap_not_counted_on_dropped_token",
    "ppo_clip_pos_side",
    "ppo_clip_neg_side",
    "padding_is_not_engagement",
    "zero_advantage_is_not_engagement",
    "must_not_fire_recovery_direction",
    "must_fire_both_signs",
)


def test_selftest_has_and_passes_the_required_cases():
    st = selftest.deterministic_selftest()
    assert set(REQUIRED) <= set(st["cases"]) and len(st["cases"]) >= 18
    assert st["passed"], {k: v["problems"] for k, v in st["cases"].items() if not v["passed"]}


def test_boundary_rows_are_exact():
    delta = losses.LossConfig("dppo_divergence_mask", "token_mean").dppo_delta  # the plan's
    for name, diff in (("boundary_exact_plus_delta_kept", delta), ("boundary_exact_minus_delta_kept", -delta)):
        _p, q, _a, _m, lp = selftest.selftest_cases(delta)[name][0][0]
        mu = float(np.float32(np.log(q)))
        got = torch.tensor(lp, dtype=torch.float64).exp() - torch.tensor(mu, dtype=torch.float64).exp()
        assert float(got) == diff


def test_cap_hits_on_dropped_tokens_fail_the_selftest(monkeypatch):
    real = losses.token_terms

    def old_rule(*a, **k):  # the old behaviour: cap hits counted whether or not the mask kept the token
        t = real(*a, **k)
        return t.__class__(**{**t.__dict__, "ratio_cap_hit_N": t.nonzero_adv_N & (t.ratio_N > 10.0)})

    monkeypatch.setattr(losses, "token_terms", old_rule)
    st = selftest.deterministic_selftest()
    assert not st["cases"]["ratio_cap_not_counted_on_dropped_token"]["passed"]


def test_replay_checks_drift_even_with_boundary_ties(monkeypatch):
    rec = simulate_records(seed=2, drift_per_update=0.012)[-1]
    assert replay.check_record(rec).problems == []
    keep = rec.tensors["dppo_keep_N"].copy()
    i = int(np.flatnonzero(rec.tensors["mask_N"] > 0)[0])
    keep[i] = not keep[i]
    rec.tensors["dppo_keep_N"] = keep
    rec.stats = dataclasses.replace(rec.stats, drift_abs_p90=rec.stats.drift_abs_p90 + 0.01)
    monkeypatch.setattr(replay, "BOUNDARY_TIE", 10.0)  # every decision difference reads as a tie
    problems = replay.check_record(rec).problems
    assert any("drift/abs_p90" in p for p in problems), problems


@pytest.mark.parametrize("keep", [True, False])
def test_loss_counts_cap_hits_only_on_kept_tokens(keep):
    p, q = (np.array([2e-5]), np.array([1e-6])) if keep else (np.array([0.9]), np.array([0.04]))
    cfg = losses.LossConfig(loss="dppo_divergence_mask", normalization="token_mean")
    t = losses.token_terms(
        torch.tensor(np.log(p)), torch.tensor(np.log(q)), torch.tensor([1.0]), torch.tensor([1.0]), cfg
    )
    assert bool(t.ratio_N[0] > 10.0) and bool(t.dppo_keep_N[0]) is keep
    assert bool(t.ratio_cap_hit_N[0]) is keep

"""Must-fail tests: each plausible mis-implementation of the pinned rules fails golden parity.

Each mutation swaps one piece of ``dppo_harness.loss.losses`` (the packed path under test) and runs
the same golden check the preflight uses. The unmutated control must pass, so a failure here is
caused by the mutation alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dppo_harness.loss import correctness_golden, losses

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "dppo_golden_v1.json"
_ORIG_TERMS = losses.token_terms
_ORIG_LOSS = losses.packed_loss
_ORIG_BOTH = losses.packed_loss_call


def _remask(drop_fn):
    """token_terms whose DPPO mask uses a mutated drop rule (diff_N, adv_N, lp_N, mu_N, delta)."""

    def mutated(logprobs_N, sampler_logprobs_N, advantages_N, mask_N, cfg):
        t = _ORIG_TERMS(logprobs_N, sampler_logprobs_N, advantages_N, mask_N, cfg)
        lp = logprobs_N.detach().double()
        mu = sampler_logprobs_N.detach().double()
        drop = drop_fn(t.prob_diff_N, t.advantages_N, lp, mu, cfg.dppo_delta)
        return dataclasses.replace(t, dppo_keep_N=t.loss_token_N & ~drop)

    return mutated


def _log_prob_diff(diff, adv, lp, mu, d):
    ld = lp - mu
    return torch.where(adv > 0, ld > d, ld < -d)


def _symmetric(diff, adv, lp, mu, d):
    return diff.abs() > d


def _non_strict(diff, adv, lp, mu, d):
    return torch.where(adv > 0, diff >= d, diff <= -d)


def _anchor_current(logprobs_N, sampler_logprobs_N, advantages_N, mask_N, cfg):
    # "old policy" recomputed from the current weights: p_old == p on the first update.
    return _ORIG_BOTH(logprobs_N, logprobs_N.detach().clone(), advantages_N, mask_N, cfg)


def _no_cap(logprobs_N, sampler_logprobs_N, terms, cfg):
    return _ORIG_LOSS(logprobs_N, sampler_logprobs_N, dataclasses.replace(terms, ratio_cap=1e300), cfg)


def _ignore_loss_mask(logprobs_N, sampler_logprobs_N, advantages_N, mask_N, cfg):
    return _ORIG_BOTH(logprobs_N, sampler_logprobs_N, advantages_N, torch.ones_like(mask_N), cfg)


def _wider_ppo_clip(logprobs_N, sampler_logprobs_N, terms, cfg):
    return _ORIG_LOSS(logprobs_N, sampler_logprobs_N, dataclasses.replace(terms, ppo_eps=0.3), cfg)


MUTATIONS = {
    "log_prob_instead_of_probability": ("token_terms", _remask(_log_prob_diff), {"boundary_exact", "tails"}),
    "symmetric_abs_p_minus_q": ("token_terms", _remask(_symmetric), {"recovery_direction"}),
    "anchored_on_current_policy": (
        "packed_loss_call",
        _anchor_current,
        {"zero_and_mixed_advantages", "basic_both_signs"},
    ),
    "non_strict_boundary": ("token_terms", _remask(_non_strict), {"boundary_exact"}),
    "missing_ratio_cap": ("packed_loss", _no_cap, {"ratio_cap", "tails"}),
    "loss_mask_ignored": ("packed_loss_call", _ignore_loss_mask, {"padding"}),
    "grpo_clip_eps_0.3": ("packed_loss", _wider_ppo_clip, {"boundary_exact"}),
}


def test_unmutated_control_passes():
    report = correctness_golden.check_golden(GOLDEN, modes=("float64", "float32"))
    assert report.n_failed == 0, "\n".join(r.line() for r in report.results if not r.passed)


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutated_rule_fails_golden_parity(name, monkeypatch):
    attr, replacement, must_catch = MUTATIONS[name]
    monkeypatch.setattr(losses, attr, replacement)
    report = correctness_golden.check_golden(GOLDEN, modes=("float64",))
    failed = {r.case for r in report.results if not r.passed}
    assert report.n_failed > 0, f"mutation {name} passed every golden case"
    assert must_catch & failed, f"{name}: expected a failure in {must_catch}, failed only {failed}"
    # The float64 line compares with the golden values themselves (not with our reference).
    for r in report.results:
        if r.case in failed:
            assert any(not s.passed and not s.name.startswith("ref_") for s in r.subchecks)

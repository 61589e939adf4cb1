"""The deterministic must-fire / must-not-fire self-test: fixed cases through the real packed
loss and the recorder, their counts and gradients checked (exact +-delta boundaries included)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, TypedDict

import numpy as np
import tinker
import torch

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss import losses
from dppo_harness.loss.loss_registry import DPPO_LOSS
from dppo_harness.stages.diagnostic.config import DiagnosticError


class SelftestCase(TypedDict):
    """One must-fire / must-not-fire case through the real packed loss."""

    expected: list[int]
    recorded: list[int]
    loss_reported: list[int]
    expected_counts: dict[str, int]
    grads: list[float]
    passed: bool
    problems: list[str]


class SelftestReport(TypedDict):
    """diagnostic-selftest.json: every case, and whether all passed."""

    passed: bool
    loss_config: dict[str, Any]  # dataclasses.asdict of the loss's LossConfig
    cases: dict[str, SelftestCase]
    note: str


def _case_datums(rows: Sequence[tuple[float, ...]]) -> tuple[list[tinker.Datum], list[torch.Tensor]]:
    """One datum per row (p, q, A, mask[, exact current logprob]) after two prompt positions with
    junk logprobs. The sampler logprob travels as the SDK's float32, the current one is float64
    (the loss computes in float64), so exact decision boundaries are reachable."""
    data: list[tinker.Datum] = []
    lps: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        p, q, a, m = row[:4]
        lp = row[4] if len(row) > 4 else math.log(p)
        target = [11 + i, 12 + i, 13 + i]
        data.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints([10 + i, 11 + i, 12 + i]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_numpy(np.asarray(target).astype(np.int64)),
                    "logprobs": tinker.TensorData.from_numpy(np.asarray([-7.0, 3.0, math.log(q)], np.float32)),
                    "advantages": tinker.TensorData.from_numpy(np.asarray([0.0, 0.0, a], np.float32)),
                    "mask": tinker.TensorData.from_numpy(np.array([0.0, 0.0, m], dtype=np.float32)),
                },
            )
        )
        lps.append(torch.tensor([0.5, -40.0, lp], dtype=torch.float64, requires_grad=True))
    return data, lps


def _boundary_row(q: float, a: float, diff: float) -> tuple[float, float, float, float, float]:
    """A row whose p - q is EXACTLY `diff` as the loss computes it (torch float64 exp of the
    float64 current logprob minus exp of the float32 sampler logprob). Not every q admits one,
    so q walks float32 steps from the given value until one does (deterministic). Choose q so that
    the smaller of p, q lies in [0.125, 0.25): only then is an odd multiple of 2**-55 like 0.15 a
    representable exact difference."""
    mu32 = np.float32(math.log(q))
    for _ in range(200):
        q64 = torch.tensor(float(mu32), dtype=torch.float64).exp()
        lp0 = torch.log(q64 + diff)
        for k in range(-8, 9):
            lp = lp0
            step = torch.tensor(math.inf if k > 0 else -math.inf, dtype=torch.float64)
            for _ in range(abs(k)):
                lp = torch.nextafter(lp, step)
            if float(lp.exp() - q64) == diff:
                return (float(lp.exp()), float(np.exp(np.float64(mu32))), a, 1.0, float(lp))
        mu32 = np.nextafter(mu32, np.float32(0.0))
    raise DiagnosticError(f"no float64 logprob gives p - q == {diff!r} exactly")


# (p, q, A, mask[, lp]) rows, expected (removed_pos, removed_neg, mask_zero_adv), grad must be zero per row
SelftestRows = tuple[tuple[tuple[float, ...], ...], tuple[int, int, int], tuple[bool, ...]]


def selftest_cases(delta: float) -> dict[str, SelftestRows]:
    """The cases at the rule's `delta`: the rows that sit near +-delta are placed relative to it."""
    return {
        "must_fire_pos_adv_up": (((0.80, 0.40, 1.0, 1.0),), (1, 0, 0), (True,)),
        "must_fire_neg_adv_down": (((0.10, 0.60, -1.0, 1.0),), (0, 1, 0), (True,)),
        "must_fire_both_signs": (
            ((0.95, 0.50, 0.5, 1.0), (0.05, 0.50, -0.5, 1.0), (0.5, 0.5, 0.5, 1.0)),
            (1, 1, 0),
            (True, True, False),
        ),
        # Probability difference, not ratio: these two separate Binary-TV from a ratio clip (p - q just
        # above delta at a ratio under 1 + eps while delta < eps / (1 + eps); a ratio beyond 1 +- eps at |p - q| = delta / 2).
        "must_fire_high_q_small_ratio": (((0.995, 0.995 - (delta + 0.005), 1.0, 1.0),), (1, 0, 0), (True,)),
        "must_not_fire_large_ratio_small_prob": (
            ((1.5 * delta, delta, 1.0, 1.0), (0.5 * delta, delta, -1.0, 1.0)),
            (0, 0, 0),
            (False, False),
        ),
        "must_not_fire_on_policy": (((0.3, 0.3, 1.0, 1.0), (0.7, 0.7, -1.0, 1.0)), (0, 0, 0), (False, False)),
        "must_not_fire_below_delta": (
            ((0.5 + (delta - 0.05), 0.50, 1.0, 1.0), (0.5 - (delta - 0.05), 0.50, -1.0, 1.0)),
            (0, 0, 0),
            (False, False),
        ),
        "must_not_fire_recovery_direction": (
            ((0.05, 0.90, 1.0, 1.0), (0.90, 0.05, -1.0, 1.0)),
            (0, 0, 0),
            (False, False),
        ),
        "zero_advantage_is_not_engagement": (((0.05, 0.90, 0.0, 1.0),), (0, 0, 1), (True,)),
        "padding_is_not_engagement": (
            ((0.99, 0.01, 1.0, 0.0), (0.01, 0.99, -1.0, 0.0), (0.5, 1e-4, 1.0, 0.0)),
            (0, 0, 0),
            (True, True, True),
        ),
        # Exact +-delta boundaries: the rule is strict, so p - q == +-delta is kept, one ulp beyond is removed.
        "boundary_exact_plus_delta_kept": ((_boundary_row(0.20, 1.0, delta),), (0, 0, 0), (False,)),
        "boundary_one_ulp_above_plus_delta_removed": (
            (_boundary_row(0.20, 1.0, math.nextafter(delta, 1.0)),),
            (1, 0, 0),
            (True,),
        ),
        "boundary_exact_minus_delta_kept": ((_boundary_row(0.30, -1.0, -delta),), (0, 0, 0), (False,)),
        "boundary_one_ulp_below_minus_delta_removed": (
            (_boundary_row(0.30, -1.0, math.nextafter(-delta, -1.0)),),
            (0, 1, 0),
            (True,),
        ),
        # Ratio cap C: r = 20 on a kept token is a hit (weight C); on a dropped token it is not (no gradient to cap).
        "ratio_cap_hit_on_kept_token": (((2e-5, 1e-6, 1.0, 1.0),), (0, 0, 0), (False,)),
        "ratio_cap_not_counted_on_dropped_token": (((0.90, 0.04, 1.0, 1.0),), (1, 0, 0), (True,)),
        # Counterfactual PPO eps=0.2, both sides: clipped only where the ratio left [0.8, 1.2] in A's direction.
        "ppo_clip_pos_side": (((0.13, 0.10, 1.0, 1.0), (0.07, 0.10, 1.0, 1.0)), (0, 0, 0), (False, False)),
        "ppo_clip_neg_side": (((0.07, 0.10, -1.0, 1.0), (0.13, 0.10, -1.0, 1.0)), (0, 0, 0), (False, False)),
    }


# Further recorded/reported counts a case must show (cap hits and counterfactual clips).
SELFTEST_EXTRA: dict[str, dict[str, int]] = {
    "padding_is_not_engagement": {"dppo/ratio_cap_hits": 0, "ppo/clipped": 0, "tokens/loss": 0},
    "ratio_cap_hit_on_kept_token": {"dppo/ratio_cap_hits": 1, "ppo/clipped": 1},
    "ratio_cap_not_counted_on_dropped_token": {"dppo/ratio_cap_hits": 0},
    "ppo_clip_pos_side": {"ppo/clipped": 1, "ppo/clipped_pos_adv": 1, "ppo/clipped_neg_adv": 0},
    "ppo_clip_neg_side": {"ppo/clipped": 1, "ppo/clipped_pos_adv": 0, "ppo/clipped_neg_adv": 1},
    "boundary_exact_plus_delta_kept": {"dppo/exceed_pos": 0},
    "boundary_one_ulp_above_plus_delta_removed": {"dppo/exceed_pos": 1},
    "boundary_exact_minus_delta_kept": {"dppo/exceed_neg": 0},
    "boundary_one_ulp_below_minus_delta_removed": {"dppo/exceed_neg": 1},
}


def deterministic_selftest(
    loss_fn_factory: Callable[[losses.LossConfig], losses.PackedLoss] | None = None,
    loss_cfg: losses.LossConfig | None = None,
) -> SelftestReport:
    """Must-fire and must-not-fire cases through the real packed loss (counts from its metrics
    and from the recorder) and its gradients: a removed token gets exactly zero gradient, a kept
    nonzero-advantage token a nonzero one. Also run in tests/unit (the suite's evidence)."""
    cfg = loss_cfg or losses.LossConfig(DPPO_LOSS, normalization="token_mean")
    factory = loss_fn_factory or losses.make_loss_fn
    cases: dict[str, SelftestCase] = {}
    for name, (rows, expected, zero_grad) in selftest_cases(cfg.dppo_delta).items():
        data, lps = _case_datums(rows)
        rec = ins.LossCallRecorder(cfg)
        loss, metrics = rec.wrap(factory(cfg))(data, lps)
        loss.backward()
        s = rec.records[0].stats
        got = (s["dppo/removed_pos_adv"], s["dppo/removed_neg_adv"], s["dppo/mask_zero_adv"])
        reported = tuple(
            int(metrics.get(k, -1)) for k in ("dppo/removed_pos_adv", "dppo/removed_neg_adv", "dppo/mask_zero_adv")
        )
        grads = [float(lp.grad[-1]) if lp.grad is not None else math.nan for lp in lps]
        prompt_grads_zero = all(lp.grad is not None and float(lp.grad[:2].abs().sum()) == 0.0 for lp in lps)
        grad_ok = all((g == 0.0) if z else (g != 0.0 and math.isfinite(g)) for g, z in zip(grads, zero_grad))
        problems = []
        if got != expected:
            problems.append(f"recorded (removed+, removed-, zero-adv drops) {got} != expected {expected}")
        if reported != expected:
            problems.append(f"loss reported {reported} != expected {expected}")
        if not grad_ok:
            problems.append(f"response-token gradients {grads} (zero expected: {list(zero_grad)})")
        if not prompt_grads_zero:
            problems.append("prompt positions received a gradient")
        for key, want in SELFTEST_EXTRA.get(name, {}).items():
            if s.get(key) != want:
                problems.append(f"recorded {key}={s.get(key)} != expected {want}")
            if key in metrics and int(metrics[key]) != want:
                problems.append(f"loss reported {key}={metrics[key]} != expected {want}")
        cases[name] = {
            "expected": list(expected),
            "recorded": list(got),
            "loss_reported": list(reported),
            "expected_counts": SELFTEST_EXTRA.get(name, {}),
            "grads": grads,
            "passed": not problems,
            "problems": problems,
        }
    return {
        "passed": all(c["passed"] for c in cases.values()),
        "loss_config": asdict(cfg),
        "cases": cases,
        "note": "deterministic inputs through losses.make_loss_fn and the recorder; the same cases run in "
        "tests/unit/test_diagnostic_analysis.py, golden parity in tests/unit covers exact boundaries",
    }

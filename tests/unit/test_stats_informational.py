"""The informational paired interval beside the decision: Newcombe (1998) method 10 for paired
proportions, the exact McNemar test and the discordant counts; and that none of it decides.

Reference values are worked by hand from the published formulas (intermediate values written out
below, Wilson limits solved here independently as the roots of the score-test quadratic
(p_hat - p)^2 = z^2 p (1 - p) / n), on textbook tables:
- Altman, Machin, Bryant, Gardner (2000), Statistics with Confidence, 2nd ed., Table 6.2:
  a=14, b=5, c=0, d=22 (n=41). p1 = 19/41 = 0.46341, p2 = 14/41 = 0.34146, difference 5/41 = 0.12195.
  Wilson 95%: p1 [0.32056, 0.61254], p2 [0.21559, 0.49450]. ad - bc = 308 > n/2, so the corrected
  numerator is 308 - 20.5 = 287.5 over sqrt(19*22*14*27) = 397.50: phi = 0.72328.
  lower = 0.12195 - sqrt(0.14285^2 - 2*0.72328*0.14285*0.15304 + 0.15304^2) = 0.0115,
  upper = 0.12195 + sqrt(0.12587^2 - 2*0.72328*0.12587*0.14913 + 0.14913^2) = 0.2265.
  Exact McNemar: b=5, c=0: 2 * (1/2)^5 = 0.0625.
- Fagerland, Lydersen, Laake (2014), Stat Med 33:2850, airway hyper-responsiveness (Bentur 2009):
  a=1, b=1, c=7, d=12 (n=21): ad - bc = 5 lies in [0, n/2], so phi = 0; difference -6/21 = -0.28571,
  interval [-0.5069, -0.0256]. Exact McNemar: 2 * (1 + 8) / 2^8 = 18/256 = 0.0703125.
- Agresti (2007), An Introduction to Categorical Data Analysis, Table 8.1 (presidential approval,
  n=1600: 794, 150, 86, 570): the book's Wald 95% interval 0.04 +- 1.96 * 0.0095 = (0.021, 0.059);
  at this n Newcombe's interval is within a few thousandths of it: [0.0212, 0.0587].
"""

from __future__ import annotations

import math

import pytest

from dppo_harness.evaluation import stats
from dppo_harness.plans import CriterionConfig
from dppo_harness.stages.comparison import decision as comparison_decision

Z95 = 1.959963984540054


def _wilson_by_quadratic(x: int, n: int) -> tuple[float, float]:
    """Roots of (1 + z^2/n) p^2 - (2 p_hat + z^2/n) p + p_hat^2 = 0 (the Wilson limits)."""
    p = x / n
    a, b, c = 1 + Z95**2 / n, -(2 * p + Z95**2 / n), p * p
    disc = math.sqrt(b * b - 4 * a * c)
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


@pytest.mark.parametrize("x, n", [(19, 41), (14, 41), (2, 21), (8, 21), (0, 10), (10, 10), (944, 1600)])
def test_wilson_limits_are_the_score_test_roots(x, n):
    lo, hi = stats.wilson_interval(x, n, 0.05)
    qlo, qhi = _wilson_by_quadratic(x, n)
    assert lo == pytest.approx(max(qlo, 0.0), abs=1e-12) and hi == pytest.approx(min(qhi, 1.0), abs=1e-12)


@pytest.mark.parametrize(
    "table, lower, upper, p",
    [
        ((14, 5, 0, 22), 0.0115, 0.2265, 0.0625),  # Altman et al. (2000) Table 6.2, hand-worked above
        ((1, 1, 7, 12), -0.5069, -0.0256, 18 / 256),  # Fagerland et al. (2014), hand-worked above
    ],
)
def test_newcombe_interval_and_exact_mcnemar_on_worked_examples(table, lower, upper, p):
    ci = stats.newcombe_paired_interval(*table, alpha=0.05)
    assert round(ci["lower"], 4) == lower and round(ci["upper"], 4) == upper
    a, b, c, d = table
    assert ci["difference"] == pytest.approx((b - c) / (a + b + c + d))
    assert stats.mcnemar_exact_p(b, c) == pytest.approx(p, rel=1e-12)


def test_newcombe_matches_the_textbook_wald_interval_at_large_n():
    ci = stats.newcombe_paired_interval(794, 150, 86, 570)
    assert ci["difference"] == pytest.approx(0.04)
    assert abs(ci["lower"] - 0.021) < 0.002 and abs(ci["upper"] - 0.059) < 0.002


def test_phi_correction_cases_and_symmetry():
    # ad - bc within [0, n/2]: no correlation credit; negative: used as is.
    assert stats.newcombe_paired_interval(1, 1, 7, 12)["phi"] == 0.0
    assert stats.newcombe_paired_interval(0, 6, 6, 0)["phi"] < 0
    # b == c: the interval is symmetric about 0 and contains it; McNemar p is 1.
    ci = stats.newcombe_paired_interval(30, 5, 5, 60)
    assert ci["lower"] == pytest.approx(-ci["upper"]) and ci["lower"] < 0 < ci["upper"]
    assert stats.mcnemar_exact_p(5, 5) == 1.0 and stats.mcnemar_exact_p(0, 0) == 1.0
    # swapping the arms mirrors the interval
    ab = stats.newcombe_paired_interval(14, 5, 0, 22)
    ba = stats.newcombe_paired_interval(14, 0, 5, 22)
    assert (ab["lower"], ab["upper"]) == pytest.approx((-ba["upper"], -ba["lower"]))
    for bad in ((-1, 0, 0, 1), (0, 0, 0, 0), (1.5, 0, 0, 1)):
        with pytest.raises(stats.ObservationError):
            stats.newcombe_paired_interval(*bad)


def _rows(t_values, b_values):
    ev = "e" * 64
    out = []
    for i, (t, b) in enumerate(zip(t_values, b_values, strict=True)):
        out.append({"item_id": f"i{i}", "arm": "dppo", "seed": 0, "metric": "accuracy", "value": t, "evaluator_id": ev})
        out.append({"item_id": f"i{i}", "arm": "grpo", "seed": 0, "metric": "accuracy", "value": b, "evaluator_id": ev})
    return out


def test_informational_block_counts_discordant_pairs_and_is_labelled():
    # 14 both right, 5 treatment-only, 0 baseline-only, 22 neither (Altman Table 6.2 as observations)
    t = [1] * 14 + [1] * 5 + [0] * 22
    b = [1] * 14 + [0] * 5 + [0] * 22
    info = stats.paired_binary_informational(_rows(t, b), "dppo", "grpo")
    assert (
        info["both_correct"],
        info["treatment_only_correct"],
        info["baseline_only_correct"],
        info["neither_correct"],
        info["discordant_pairs"],
    ) == (14, 5, 0, 22, 5)
    assert round(info["lower"], 4) == 0.0115 and round(info["upper"], 4) == 0.2265
    assert info["used_for_verdict"] is False and "informational" in info["label"]
    assert info["mcnemar_exact_p"] == pytest.approx(0.0625)
    with pytest.raises(stats.ObservationError, match="not 0 or 1"):
        stats.paired_binary_informational(_rows([0.5] * 3, [1, 0, 1]), "dppo", "grpo")


def test_the_informational_interval_never_decides():
    """n = 41 with 5 discordant pairs all for the treatment: Newcombe's interval excludes 0, the paired
    Hoeffding rule does not; the verdict follows the rule (insufficient evidence), and the decision
    block carries the informational interval with used_for_verdict false."""
    t = [1] * 19 + [0] * 22
    b = [1] * 14 + [0] * 27
    rows = _rows(t, b)
    rule = [CriterionConfig("primary", "accuracy", "dppo", "grpo", 0.0, (0.0, 1.0))]
    criteria = comparison_decision.decide_criteria(rows, rule, alpha=0.05)
    info = stats.paired_binary_informational(
        rows, rule[0].treatment, rule[0].baseline, alpha=0.05, metric=rule[0].metric
    )
    assert info["lower"] > 0 and criteria[0].lower < 0
    verdict = comparison_decision.verdict(criteria, rehearsal=False)
    assert verdict[:2] == ("inconclusive", "insufficient_evidence")
    block = comparison_decision.decision_block(b"{}\n", criteria, verdict, rehearsal=False, informational=info)
    assert block["verdict"] == "inconclusive" and block["informational"]["used_for_verdict"] is False
    metrics = comparison_decision.informational_metrics(info)
    assert metrics["comparison/discordant_treatment_only_correct"] == 5.0
    assert metrics["comparison/discordant_baseline_only_correct"] == 0.0

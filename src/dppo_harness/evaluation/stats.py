"""Paired Hoeffding interval for treatment minus baseline on bounded per-item scores, and its CLI.

For scores in ``[a, b]`` the per-item differences lie in ``[a-b, b-a]``, a range of ``2(b-a)``
(2 for accuracy). Hoeffding's two-sided bound on their mean gives the half-width
``range * sqrt(ln(2/alpha) / (2n))``; with n=1319, alpha=0.05 and range 2 it is 0.07479.
The verdict is supported or refuted only when the interval settles the margin (`decide`).

Beside it, never used for the verdict: an informational paired interval for two proportions
(Newcombe 1998, method 10) with the discordant-pair counts and the exact McNemar test
(`paired_binary_informational`). CLI: `python -m dppo_harness.evaluation.stats --help`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

from dppo_harness.json_types import JsonObject, JsonValue


class ObservationError(ValueError):
    """Observations that cannot be paired or scored (missing fields, duplicates, unpaired items,
    values outside the bounds, mixed evaluators)."""


def hoeffding_half_width(n: int, alpha: float, value_range: float) -> float:
    if n < 1:
        raise ObservationError("no paired observations")
    if not 0 < alpha < 1:
        raise ObservationError(f"alpha must be in (0, 1), got {alpha}")
    return value_range * math.sqrt(math.log(2 / alpha) / (2 * n))


def decide(lower: float, upper: float, margin: float) -> tuple[str, str]:
    """``(verdict, reason)`` for a larger-is-better difference against ``margin``."""
    if lower > margin:
        return "supported", f"lower bound {lower:.6g} > margin {margin:g}"
    if upper < margin:
        return "refuted", f"upper bound {upper:.6g} < margin {margin:g}"
    return (
        "inconclusive",
        f"interval [{lower:.6g}, {upper:.6g}] contains the margin {margin:g}: uncertainty too large to settle it",
    )


def paired_hoeffding(
    treatment: Sequence[object],
    baseline: Sequence[object],
    *,
    alpha: float = 0.05,
    margin: float = 0.0,
    bounds: tuple[float, float] = (0.0, 1.0),
) -> JsonObject:
    """Interval and verdict for mean(treatment - baseline) over paired items."""
    if len(treatment) != len(baseline):
        raise ObservationError(f"{len(treatment)} treatment vs {len(baseline)} baseline values: not paired")
    lo, hi = bounds
    if not hi > lo:
        raise ObservationError(f"bounds must satisfy a < b, got {bounds}")
    t_n, b_n = (
        [_check_value(v, bounds, f"{name}[{i}]") for i, v in enumerate(vs)]
        for name, vs in (("treatment", treatment), ("baseline", baseline))
    )
    n = len(t_n)
    diffs = [float(t) - float(b) for t, b in zip(t_n, b_n)]
    value_range = 2 * (hi - lo)
    hw = hoeffding_half_width(n, alpha, value_range)
    mean_t = math.fsum(t_n) / n
    mean_b = math.fsum(b_n) / n
    mean_d = math.fsum(diffs) / n
    lower, upper = mean_d - hw, mean_d + hw
    verdict, reason = decide(lower, upper, margin)
    return {
        "method": "paired_hoeffding",
        "n": n,
        "alpha": alpha,
        "margin": margin,
        "bounds": [lo, hi],
        "difference_range": value_range,
        "mean_treatment": mean_t,
        "mean_baseline": mean_b,
        "mean_difference": mean_d,
        "half_width": hw,
        "lower": lower,
        "upper": upper,
        "verdict": verdict,
        "outcome_reason": verdict if verdict != "inconclusive" else "insufficient_evidence",
        "reason": reason,
    }


def _check_value(v: object, bounds: tuple[float, float], where: str) -> int | float:
    """`v` itself when it is a finite number within `bounds` (a bool is not a number here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ObservationError(f"{where}: value {v!r} is not a number")
    if not math.isfinite(v) or not bounds[0] <= v <= bounds[1]:
        raise ObservationError(f"{where}: value {v!r} outside the bounds [{bounds[0]}, {bounds[1]}]")
    return v


REQUIRED_KEYS = ("item_id", "arm", "metric", "value", "evaluator_id")


def read_observations(path: Path) -> list[JsonObject]:
    """The JSONL rows of a scored-observations file (blank lines skipped)."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ObservationError(f"{path}:{lineno}: not JSON ({e.msg})") from None
    return rows


@dataclass(frozen=True)
class PairedObservations:
    """Treatment and baseline values matched on (item_id, seed), in key order, under one evaluator."""

    keys: list[tuple[str, JsonValue]]  # (item_id, seed)
    treatment: list[JsonValue]
    baseline: list[JsonValue]
    evaluator_id: str
    seeds: list[JsonValue]


def pair_observations(
    rows: Iterable[Mapping[str, JsonValue]], treatment: str, baseline: str, metric: str = "accuracy"
) -> PairedObservations:
    """Match treatment and baseline rows on (item_id, seed); refuse duplicates and unpaired items."""
    if treatment == baseline:
        raise ObservationError("treatment and baseline must be different arms")
    by_arm: dict[str, dict[tuple[str, JsonValue], JsonValue]] = {treatment: {}, baseline: {}}
    evaluators: set[str] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ObservationError(f"row {i}: not an object")
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise ObservationError(f"row {i}: missing {missing}")
        arm = row["arm"]
        if not isinstance(arm, str) or arm not in by_arm or row["metric"] != metric:
            continue
        key = (str(row["item_id"]), row.get("seed"))
        if key in by_arm[arm]:
            raise ObservationError(f"duplicate observation for arm {row['arm']!r}, item {key[0]!r}, seed {key[1]!r}")
        by_arm[arm][key] = row["value"]
        evaluators.add(str(row["evaluator_id"]))
    t, b = by_arm[treatment], by_arm[baseline]
    for arm, values in ((treatment, t), (baseline, b)):
        if not values:
            raise ObservationError(f"no {metric!r} observations for arm {arm!r}")
    only_t, only_b = sorted(set(t) - set(b)), sorted(set(b) - set(t))
    if only_t or only_b:
        raise ObservationError(
            f"unpaired items: {len(only_t)} only in {treatment!r} (e.g. {only_t[:3]}), "
            f"{len(only_b)} only in {baseline!r} (e.g. {only_b[:3]})"
        )
    if len(evaluators) != 1:
        raise ObservationError(
            f"observations come from {len(evaluators)} evaluators {sorted(evaluators)}; pair under one"
        )
    keys = sorted(t, key=lambda k: (k[0], str(k[1])))
    seeds: list[JsonValue] = sorted({k[1] for k in keys}, key=str)
    return PairedObservations(keys, [t[k] for k in keys], [b[k] for k in keys], evaluators.pop(), seeds)


def paired_hoeffding_from_rows(
    rows: Iterable[Mapping[str, JsonValue]],
    treatment: str,
    baseline: str,
    *,
    alpha: float = 0.05,
    margin: float = 0.0,
    metric: str = "accuracy",
    bounds: tuple[float, float] = (0.0, 1.0),
) -> JsonObject:
    paired = pair_observations(rows, treatment, baseline, metric)
    out = paired_hoeffding(paired.treatment, paired.baseline, alpha=alpha, margin=margin, bounds=bounds)
    return {
        "treatment": treatment,
        "baseline": baseline,
        "metric": metric,
        "evaluator_id": paired.evaluator_id,
        "seeds": paired.seeds,
        **out,
    }


# ---- informational: the usual paired interval for two proportions (never the decision rule) -----

INFORMATIONAL_LABEL = (
    "informational only: never used for the verdict (the decision rule is the paired Hoeffding interval)"
)
NEWCOMBE_REFERENCE = (
    "Newcombe RG (1998), Improved confidence intervals for the difference between binomial "
    "proportions based on paired data, Statistics in Medicine 17:2635-2650, method 10"
)
MCNEMAR_REFERENCE = (
    "McNemar Q (1947), Psychometrika 12:153-157; exact conditional form: the treatment-only count "
    "given the discordant pairs is Binomial(b + c, 1/2) under no difference"
)


def wilson_interval(successes: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Wilson (1927) score interval for one proportion: the p with (p_hat - p)^2 <= z^2 p (1 - p) / n,
    i.e. (p_hat + z^2/2n -+ z sqrt(p_hat (1 - p_hat)/n + z^2/4n^2)) / (1 + z^2/n), z = Phi^-1(1 - alpha/2)."""
    if n < 1 or not 0 <= successes <= n:
        raise ObservationError(f"Wilson interval needs 0 <= successes <= n, n >= 1; got {successes}/{n}")
    if not 0 < alpha < 1:
        raise ObservationError(f"alpha must be in (0, 1), got {alpha}")
    z = NormalDist().inv_cdf(1 - alpha / 2)
    p = successes / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    den = 1 + z * z / n
    return max(0.0, (centre - half) / den), min(1.0, (centre + half) / den)


def newcombe_paired_interval(a: int, b: int, c: int, d: int, alpha: float = 0.05) -> JsonObject:
    """Newcombe's (1998) method 10 for p1 - p2 of paired binary outcomes: n, p1, p2, difference,
    lower, upper, phi, wilson_p1, wilson_p2, alpha.

    Table: a = both successes, b = first only, c = second only, d = neither; n = a + b + c + d,
    p1 = (a + b)/n, p2 = (a + c)/n, theta = p1 - p2 = (b - c)/n. With Wilson limits (l1, u1) of p1
    and (l2, u2) of p2, and phi the correlation of the table with Newcombe's correction
    (ad - bc - n/2 when ad - bc > n/2; ad - bc when it is negative; 0 otherwise) over
    sqrt((a+b)(c+d)(a+c)(b+d)) (0 when that product is 0):
    lower = theta - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2),
    upper = theta + sqrt((p2 - l2)^2 - 2 phi (p2 - l2)(u1 - p1) + (u1 - p1)^2).
    """
    counts = (a, b, c, d)
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in counts) or sum(counts) < 1:
        raise ObservationError(f"paired counts must be non-negative integers with n >= 1, got {counts}")
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, alpha)
    l2, u2 = wilson_interval(a + c, n, alpha)
    product = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    corrected = cross - n / 2 if cross > n / 2 else (cross if cross < 0 else 0.0)
    phi = corrected / math.sqrt(product) if product > 0 else 0.0
    theta = p1 - p2
    lower = theta - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    upper = theta + math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    return {
        "n": n,
        "p1": p1,
        "p2": p2,
        "difference": theta,
        "lower": max(-1.0, lower),
        "upper": min(1.0, upper),
        "phi": phi,
        "wilson_p1": [l1, u1],
        "wilson_p2": [l2, u2],
        "alpha": alpha,
    }


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact (conditional) McNemar p-value: 2 P(X <= min(b, c)), X ~ Binomial(b + c, 1/2), at most 1."""
    if b < 0 or c < 0:
        raise ObservationError(f"discordant counts must be non-negative, got {b}, {c}")
    m = b + c
    if m == 0:
        return 1.0
    tail = math.fsum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2.0**m
    return min(1.0, 2.0 * tail)


def paired_binary_informational(
    rows: Iterable[Mapping[str, JsonValue]],
    treatment: str,
    baseline: str,
    *,
    alpha: float = 0.05,
    metric: str = "accuracy",
) -> JsonObject:
    """The informational interval beside the decision: discordant pairs, Newcombe's paired interval
    for treatment minus baseline accuracy and the exact McNemar p-value. Values must be 0 or 1."""
    paired = pair_observations(rows, treatment, baseline, metric)
    for arm, values in (("treatment", paired.treatment), ("baseline", paired.baseline)):
        for k, v in zip(paired.keys, values):
            if isinstance(v, bool) or v not in (0, 1):
                raise ObservationError(
                    f"{arm} item {k[0]!r}: value {v!r} is not 0 or 1 (a paired proportion needs binary scores)"
                )
    table = Counter(zip(paired.treatment, paired.baseline))  # values are 0/1: four cells
    a, b, c, d = table[1, 1], table[1, 0], table[0, 1], table[0, 0]
    ci = newcombe_paired_interval(a, b, c, d, alpha)
    return {
        "label": INFORMATIONAL_LABEL,
        "used_for_verdict": False,
        "method": "newcombe_1998_method10",
        "treatment": treatment,
        "baseline": baseline,
        "metric": metric,
        "evaluator_id": paired.evaluator_id,
        "n": len(paired.keys),
        "alpha": alpha,
        "both_correct": a,
        "treatment_only_correct": b,
        "baseline_only_correct": c,
        "neither_correct": d,
        "discordant_pairs": b + c,
        "mean_difference": ci["difference"],
        "lower": ci["lower"],
        "upper": ci["upper"],
        "phi_corrected": ci["phi"],
        "mcnemar_exact_p": mcnemar_exact_p(b, c),
        "references": [NEWCOMBE_REFERENCE, MCNEMAR_REFERENCE],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dppo_harness.evaluation.stats", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("paired-hoeffding", help="paired Hoeffding interval and verdict")
    p.add_argument("observations", type=Path)
    p.add_argument("--treatment", required=True)
    p.add_argument("--baseline", required=True)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--margin", type=float, default=0.0)
    p.add_argument("--metric", default="accuracy")
    p.add_argument("--bounds", type=float, nargs=2, default=(0.0, 1.0), metavar=("A", "B"))
    q = sub.add_parser(
        "paired-informational", help="Newcombe paired interval + exact McNemar (informational, not the rule)"
    )
    q.add_argument("observations", type=Path)
    q.add_argument("--treatment", required=True)
    q.add_argument("--baseline", required=True)
    q.add_argument("--alpha", type=float, default=0.05)
    q.add_argument("--metric", default="accuracy")
    args = parser.parse_args(argv)
    try:
        rows = read_observations(args.observations)
        if args.command == "paired-informational":
            result = paired_binary_informational(
                rows, args.treatment, args.baseline, alpha=args.alpha, metric=args.metric
            )
        else:
            result = paired_hoeffding_from_rows(
                rows,
                args.treatment,
                args.baseline,
                alpha=args.alpha,
                margin=args.margin,
                metric=args.metric,
                bounds=tuple(args.bounds),
            )
    except (ObservationError, OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

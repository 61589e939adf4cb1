"""The comparison's decision (pure): the spec's decision rule applied per criterion with the
paired Hoeffding interval on the scored observations (`stats`), the verdict (a rehearsal's is
always inconclusive), the informational Newcombe interval and McNemar test shown beside it, and
the decision object that references the observations file by sha256."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import JsonValue

from dppo_harness.evaluation import stats
from dppo_harness.json_types import JsonObject, num
from dppo_harness.stages.write import OBSERVATIONS_FILE

if TYPE_CHECKING:
    from dppo_harness.plans import CriterionConfig, RunConfig

# One scored observation (a line of the observations file: item, arm, metric values), as JSON.
Observation = dict[str, JsonValue]
# What a criterion's entry in the decision object carries of its interval.
INTERVAL_KEYS = (
    "n",
    "alpha",
    "margin",
    "mean_treatment",
    "mean_baseline",
    "mean_difference",
    "half_width",
    "lower",
    "upper",
)


@dataclass(frozen=True)
class CriterionDecision:
    id: str
    metric: str
    treatment: str
    baseline: str
    interval: dict[str, Any]  # stats.paired_hoeffding_from_rows output

    @property
    def lower(self) -> float:
        return float(self.interval["lower"])

    @property
    def upper(self) -> float:
        return float(self.interval["upper"])

    @property
    def margin(self) -> float:
        return float(self.interval["margin"])


def decide_criteria(
    rows: Sequence[Observation], criteria: Sequence[CriterionConfig], *, alpha: float
) -> list[CriterionDecision]:
    """Every criterion of the plan's decision rule (`RunConfig.criteria`: +1 arm minus -1 arm),
    each decided on its own with the paired Hoeffding interval on the observation rows."""
    out = []
    for c in criteria:
        interval = stats.paired_hoeffding_from_rows(
            rows,
            c.treatment,
            c.baseline,
            alpha=float(alpha),
            margin=float(c.margin),
            metric=c.metric,
            bounds=(float(c.bounds[0]), float(c.bounds[1])),
        )
        out.append(CriterionDecision(c.id, c.metric, c.treatment, c.baseline, interval))
    return out


def verdict(criteria: Sequence[CriterionDecision], *, rehearsal: bool) -> tuple[str, str, str]:
    """(verdict, outcome_reason, explanation) by the decision rule.

    supported only if every criterion's lower bound is above its margin; refuted only if every
    upper bound is below it; some each way: mixed_criteria; otherwise insufficient_evidence. The
    spec declares no tie band, so `tie` never applies. A rehearsal is always inconclusive."""
    if not criteria:
        return "inconclusive", "incomplete_execution", "no criterion was evaluated"
    above = [c.lower > c.margin for c in criteria]
    below = [c.upper < c.margin for c in criteria]
    text = "; ".join(
        f"{c.id}: {c.metric} {c.treatment} - {c.baseline} CI [{c.lower:.4g}, {c.upper:.4g}] vs margin {c.margin:g}"
        for c in criteria
    )
    if all(above):
        v, reason = "supported", "supported"
    elif all(below):
        v, reason = "refuted", "refuted"
    elif any(above) or any(below):
        v, reason = "inconclusive", "mixed_criteria"
    else:
        v, reason = "inconclusive", "insufficient_evidence"
    if rehearsal:
        return (
            "inconclusive",
            "insufficient_evidence",
            f"rehearsal on the embedded server's stand-in model, not the planned model: verdict inconclusive "
            f"whatever the interval says (the rule alone would give {v}/{reason}); {text}",
        )
    return v, reason, text


def informational_metrics(info: JsonObject) -> dict[str, float]:
    """result.json `metrics` of the informational interval (labelled: none of it decides)."""
    return {
        "comparison/informational_newcombe_lower": float(num(info["lower"])),
        "comparison/informational_newcombe_upper": float(num(info["upper"])),
        "comparison/informational_mcnemar_exact_p": float(num(info["mcnemar_exact_p"])),
        "comparison/discordant_treatment_only_correct": float(num(info["treatment_only_correct"])),
        "comparison/discordant_baseline_only_correct": float(num(info["baseline_only_correct"])),
    }


def decision_block(
    observations_bytes: bytes,
    criteria: Sequence[CriterionDecision],
    rule_verdict: tuple[str, str, str],
    *,
    rehearsal: bool,
    informational: JsonObject | None = None,
) -> JsonObject:
    """The evidence's decision object (version 1, observations_file) plus the computed intervals, and
    the informational interval beside them (`informational.used_for_verdict` is false)."""
    sha = hashlib.sha256(observations_bytes).hexdigest()  # the retained observations file it decides on
    block: JsonObject = {"version": 1, "observations_file": {"name": OBSERVATIONS_FILE, "sha256": sha}}
    block["method"] = "paired_hoeffding"
    block["criteria"] = [
        {"id": c.id, "metric": c.metric, "treatment": c.treatment, "baseline": c.baseline}
        | {k: c.interval[k] for k in INTERVAL_KEYS}
        for c in criteria
    ]
    block["verdict"], block["outcome_reason"], block["explanation"] = rule_verdict
    block["rehearsal"] = rehearsal
    if informational is not None:
        block["informational"] = dict(informational)
    return block


def decide(
    observations: bytes, run: RunConfig, *, rehearsal: bool, eval_seconds: float
) -> tuple[JsonObject, dict[str, float]]:
    """The decision block on the arms' scored observations (every criterion of `run`, the verdict,
    the informational interval) and its result.json `metrics`: the first criterion's difference and
    interval unqualified, the informational interval, and each criterion under its id when there
    are several."""
    rows = [json.loads(line) for line in observations.decode().splitlines()]
    criteria = decide_criteria(rows, run.criteria, alpha=run.alpha)
    # Beside the decision, never deciding: Newcombe's paired interval and the exact McNemar test for
    # the first criterion's pair and metric (the metrics keys are unqualified).
    first = run.criteria[0]
    info = stats.paired_binary_informational(
        rows, first.treatment, first.baseline, alpha=float(run.alpha), metric=first.metric
    )
    block = decision_block(
        observations, criteria, verdict(criteria, rehearsal=rehearsal), rehearsal=rehearsal, informational=info
    )
    metrics = {
        "comparison/accuracy_difference": float(criteria[0].interval["mean_difference"]),
        "comparison/ci_lower": criteria[0].lower,
        "comparison/ci_upper": criteria[0].upper,
        "comparison/eval_seconds": eval_seconds,
        **informational_metrics(info),
    }
    if len(criteria) > 1:  # every criterion is decided on its own
        for c in criteria:
            metrics[f"comparison/{c.id}/difference"] = float(c.interval["mean_difference"])
            metrics[f"comparison/{c.id}/ci_lower"], metrics[f"comparison/{c.id}/ci_upper"] = c.lower, c.upper
    return block, metrics

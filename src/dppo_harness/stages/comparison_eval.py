"""Evaluation of the paired comparison and its decision.

One frozen evaluator (frozen before training, `evaluation.freeze_evaluator`) scores the base
model and each arm's final checkpoint, greedy, on the plan's test items. Each scored model gets
its own predictions file; the two arms' rows form `scored-observations.jsonl`, the decision
object references it by sha256, and the spec's decision rule is applied with the paired
Hoeffding interval (`stats`). A rehearsal's verdict is always inconclusive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dppo_harness.data import dataset, tokenizer
from dppo_harness.evaluation import greedy as evaluation
from dppo_harness.evaluation import stats

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import CriterionConfig
    from dppo_harness.stages.comparison import ComparisonConfig

OBSERVATIONS_FILE = "scored-observations.jsonl"
DECISION_FILE = "comparison-decision.json"
BASE_ARM = "base"


def freeze_for(cfg: ComparisonConfig, reason: str) -> evaluation.FrozenEvaluator:
    """The comparison's frozen evaluator: the first `cfg.eval_items` test items (all 1319 for the
    spec), greedy, max_tokens as sampled in training."""
    test = dataset.get(cfg.dataset).load_split("test")
    n = None if cfg.eval_items == len(test) else cfg.eval_items
    items, deviation = evaluation.select_items(test, n, reason if n else None)
    return evaluation.freeze_evaluator(items, tokenizer.make_renderer(), max_tokens=cfg.max_tokens, deviation=deviation)


def predictions_name(arm: str, res: evaluation.EvalResult) -> str:
    return f"predictions-{arm}-seed{res.seed}-{res.evaluator_id[:8]}.jsonl"


def register_predictions(bundle: EvidenceBundle, res: evaluation.EvalResult) -> dict[str, Any]:
    """One scored model's predictions (item_id, arm, prediction, reference on every row); returns its score."""
    name = predictions_name(res.arm, res)
    bundle.register_bytes(name, "predictions", res.predictions_jsonl())
    return res.score(name)


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


def decide_criteria(rows: Sequence[Mapping[str, Any]], criteria: Sequence[CriterionConfig], *,
                    alpha: float) -> list[CriterionDecision]:
    """Every criterion of the plan's decision rule (`RunConfig.criteria`: +1 arm minus -1 arm),
    each decided on its own with the paired Hoeffding interval on the observation rows."""
    out = []
    for c in criteria:
        interval = stats.paired_hoeffding_from_rows(rows, c.treatment, c.baseline, alpha=float(alpha),
                                                    margin=float(c.margin), metric=c.metric,
                                                    bounds=(float(c.bounds[0]), float(c.bounds[1])))
        out.append(CriterionDecision(c.id, c.metric, c.treatment, c.baseline, interval))
    return out


def verdict(criteria: Sequence[CriterionDecision], *, rehearsal: bool) -> tuple[str, str, str]:
    """(verdict, outcome_reason, explanation) by the brief's rules.

    supported only if every criterion's lower bound is above its margin; refuted only if every
    upper bound is below it; some each way: mixed_criteria; otherwise insufficient_evidence. The
    spec declares no tie band, so `tie` never applies. A rehearsal is always inconclusive."""
    if not criteria:
        return "inconclusive", "incomplete_execution", "no criterion was evaluated"
    above = [c.lower > c.margin for c in criteria]
    below = [c.upper < c.margin for c in criteria]
    text = "; ".join(f"{c.id}: {c.metric} {c.treatment} - {c.baseline} CI [{c.lower:.4g}, {c.upper:.4g}] vs margin "
                     f"{c.margin:g}" for c in criteria)
    if all(above):
        v, reason = "supported", "supported"
    elif all(below):
        v, reason = "refuted", "refuted"
    elif any(above) or any(below):
        v, reason = "inconclusive", "mixed_criteria"
    else:
        v, reason = "inconclusive", "insufficient_evidence"
    if rehearsal:
        return ("inconclusive", "insufficient_evidence",
                f"rehearsal on the embedded server's stand-in model, not the planned model: verdict inconclusive "
                f"whatever the interval says (the rule alone would give {v}/{reason}); {text}")
    return v, reason, text


def informational_interval(rows: Sequence[Mapping[str, Any]], criterion: CriterionConfig, *,
                           alpha: float) -> dict[str, Any]:
    """Newcombe's paired interval and the exact McNemar test for one criterion's pair and metric, at
    the rule's alpha: shown beside the decision, never used for the verdict."""
    return stats.paired_binary_informational(rows, criterion.treatment, criterion.baseline, alpha=float(alpha),
                                             metric=criterion.metric)


def informational_metrics(info: Mapping[str, Any]) -> dict[str, float]:
    """result.json `metrics` of the informational interval (labelled: none of it decides)."""
    return {"comparison/informational_newcombe_lower": float(info["lower"]),
            "comparison/informational_newcombe_upper": float(info["upper"]),
            "comparison/informational_mcnemar_exact_p": float(info["mcnemar_exact_p"]),
            "comparison/discordant_treatment_only_correct": float(info["treatment_only_correct"]),
            "comparison/discordant_baseline_only_correct": float(info["baseline_only_correct"])}


def eval_line(res: evaluation.EvalResult, max_tokens: int, elapsed_s: float) -> str:
    """The terminal line after one scored model."""
    ry = res.response_yield(max_tokens)
    return (f"[comparison] {res.arm} accuracy {res.accuracy:.3f} on {len(res.rows)} items, {res.invalid_outputs} "
            f"without an answer, {ry.truncated} truncated at max_tokens {max_tokens}, mean "
            f"{ry.mean_response_tokens:.0f} tokens ({elapsed_s:.0f}s)")


def decision_block(observations_bytes: bytes, criteria: Sequence[CriterionDecision], rule_verdict: tuple[str, str, str],
                   *, rehearsal: bool, informational: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The brief's decision object (version 1, observations_file) plus the computed intervals, and
    the informational interval beside them (`informational.used_for_verdict` is false)."""
    block = evaluation.decision_object(OBSERVATIONS_FILE, observations_bytes)
    block["method"] = "paired_hoeffding"
    block["criteria"] = [{"id": c.id, "metric": c.metric, "treatment": c.treatment, "baseline": c.baseline,
                          **{k: c.interval[k] for k in ("n", "alpha", "margin", "mean_treatment", "mean_baseline",
                                                        "mean_difference", "half_width", "lower", "upper")}}
                         for c in criteria]
    block["verdict"], block["outcome_reason"], block["explanation"] = rule_verdict
    block["rehearsal"] = rehearsal
    if informational is not None:
        block["informational"] = dict(informational)
    return block


def recompute_from_file(path: Any, criteria: Sequence[CriterionConfig], *, alpha: float) -> list[dict[str, Any]]:
    """The intervals recomputed from a retained observations file (the reproducibility check)."""
    rows = stats.read_observations(path)
    return [c.interval for c in decide_criteria(rows, criteria, alpha=alpha)]

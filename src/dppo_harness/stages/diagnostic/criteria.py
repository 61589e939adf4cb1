"""The plan's fixed analysis criteria evaluated on pooled second-epoch values: nothing is tuned,
relaxed or selected; a criterion that cannot be measured fails as missing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dppo_harness.instrument.instrumentation import POOLED_QUANTILES, RATIO_PARTS
from dppo_harness.json_types import JsonMap, JsonValue, num
from dppo_harness.loss.terms import LossStats
from dppo_harness.stages.checks import Bounds, BoundsJson, Measured, is_number
from dppo_harness.stages.diagnostic.config import DiagnosticError

if TYPE_CHECKING:
    from dppo_harness.plans.models import AnalysisCriterion


@dataclass(frozen=True)
class CriterionResult:
    id: str
    metric: str
    value: Measured
    applies: bool
    passed: bool | None  # None when the criterion does not apply
    reason: str
    bounds: BoundsJson


_APPLIES_WHEN = {"A > 0": "tokens/pos_adv", "A < 0": "tokens/neg_adv"}


def _applies(criterion: AnalysisCriterion, pooled: JsonMap) -> bool:
    cond = criterion.applies_when
    if cond is None:
        return True
    for needle, key in _APPLIES_WHEN.items():
        if needle in cond:
            return num(pooled.get(key, 0)) > 0
    raise DiagnosticError(f"analysis.criteria[{criterion.id}].applies_when: cannot interpret {cond!r}")


_POOLING_OK = {
    "token_weighted_ratio": set(RATIO_PARTS),
    "pooled_quantile": set(POOLED_QUANTILES),
    "token_count_sum": set(LossStats.names("count")),
}


def _measured(x: JsonValue) -> Measured:
    """A pooled value as a criterion records it: the pooled metrics criteria may name are numbers;
    anything else is recorded as not measured."""
    return x if x is None or isinstance(x, (int, float, str)) else None


def evaluate_criteria(criteria: Sequence[AnalysisCriterion], pooled: JsonMap) -> list[CriterionResult]:
    """The plan's fixed criteria on pooled values (the rule shared with the gate's checks,
    `checks.Bounds`); nothing is tuned, relaxed or selected here."""
    out = []
    for c in criteria:
        if c.metric not in _POOLING_OK.get(c.pooling, set()):
            raise DiagnosticError(
                f"analysis.criteria[{c.id}]: pooling {c.pooling!r} of {c.metric!r} is not implemented"
            )
        bounds = Bounds.of(c)
        declared, value = bounds.as_json(), _measured(pooled.get(c.metric))
        if not _applies(c, pooled):
            out.append(
                CriterionResult(
                    c.id, c.metric, value, False, None, f"does not apply: {c.applies_when} is false", declared
                )
            )
            continue
        if not is_number(value):
            out.append(CriterionResult(c.id, c.metric, value, True, False, "missing: not measured", declared))
            continue
        problems = bounds.problems(value)
        out.append(CriterionResult(c.id, c.metric, value, True, not problems, "; ".join(problems) or "met", declared))
    return out

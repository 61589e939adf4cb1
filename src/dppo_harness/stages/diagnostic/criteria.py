"""The plan's fixed analysis criteria evaluated on pooled second-epoch values: nothing is tuned,
relaxed or selected; a criterion that cannot be measured fails as missing."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument.pooled import POOLED_QUANTILES, RATIO_PARTS
from dppo_harness.stages.diagnostic.config import DiagnosticError


@dataclass(frozen=True)
class CriterionResult:
    id: str
    metric: str
    value: Any
    applies: bool
    passed: bool | None  # None when the criterion does not apply
    reason: str
    bounds: dict[str, Any]


_APPLIES_WHEN = {"A > 0": "tokens/pos_adv", "A < 0": "tokens/neg_adv"}


def _applies(criterion: Mapping[str, Any], pooled: Mapping[str, Any]) -> bool:
    cond = criterion.get("applies_when")
    if cond is None:
        return True
    for needle, key in _APPLIES_WHEN.items():
        if needle in cond:
            return pooled.get(key, 0) > 0
    raise DiagnosticError(f"analysis.criteria[{criterion.get('id')}].applies_when: cannot interpret {cond!r}")


_POOLING_OK = {"token_weighted_ratio": set(RATIO_PARTS), "pooled_quantile": set(POOLED_QUANTILES),
               "token_count_sum": set(ins.COUNT_KEYS)}


def evaluate_criteria(criteria: Sequence[Mapping[str, Any]], pooled: Mapping[str, Any]) -> list[CriterionResult]:
    """The plan's fixed criteria on pooled values; nothing is tuned, relaxed or selected here."""
    out = []
    for c in criteria:
        metric, pooling = c["metric"], c.get("pooling")
        if metric not in _POOLING_OK.get(pooling, set()):
            raise DiagnosticError(f"analysis.criteria[{c['id']}]: pooling {pooling!r} of {metric!r} is not implemented")
        bounds = {k: c[k] for k in ("min", "max", "min_exclusive", "max_exclusive") if k in c}
        value = pooled.get(metric)
        if not _applies(c, pooled):
            out.append(CriterionResult(c["id"], metric, value, False, None, f"does not apply: {c['applies_when']} is false", bounds))
            continue
        if value is None or not (isinstance(value, (int, float)) and math.isfinite(value)):
            out.append(CriterionResult(c["id"], metric, value, True, False, "missing: not measured", bounds))
            continue
        problems = []
        if "min" in c and value < c["min"]:
            problems.append(f"{value:.6g} < min {c['min']}")
        if "max" in c and value > c["max"]:
            problems.append(f"{value:.6g} > max {c['max']}")
        if "min_exclusive" in c and not value > c["min_exclusive"]:
            problems.append(f"{value:.6g} <= {c['min_exclusive']} (must be greater)")
        if "max_exclusive" in c and not value < c["max_exclusive"]:
            problems.append(f"{value:.6g} >= {c['max_exclusive']} (must be smaller)")
        out.append(CriterionResult(c["id"], metric, value, True, not problems, "; ".join(problems) or "met", bounds))
    return out


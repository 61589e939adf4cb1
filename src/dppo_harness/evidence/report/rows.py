"""Reading comparison step rows for the report: rows per arm in step order, and a loss-rule
fraction whichever label (trained rule or counterfactual) the row carries."""

from __future__ import annotations

from collections.abc import Sequence

from dppo_harness.instrument.rule_fraction import fraction
from dppo_harness.json_types import JsonMap, num


def rows_by_arm(rows: Sequence[JsonMap]) -> dict[str, list[JsonMap]]:
    out: dict[str, list[JsonMap]] = {}
    for r in rows:
        out.setdefault(str(r["arm"]), []).append(r)
    return {a: sorted(rs, key=lambda r: num(r["step"])) for a, rs in out.items()}


def rule_fraction(row: JsonMap, base: str) -> tuple[bool, float]:
    """(counterfactual?, value) of a loss-rule fraction in a step row (`instrument.rule_fraction`)."""
    f = fraction(row, base)
    return f.counterfactual, f.value

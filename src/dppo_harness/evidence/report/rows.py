"""Reading comparison step rows for the report: rows per arm in step order, and a loss-rule
fraction whichever label (trained rule or counterfactual) the row carries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def rows_by_arm(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["arm"], []).append(r)
    return {a: sorted(rs, key=lambda r: r["step"]) for a, rs in out.items()}


def rule_fraction(row: Mapping[str, Any], base: str) -> tuple[bool, float]:
    """(counterfactual?, value) of a loss-rule fraction in a step row, whichever label it carries."""
    if base in row:
        return False, float(row[base])
    return True, float(row[f"counterfactual_{base}"])

"""A loss-rule fraction of a comparison step (the DPPO mask, the PPO clip, pooled or of the last
update) as a record: `RuleFraction.counterfactual` says the arm does not train with the rule, and
its step-row key then carries the `counterfactual_` prefix (`fraction_label`); `fraction` is the one
decoder of that label, for the comparison and for the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

COUNTERFACTUAL_PREFIX = "counterfactual_"


def fraction_label(name: str, *, trained: bool) -> str:
    """A loss-rule metric's name in an arm's rows: the rule the arm does not train with is counted
    counterfactually on the arm's own tensors, and its name says so."""
    return name if trained else f"{COUNTERFACTUAL_PREFIX}{name}"


@dataclass(frozen=True)
class RuleFraction:
    """One loss-rule fraction of an arm-step; `counterfactual`: the arm does not train with the rule
    (counted on its own tensors, it removed nothing from its gradient)."""

    value: float
    counterfactual: bool

    def key(self, base: str) -> str:
        """The row's key for this fraction (`fraction_label`)."""
        return fraction_label(base, trained=not self.counterfactual)


def fraction(row: Mapping[str, object], base: str) -> RuleFraction:
    """A loss-rule fraction of a step row (as written to the JSONL, or as a reader holds it), whichever
    label it carries: the one decoder of the `counterfactual_` key prefix."""
    for counterfactual in (False, True):
        key = fraction_label(base, trained=not counterfactual)
        if key in row:
            value = row[key]
            if not isinstance(value, (int, float)):
                raise TypeError(f"step row {key}: {value!r} is not a number")
            return RuleFraction(float(value), counterfactual)
    raise KeyError(base)

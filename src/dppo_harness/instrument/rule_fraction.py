"""A loss-rule fraction of a comparison step (the DPPO mask, the PPO clip, pooled or of the last
update): the rule an arm does not train with is counted counterfactually on the arm's own
tensors, and its step-row key then carries the `counterfactual_` prefix; `fraction` is the one
decoder of that label, for the comparison and for the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

COUNTERFACTUAL_PREFIX = "counterfactual_"


def fraction_label(name: str, *, trained: bool) -> str:
    """A loss-rule metric's name in an arm's rows."""
    return name if trained else f"{COUNTERFACTUAL_PREFIX}{name}"


@dataclass(frozen=True)
class RuleFraction:
    value: float
    counterfactual: bool  # the arm does not train with the rule: it removed nothing from its gradient

    def key(self, base: str) -> str:
        return fraction_label(base, trained=not self.counterfactual)


def fraction(row: Mapping[str, object], base: str) -> RuleFraction:
    """A loss-rule fraction of a step row, whichever label it carries."""
    for counterfactual in (False, True):
        key = fraction_label(base, trained=not counterfactual)
        if key in row:
            value = row[key]
            if not isinstance(value, (int, float)):
                raise TypeError(f"step row {key}: {value!r} is not a number")
            return RuleFraction(float(value), counterfactual)
    raise KeyError(base)

"""One check rule for the gate and the diagnostic's criteria (pure): a plan's bounds on one
measured value (`min`, `max`, `min_exclusive`, `one_of`), what the report records of them, and why
a value breaks them. A value that cannot be compared with a numeric bound fails; nothing is tuned."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel

# A value a check is evaluated on: a pooled or per-step number, a model name, a per-batch count list.
Measured = float | int | str | list[int] | None
BoundsJson = dict[str, float | list[str]]


def is_number(value: Measured) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Bounds:
    """A plan check's bounds, as validated by the plan model (absent: None)."""

    min: float | None = None
    max: float | None = None
    min_exclusive: float | None = None
    one_of: tuple[str, ...] | None = None

    @classmethod
    def of(cls, check: BaseModel) -> Bounds:
        """The bounds a validated plan check declares (a model without a field has no such bound)."""
        one_of = getattr(check, "one_of", None)
        return cls(
            getattr(check, "min", None),
            getattr(check, "max", None),
            getattr(check, "min_exclusive", None),
            tuple(one_of) if one_of is not None else None,
        )

    @property
    def declared(self) -> bool:
        return self.as_json() != {}

    def as_json(self) -> BoundsJson:
        """The declared bounds, in the order the reports write them (absent bounds left out)."""
        numeric = (("min", self.min), ("max", self.max), ("min_exclusive", self.min_exclusive))
        out: BoundsJson = {key: bound for key, bound in numeric if bound is not None}
        if self.one_of is not None:
            out["one_of"] = list(self.one_of)
        return out

    def problems(self, value: Measured) -> list[str]:
        """Why `value` breaks these bounds (empty: it meets them)."""
        out = []
        if self.one_of is not None and value not in self.one_of:
            out.append(f"{value!r} not in {list(self.one_of)!r}")
        if self.min is None and self.max is None and self.min_exclusive is None:
            return out
        if not isinstance(value, (int, float)) or not is_number(value):
            return [*out, f"{value!r} is not a finite number"]
        if self.min is not None and value < self.min:
            out.append(f"{value:.6g} < min {self.min}")
        if self.max is not None and value > self.max:
            out.append(f"{value:.6g} > max {self.max}")
        if self.min_exclusive is not None and not value > self.min_exclusive:
            out.append(f"{value:.6g} <= {self.min_exclusive} (must be greater)")
        return out

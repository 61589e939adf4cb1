"""The strict base of every plan model: `PlanError`, the closed pydantic `StrictModel` and the
constrained field types the plan kinds share.

The plan kinds' models (`models`, `diagnostic_settings`) and the resolution file beside a spec
(`resolution`) build on it, so a plan and its resolution are refused in the same words.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, Field, model_validator

from dppo_harness.plans.schema_errors import STRICT, rule_error

_SHA256_PATTERN = r"^[0-9a-f]{64}$"


class PlanError(ValueError):
    """A plan file that cannot be used; the message names the offending field path."""


NonNeg = Annotated[float, Field(ge=0)]
Unit = Annotated[float, Field(ge=0, le=1)]
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Sha256 = Annotated[str, Field(pattern=_SHA256_PATTERN)]
NonEmptyStr = Annotated[str, Field(min_length=1, pattern=r"\S")]


class StrictModel(BaseModel):
    """Strict, closed model. An optional key (default None) may be left out but not given as null,
    unless the field is listed in `_nullable`."""

    model_config = STRICT
    _nullable: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _no_null_for_optional_keys(cls, data: object) -> object:  # any input: pydantic validates it next
        if isinstance(data, dict):
            for key, value in data.items():
                f = cls.model_fields.get(key)
                if value is None and f is not None and not f.is_required() and key not in cls._nullable:
                    raise rule_error(key, "expected a value, got null (leave the key out instead)")
        return data

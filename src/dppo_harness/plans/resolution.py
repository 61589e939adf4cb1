"""The resolution file beside a spec (`<plan file>.resolution.json`, docs/plans.md): what the
harness needs that the spec format has no field for. A spec is an exchange document kept verbatim
(its sha256 is the plan's identity) and states the sampling schedule only in its `method` prose and
its baseline only as free text, so each value is written here beside the spec sentence it quotes.
A check cannot tell which of a sentence's numbers is meant, only that it holds the value.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import Field, ValidationError, model_validator

from dppo_harness.json_types import JsonObject
from dppo_harness.plans.models import Launch, NonEmptyStr, PlanError, StrictModel, decode, describe, rule_error

if TYPE_CHECKING:
    from dppo_harness.plans.models import ExperimentSpec

SUFFIX = ".resolution.json"


@dataclass(frozen=True)
class Key:
    what: str  # what the number means
    is_int: bool
    quotes: str  # the spec field its sentence is quoted from
    required: bool = True


KEYS: dict[str, Key] = {
    "groups_per_batch": Key("prompts (groups) per rollout batch", True, "method"),
    "group_size": Key("rollouts per prompt", True, "method"),
    "temperature": Key("sampling temperature", False, "method"),
    "max_tokens": Key("sampled tokens per rollout at most", True, "method"),
    # without these the harness's defaults hold, declared as defaults (`run_config`)
    "minibatches_per_batch": Key("complete-group minibatches per rollout batch", True, "method", required=False),
    "gate_pilot_steps": Key("activation-gate pilot steps", True, "activation_gate.reason", required=False),
}
# A number as a sentence writes it in digits, not part of a longer token ("8" is not in "Qwen3-8B").
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w]|\.\d)")


@dataclass(frozen=True)
class Stated:
    """One value and where it comes from: `field` is the resolution file that states it (or, for a
    harness default, the structured field it follows), `source` the spec's sentence it quotes."""

    value: int | float
    field: str
    source: str
    default: bool = False  # no file states it, so the harness's default holds

    def as_json(self) -> JsonObject:
        out: JsonObject = {"value": self.value, "field": self.field, "source": self.source}
        if self.default:
            out["default"] = True
        return out


class Quote(StrictModel):
    value: Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an integer too (JSON 8 is a count)
    sentence: NonEmptyStr


class ResolutionFile(StrictModel):
    about: str | None = None
    values: dict[str, Quote] = Field(default_factory=dict)
    baseline_arm: NonEmptyStr | None = None
    launch: Launch | None = None

    @model_validator(mode="after")
    def _known_keys(self) -> ResolutionFile:
        unknown = sorted(set(self.values) - set(KEYS))
        if unknown:
            raise rule_error("values", f"{unknown[0]!r} is no value the harness reads (values: {', '.join(KEYS)})")
        return self


@dataclass(frozen=True)
class Resolution:
    file: str  # the file's name (it lies beside the plan)
    sha256: str  # of the file's exact bytes
    model: ResolutionFile
    data: bytes = field(default=b"", repr=False)  # the exact bytes, registered in the evidence beside the plan

    def as_json(self) -> JsonObject:
        """The effective config's record of the file (its values are under config.run)."""
        return {
            "file": self.file,
            "sha256": self.sha256,
            "settles": list(self.model.values),
            "states_launch": self.model.launch is not None,
        }


def resolution_path(plan_path: Path) -> Path:
    return plan_path.with_name(plan_path.name + SUFFIX)


def load_resolution(plan_path: Path | None) -> Resolution | None:
    """The resolution file beside `plan_path`, None when there is none, or PlanError (one line
    naming the file) when it is unreadable or malformed."""
    if plan_path is None:
        return None
    path = resolution_path(plan_path)
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read resolution file ({exc.strerror})") from None
    try:
        model = ResolutionFile.model_validate(decode(data, path))
    except ValidationError as exc:
        raise PlanError(f"{path}: {describe(exc.errors(include_url=False)[0])}") from None
    return Resolution(path.name, hashlib.sha256(data).hexdigest(), model, data)


def _missing(file: str, what: str) -> PlanError:
    return PlanError(
        f"{file}: {what}: the spec format has no field for it, so the resolution file beside the plan must state it"
    )


def quoted_values(spec: ExperimentSpec, resolution: Resolution | None, file: str) -> tuple[dict[str, Stated], str]:
    """(each value the resolution file `file` states, the baseline arm it names), or PlanError in one
    line naming the field and the sentence."""
    if resolution is None:
        required = [k for k, v in KEYS.items() if v.required]
        raise PlanError(
            f"{file}: no such file beside the plan; the spec format has no field for {', '.join(required)} "
            "or the baseline arm, so this file states them, each value with the spec sentence it quotes"
        )
    texts = {"method": spec.method, "activation_gate.reason": spec.activation_gate.reason}
    out: dict[str, Stated] = {}
    for key, k in KEYS.items():
        quote = resolution.model.values.get(key)
        if quote is None:
            if k.required:
                raise _missing(file, f"values.{key} ({k.what})")
            continue
        at = f"{file}: values.{key}"
        if k.is_int and not quote.value.is_integer():
            raise PlanError(f"{at}: value {quote.value!r} is not a whole number")
        if quote.sentence not in texts[k.quotes]:
            raise PlanError(f"{at}: the sentence {quote.sentence!r} is not verbatim in the spec's {k.quotes}")
        if not any(float(n) == quote.value for n in _NUMBER.findall(quote.sentence)):
            raise PlanError(f"{at}: the sentence {quote.sentence!r} does not contain the number {quote.value:g}")
        out[key] = Stated(int(quote.value) if k.is_int else quote.value, file, quote.sentence)
    base = resolution.model.baseline_arm
    if base is None:
        raise _missing(file, "baseline_arm (the arm the decision compares against)")
    names = [a.name for a in spec.arms]
    if base not in names:
        raise PlanError(f"{file}: baseline_arm: {base!r} is not an arm of the spec (arms: {names})")
    return out, base

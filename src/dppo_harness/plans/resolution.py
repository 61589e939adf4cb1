"""The resolution file beside a spec: what its prose leaves open, settled without editing it.

A spec is an exchange document kept verbatim (its sha256 is the plan's identity), so an
ambiguity the prose reader refuses, or a value it would leave to a default, is settled beside
it in `<spec file>.resolution.json`:

    {"interpretations": [{"key": "temperature", "value": 1.0,
                          "sentence": "<the spec's sentence it settles, verbatim>",
                          "why": "<why this reading>"}],
     "launch": {...}}

Each entry names a key the prose reader reads (`prose.KEYS`), quotes a sentence that is in the
spec and settles only what the reader refused or found unstated (`prose.parse_method` checks
both). The optional `launch` block states the launch of a plan kind that cannot hold one itself
(a verbatim spec). The file is hashed; the effective config records it (`plan.resolution`) and
every settled value as a declared interpretation (`config.run.declared_interpretations`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError, model_validator

from dppo_harness.json_types import JsonObject
from dppo_harness.plans.model_base import NonEmptyStr, PlanError, StrictModel
from dppo_harness.plans.models import Launch, decode
from dppo_harness.plans.prose import KEYS, Settlement, Settlements
from dppo_harness.plans.schema_errors import describe, rule_error

SUFFIX = ".resolution.json"


class Interpretation(StrictModel):
    key: NonEmptyStr
    value: Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an integer too (JSON 8 is a count)
    sentence: NonEmptyStr
    why: NonEmptyStr


class ResolutionFile(StrictModel):
    about: str | None = None
    interpretations: list[Interpretation] = Field(default_factory=list)
    launch: Launch | None = None

    @model_validator(mode="after")
    def _settles_something(self) -> ResolutionFile:
        keys = [i.key for i in self.interpretations]
        unknown = [k for k in keys if k not in KEYS]
        if unknown:
            raise rule_error(
                "interpretations", f"key {unknown[0]!r} is no value the prose reader reads (keys: {', '.join(KEYS)})"
            )
        if len(set(keys)) != len(keys):
            raise rule_error("interpretations", f"settles a key twice ({keys})")
        if not keys and self.launch is None:
            raise rule_error("", "settles nothing: it needs interpretations or a launch block")
        return self


@dataclass(frozen=True)
class Resolution:
    file: str  # the file's name (it lies beside the spec)
    sha256: str  # of the file's exact bytes
    model: ResolutionFile
    data: bytes = field(default=b"", repr=False)  # the exact bytes, registered in the evidence beside the plan

    @property
    def settlements(self) -> Settlements:
        return Settlements(
            self.file, {i.key: Settlement(i.value, i.sentence, i.why) for i in self.model.interpretations}
        )

    @property
    def launch(self) -> Launch | None:
        return self.model.launch

    def as_json(self) -> JsonObject:
        """The effective config's record of the file (its settled values are under config.run)."""
        return {
            "file": self.file,
            "sha256": self.sha256,
            "settles": [i.key for i in self.model.interpretations],
            "states_launch": self.model.launch is not None,
        }


def resolution_path(plan_path: Path) -> Path:
    return plan_path.with_name(plan_path.name + SUFFIX)


def default_settlements(plan_path: Path | None) -> Settlements:
    """No settlements, naming the file a refusal would ask for."""
    return Settlements(file=resolution_path(plan_path).name) if plan_path is not None else Settlements()


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

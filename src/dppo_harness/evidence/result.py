"""result.json: the run's structured output (status, verdict, metrics, evidence) plus the harness's `backend` block.

`ResultModel` is its shape, its model validator the cross-field rules. The bundle keeps the result
as a plain dict (what is written is exactly what was posted) and validates every new state with
`validate_result` before it is written.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dppo_harness.evidence.backend import Backend, Block, backend_of
from dppo_harness.evidence.files import EvidenceError, FileKind, ResultShapeError
from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.plans.models import (
    NonNegInt,
    PlanDeviation,
    Sha256,
    StrictModel,
    first_error,
    format_path,
    rule_error,
)

REHEARSAL_PREFIX = "Local rehearsal on the embedded CPU server, not Spindle: "
# A run under a rehearsal plan (plans/rehearsal/) on a real service is a rehearsal as well.
REHEARSAL_PLAN_PREFIX = "Rehearsal plan, not the saved experiment spec: "

Status = Literal["running", "succeeded", "failed"]
Verdict = Literal["supported", "refuted", "inconclusive"]
OutcomeReason = Literal[
    "supported", "refuted", "tie", "mixed_criteria", "insufficient_evidence", "incomplete_execution"
]
NumberMap = dict[str, float]  # strict float: ints pass, bools and strings do not; finite only
# Blocks update_result may not touch (top level, and under evidence); dedicated bundle methods keep their invariants.
PROTECTED = frozenset({"deviations", "backend"})
PROTECTED_EVIDENCE = frozenset({"files", "checkpoints", "version"})


class Metrics(BaseModel):
    """`arms` holds per-arm number maps; every other key is a finite number."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    arms: dict[str, NumberMap]
    __pydantic_extra__: dict[str, float] = Field(init=False)


class FileEntryModel(Block):
    name: str
    kind: FileKind
    sha256: Sha256
    size: NonNegInt


class Checkpoint(Block):
    arm: str
    step: int
    uri: str


class EvidenceBlock(Block):
    version: Literal[1]
    files: list[FileEntryModel]
    checkpoints: list[Checkpoint]
    per_arm_metrics: dict[str, NumberMap]


class CapacityBlock(Block):
    error: str
    comparison_steps_completed: int
    released_clients: bool


JsonBlock = Any  # free JSON written by one stage (finite numbers checked on the whole result)


class ResultModel(StrictModel):
    _nullable = frozenset({"generation_audit", "service_wait"})  # free blocks: null is a value there

    status: Status
    summary: str
    metrics: Metrics
    completed_arms: list[str]
    deviations: list[PlanDeviation]
    original_hypothesis_tested: bool | None
    tested_instead: str | None
    correctness_preflight: JsonBlock
    initialization_provenance: JsonBlock
    activation_calibration: JsonBlock
    feasibility: JsonBlock
    evaluation: JsonBlock
    decision: JsonBlock
    evidence: EvidenceBlock
    backend: Backend | None
    verdict: Verdict | None = None
    outcome_reason: OutcomeReason | None = None
    capacity_block: CapacityBlock | None = None
    generation_audit: JsonBlock = None
    service_wait: JsonBlock = None  # the harness's wait on the service: pauses, what it waits on, a stop

    @model_validator(mode="after")
    def _cross_field_rules(self) -> ResultModel:
        final = self.status != "running"
        given = self.model_fields_set
        for a in self.completed_arms:
            if a not in self.metrics.arms:
                raise rule_error("completed_arms", f"arm {a!r} has no metrics under metrics.arms")
        if "verdict" in given and not final:
            raise rule_error("verdict", "leave it out while status is running")
        if final and self.verdict is None:
            raise rule_error("verdict", f"a finished result (status {self.status}) must include a verdict")
        if "outcome_reason" in given:
            if not final:
                raise rule_error("outcome_reason", "report it only with a final result")
            reason = self.outcome_reason
            want = reason if reason in ("supported", "refuted") else "inconclusive"
            if self.verdict != want:
                raise rule_error("outcome_reason", f"{reason!r} requires verdict {want!r}")
        if "capacity_block" in given and self.status != "failed":
            raise rule_error("capacity_block", "only a failed run stopped by capacity carries it")
        if self.original_hypothesis_tested is None and final:
            raise rule_error("original_hypothesis_tested", "a finished result must say true or false")
        if self.original_hypothesis_tested is False and not (self.tested_instead or "").strip():
            raise rule_error("tested_instead", "required when original_hypothesis_tested is false")
        if self.backend is not None and self.backend.kind == "local" and not self.summary.startswith(REHEARSAL_PREFIX):
            raise rule_error("summary", "a local-backend result must be labelled as a rehearsal")
        return self


def validate_result(r: object) -> None:
    """Raise ResultShapeError unless r has the structured-output shape of ResultModel (+ backend)."""
    if not isinstance(r, dict):
        raise ResultShapeError("result: expected object")
    try:
        ResultModel.model_validate(r)
    except ValidationError as exc:
        raise ResultShapeError(first_error(exc)) from None
    try:  # the free JSON blocks: no NaN/inf anywhere
        json.dumps(r, allow_nan=False)
    except ValueError as exc:
        raise ResultShapeError(f"result: non-finite number ({exc})") from None


def initial_result() -> JsonObject:
    """Every required key of ResultModel, in its order: a running result with nothing posted yet."""
    start: JsonObject = dict(status="running", summary="", metrics={"arms": {}}, completed_arms=[], deviations=[])
    start["evidence"] = {"version": 1, "files": [], "checkpoints": [], "per_arm_metrics": {}}
    return {k: copy.deepcopy(start.get(k)) for k, f in ResultModel.model_fields.items() if f.is_required()}


def label_summary(state: Mapping[str, JsonValue], summary: str, rehearsal_plan: bool = False) -> str:
    """A local backend's summary always starts with the rehearsal label; so does a run under a
    rehearsal plan."""
    if (block := backend_of(state)) is not None and block.kind == "local":
        return summary if summary.startswith(REHEARSAL_PREFIX) else REHEARSAL_PREFIX + summary
    if rehearsal_plan and not summary.startswith(REHEARSAL_PLAN_PREFIX):
        return REHEARSAL_PLAN_PREFIX + summary
    return summary


def check_rehearsal_plan_result(state: Mapping[str, JsonValue]) -> None:
    """A result under a rehearsal plan is always inconclusive."""
    if state.get("verdict", "inconclusive") != "inconclusive":
        raise ResultShapeError("verdict: a result under a rehearsal plan is always 'inconclusive'")


# ----------------------------------------------------------------------------- merging


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dropped_number(old: object, new: object, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """The path of the first number in `old` that is no number at the same place in `new`, else None."""
    if isinstance(old, (dict, list)):
        for k in old if isinstance(old, dict) else range(len(old)):
            has = (isinstance(new, dict) and k in new) or (
                isinstance(new, list) and isinstance(k, int) and k < len(new)
            )
            if (p := _dropped_number(old[k], new[k] if has else None, (*path, k))) is not None:  # type: ignore[index]
                return p
        return None
    return path if _is_number(old) and not _is_number(new) else None


def deep_merge(old: Mapping[str, JsonValue], new: Mapping[str, JsonValue]) -> JsonObject:
    """old with new merged in: objects merge key by key, anything else is replaced by (a copy of) new."""
    out = dict(old)
    for k, v in new.items():
        prev = old.get(k)
        out[k] = deep_merge(prev, v) if isinstance(prev, dict) and isinstance(v, dict) else copy.deepcopy(v)
    return out


def check_update_keys(fields: Mapping[str, JsonValue]) -> None:
    """update_result may not touch the blocks that dedicated bundle methods manage."""
    for key, value in fields.items():
        if key in PROTECTED:
            raise EvidenceError(f"{key}: use the dedicated bundle method, not update_result")
        managed = [k for k in value if k in PROTECTED_EVIDENCE] if key == "evidence" and isinstance(value, dict) else []
        if managed:
            raise EvidenceError(f"evidence.{managed[0]}: managed by the bundle (register_*/add_checkpoint)")


# A failed run stays failed: a later, more hopeful close (a stage's "succeeded" after a swallowed
# refusal) cannot replace the failure's status, verdict, reason or summary.
STICKY_AFTER_FAILURE = ("status", "verdict", "outcome_reason", "summary")


def merged_result(old: JsonObject, fields: Mapping[str, JsonValue]) -> JsonObject:
    """old deep-merged with fields; every number in old survives, completed_arms only grows, and a
    failed status is sticky (STICKY_AFTER_FAILURE keep the failure's values)."""
    if old.get("status") == "failed" and fields.get("status", "failed") != "failed":
        fields = {k: v for k, v in fields.items() if k not in STICKY_AFTER_FAILURE}
    new = deep_merge(old, fields)
    posted, done = fields.get("completed_arms"), old["completed_arms"]
    if isinstance(posted, list) and isinstance(done, list):  # the shape validate_result checks on both
        new["completed_arms"] = [*done, *(a for a in posted if a not in done)]
    if (path := _dropped_number(old, new)) is not None:
        raise EvidenceError(f"{format_path(path)}: an earlier posted number would be dropped")
    return new


def stopped_state(old: JsonObject, summary: str) -> JsonObject:
    """The failed, closed result of a run the evidence itself stopped, `summary` saying why."""
    fields: JsonObject = {"status": "failed", "verdict": "inconclusive", "outcome_reason": "incomplete_execution"}
    state = deep_merge(old, fields)
    if state["original_hypothesis_tested"] is None:
        state["original_hypothesis_tested"] = False
        state["tested_instead"] = "nothing: the run stopped before any claim could be tested"
    state["summary"] = label_summary(state, summary)
    return state


def as_text(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)

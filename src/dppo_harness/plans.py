"""Frozen plans: schema validation, sha256 of the exact file bytes, effective config, deviations.

Three plan kinds live in `plans/`:
- `experiment_spec`: the saved experiment spec, verbatim from the brief (it has no `kind` key);
- `bounded_diagnostic`: the requester's revised diagnostic (`"kind": "bounded_diagnostic"`);
- `rehearsal`: a complete experiment spec at rehearsal size, derived from a saved spec (by path
  and sha256) with every difference declared (`"kind": "rehearsal"`, `plans/rehearsal/`).

Each kind is a strict pydantic model (no unknown keys, no coercion, no NaN/inf). An invalid plan
raises `PlanError` whose message starts with the field path, e.g.
`activation_gate.checks[2].min: expected number, got str`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, JsonValue, ValidationError, model_validator

from dppo_harness import constants
from dppo_harness.schema_errors import STRICT, first_error, format_path, rule_error, type_name

PlanKind = Literal["experiment_spec", "bounded_diagnostic", "rehearsal"]
# The brief's structured output only knows these deviation fields.
DEVIATION_FIELDS = ("model", "objective", "effective_batch", "steps", "dataset", "evaluator", "endpoint")
_SHA256_PATTERN = r"^[0-9a-f]{64}$"


class PlanError(ValueError):
    """A plan file that cannot be used; the message names the offending field path."""


def _fail(path: str, msg: str) -> PlanError:
    return PlanError(f"{path or '<root>'}: {msg}")


# ----------------------------------------------------------------------------- field types

NonNeg = Annotated[float, Field(ge=0)]
Unit = Annotated[float, Field(ge=0, le=1)]
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Sha256 = Annotated[str, Field(pattern=_SHA256_PATTERN)]
NonEmptyStr = Annotated[str, Field(min_length=1, pattern=r"\S")]


class _Model(BaseModel):
    """Strict, closed model. An optional key (default None) may be left out but not given as null,
    unless the field is listed in `_nullable`."""

    model_config = STRICT
    _nullable: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _no_null_for_optional_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                f = cls.model_fields.get(key)
                if value is None and f is not None and not f.is_required() and key not in cls._nullable:
                    raise rule_error(key, "expected a value, got null (leave the key out instead)")
        return data


def _needs_bound(check: BaseModel, keys: Sequence[str]) -> None:
    given = [k for k in keys if getattr(check, k, None) is not None]
    if not given:
        raise rule_error("", f"expected at least one of {', '.join(keys)}")
    lo, hi = getattr(check, "min", None), getattr(check, "max", None)
    if lo is not None and hi is not None and lo > hi:
        raise rule_error("max", f"max {hi!r} is below min {lo!r}")


# ----------------------------------------------------------------------------- experiment_spec


class ExperimentFeatures(_Model):
    custom_loss: bool
    custom_optimizer: bool
    paired_comparison: bool
    paired_training_arms: bool
    checkpoint_restore: bool
    warmup_adaptation: bool
    generated_training_data: bool
    learned_generator: bool
    heldout_loss: bool
    adaptive_selection: bool


class Tolerance(_Model):
    atol: NonNeg
    rtol: NonNeg
    min_cosine: Annotated[float, Field(ge=-1, le=1)] | None = None


class OptimizerConfig(_Model):
    learning_rate: NonNeg
    beta1: Unit
    beta2: Unit
    eps: NonNeg
    weight_decay: NonNeg | None = None
    grad_clip_norm: NonNeg | None = None


class GateCheck(_Model):
    metric: str
    measures: str
    min: float | None = None
    max: float | None = None
    one_of: Annotated[list[str], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _bounded(self) -> GateCheck:
        _needs_bound(self, ("min", "max", "one_of", "min_exclusive"))
        return self


class SpecDataset(_Model):
    name: str
    hf_path: str
    split: str
    n_examples: PosInt


class SpecOptimizer(_Model):
    name: str
    lr: NonNeg


class SpecEval(_Model):
    benchmark: str
    metric: str
    n_examples: PosInt
    aggregation: str | None


class CorrectnessPath(_Model):
    id: str
    kind: str
    baseline_revision: str
    reference_revision: str
    tolerances: dict[str, Tolerance]


class CorrectnessPreflight(_Model):
    required: bool
    status: str
    paths: list[CorrectnessPath]


class ActivationGate(_Model):
    applicable: bool
    reason: str
    checks: list[GateCheck]


class RestorationArm(_Model):
    name: str
    optimizer: str
    optimizer_config: OptimizerConfig


class RestorationGroup(_Model):
    arms: Annotated[list[RestorationArm], Field(min_length=1)]


class RestorationPreflight(_Model):
    applicable: bool
    reason: str
    fixed_batch_required: bool
    groups: list[RestorationGroup]


class DecisionCriterion(_Model):
    id: str
    metric: str
    weights: dict[str, float]
    margin: float
    bounds: Annotated[list[float], Field(min_length=2, max_length=2)]


class DecisionRule(_Model):
    version: int
    estimand: str
    unit: str
    seeds: list[int]
    alpha: Unit
    method: str
    criteria: Annotated[list[DecisionCriterion], Field(min_length=1)]


class SpecArm(_Model):
    name: str
    loss: str
    seed: int
    lr: NonNeg
    updates_per_batch: PosInt


class Budget(_Model):
    gpu_hours: NonNeg
    max_wall_minutes: NonNeg


class GenerationAudit(_Model):
    required: bool
    answer_comparison: str
    min_sample_size: NonNegInt
    max_label_errors: NonNegInt
    max_eval_overlaps: NonNegInt


class FeasibilityCheck(_Model):
    status: str
    problems: list[str]
    wall_seconds: float | None
    gpu_hours: float | None
    known_gpu_hours: float
    phases: dict[str, JsonValue]


class ExperimentSpec(_Model):
    """The brief's saved experiment spec (verbatim; no `kind` key)."""

    title: str
    hypothesis: str
    method: str
    base_model: str
    lora_rank: PosInt
    training_type: str
    dataset: SpecDataset
    optimizer: SpecOptimizer
    steps: PosInt
    batch_size: PosInt
    max_seq_len: PosInt
    eval: SpecEval
    baseline: str
    experiment_features: ExperimentFeatures
    correctness_preflight: CorrectnessPreflight
    activation_gate: ActivationGate
    restoration_preflight: RestorationPreflight
    success_criterion: str
    decision_rule: DecisionRule
    primary_endpoint: str
    arms: Annotated[list[SpecArm], Field(min_length=1)]
    feasibility_required: bool
    feasibility: JsonValue
    budget: Budget
    generation_audit: GenerationAudit
    command: str
    feasibility_check: FeasibilityCheck


# ----------------------------------------------------------------------------- bounded_diagnostic


class OriginalPlanRef(_Model):
    file: str
    sha256: Sha256
    experiment_version: str
    kept_intact: Literal[True]


class Authorization(_Model):
    source: str
    launch_mode: str
    scope: str
    only_authorized_run: bool


class Initialization(_Model):
    source: str
    require_observed_successful_load: bool
    trained_pilot_weights_allowed: bool


class Treatment(_Model):
    arm: str
    loss: Literal["dppo_binary_tv"]
    delta: NonNeg
    ratio_cap: NonNeg
    variant: str
    variant_note: str
    anchor: Literal["sampler_logprobs"]
    divergence: str
    reference_revision: str


class CounterfactualBaseline(_Model):
    loss: str
    ppo_eps: NonNeg
    trained: bool
    note: str


class DiagnosticOptimizer(_Model):
    name: Literal["adamw"]
    learning_rate: NonNeg
    beta1: Unit
    beta2: Unit
    eps: NonNeg
    weight_decay: NonNeg
    grad_clip_norm: NonNeg


class Sampling(_Model):
    renderer: str
    dataset: str
    split: Literal["train"]
    temperature: NonNeg
    max_tokens: PosInt


class LossNormalization(_Model):
    mode: Literal["sum", "token_mean"]
    denominator: str
    reason: str


class FixedSettings(_Model):
    base_model: str
    lora_rank: PosInt
    seed: int
    initialization: Initialization
    treatment: Treatment
    counterfactual_baseline: CounterfactualBaseline
    optimizer: DiagnosticOptimizer
    sampling: Sampling
    advantages: Literal["group_mean_centered"]
    loss_normalization: LossNormalization


class Schedule(_Model):
    sampling_batches: Annotated[int, Field(ge=1, le=1)]
    groups_per_batch: PosInt
    group_size: PosInt
    minibatches_per_epoch: PosInt
    groups_per_minibatch: PosInt
    complete_groups_only: bool
    epochs: PosInt
    max_optimizer_updates: PosInt
    new_sampling_after_batch: Literal[False]
    old_logprob_refresh: Literal[False]
    frozen_fields: Annotated[list[str], Field(min_length=1)]
    assert_hashes_before_every_reuse: bool
    record_sampler_checkpoint: bool

    @model_validator(mode="after")
    def _consistent(self) -> Schedule:
        if self.minibatches_per_epoch * self.groups_per_minibatch != self.groups_per_batch:
            raise rule_error("groups_per_minibatch",
                             "minibatches_per_epoch x groups_per_minibatch must equal groups_per_batch")
        if self.max_optimizer_updates > self.epochs * self.minibatches_per_epoch:
            raise rule_error("max_optimizer_updates", "exceeds epochs x minibatches_per_epoch")
        return self


class Caps(_Model):
    max_wall_minutes: NonNeg
    wall_clock_includes: list[str]
    gpu_hours_cap: NonNeg
    gpu_hours_cap_source: str
    stop_rule: str
    on_setup_exhausting_cap: str
    check_remaining_budget_before_service_work: bool


class Sentinels(_Model):
    source: str
    compare: str
    after_updates: Annotated[list[NonNegInt], Field(min_length=1)]
    purpose: str


class Recording(_Model):
    before_each_loss_and_update: Annotated[list[str], Field(min_length=1)]
    sentinels: Sentinels


class AnalysisCriterion(_Model):
    id: str
    metric: str
    measures: str
    pooling: Literal["token_weighted_ratio", "pooled_quantile", "token_count_sum"]
    min: float | None = None
    max: float | None = None
    min_exclusive: float | None = None
    applies_when: str | None = None

    @model_validator(mode="after")
    def _bounded(self) -> AnalysisCriterion:
        _needs_bound(self, ("min", "max", "one_of", "min_exclusive"))
        return self


class Analysis(_Model):
    scope: str
    pooling: str
    selection_rule: str
    criteria: Annotated[list[AnalysisCriterion], Field(min_length=1)]
    engagement_exclusions: list[str]
    original_gate_report: str


class Outcomes(_Model):
    inactive: str
    active: str
    verdict: str


class UnavailableReference(_Model):
    ref: str
    reason: str


class PlanDeviation(_Model):
    field: Literal["model", "objective", "effective_batch", "steps", "dataset", "evaluator", "endpoint"]
    original: str
    effective: str
    reason: str


class DeclaredServiceWork(_Model):
    id: str
    stage: str
    optimizer_updates: Annotated[int, Field(ge=0)]
    sampling_batches: Annotated[int, Field(ge=0)]
    client: str
    reason: Annotated[str, Field(min_length=1)]


class ServiceWork(_Model):
    """Every optimizer update and sampling batch of the session, declared before execution (issue 11 §5)."""

    declared_before_execution: Literal[True]
    note: str | None = None
    items: Annotated[list[DeclaredServiceWork], Field(min_length=1)]
    max_total_optimizer_updates: Annotated[int, Field(ge=0)]
    max_total_sampling_batches: Annotated[int, Field(ge=0)]

    @model_validator(mode="after")
    def _totals(self) -> ServiceWork:
        if sum(i.optimizer_updates for i in self.items) != self.max_total_optimizer_updates:
            raise rule_error("max_total_optimizer_updates", "must equal the sum of the items' optimizer_updates")
        if sum(i.sampling_batches for i in self.items) != self.max_total_sampling_batches:
            raise rule_error("max_total_sampling_batches", "must equal the sum of the items' sampling_batches")
        if len({i.id for i in self.items}) != len(self.items):
            raise rule_error("items", "ids must be unique")
        return self


class BoundedDiagnostic(_Model):
    kind: Literal["bounded_diagnostic"]
    version: Annotated[int, Field(ge=1, le=1)]
    plan_id: str
    title: str
    original_plan: OriginalPlanRef
    authorization: Authorization
    question: str
    original_hypothesis_tested: bool
    tested_instead: str
    experiment_features: ExperimentFeatures
    fixed_settings: FixedSettings
    schedule: Schedule
    caps: Caps
    recording: Recording
    analysis: Analysis
    forbidden: Annotated[list[str], Field(min_length=1)]
    outcomes: Outcomes
    unavailable_references: list[UnavailableReference]
    deviations: list[PlanDeviation]
    service_work: ServiceWork | None = None

    @model_validator(mode="after")
    def _scope_and_sentinels(self) -> BoundedDiagnostic:
        if self.service_work is not None:
            diag = [i for i in self.service_work.items if i.stage == "diagnostic"]
            if sum(i.optimizer_updates for i in diag) != self.schedule.max_optimizer_updates:
                raise rule_error("service_work.items", "the diagnostic's optimizer_updates must equal "
                                 "schedule.max_optimizer_updates")
            if sum(i.sampling_batches for i in diag) != self.schedule.sampling_batches:
                raise rule_error("service_work.items", "the diagnostic's sampling_batches must equal schedule.sampling_batches")
        if self.original_hypothesis_tested is False and not self.tested_instead.strip():
            raise rule_error("tested_instead", "must describe the claim tested when original_hypothesis_tested is false")
        cap = self.schedule.max_optimizer_updates
        if any(u > cap for u in self.recording.sentinels.after_updates):
            raise rule_error("recording.sentinels.after_updates", f"an update index exceeds max_optimizer_updates {cap}")
        return self


# ----------------------------------------------------------------------------- rehearsal


class DerivedFrom(_Model):
    path: NonEmptyStr  # relative to the repository root holding the plan file
    sha256: Sha256


class Difference(_Model):
    field: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*)*$")]
    spec: JsonValue
    rehearsal: JsonValue
    reason: NonEmptyStr
    _nullable: ClassVar[frozenset[str]] = frozenset({"spec", "rehearsal"})


class RehearsalPlan(_Model):
    """A complete experiment spec at rehearsal size; its differences from `derived_from` are
    declared one by one, and the spec's gates and thresholds stay as written (see
    check_rehearsal, which needs the derived-from file)."""

    kind: Literal["rehearsal"]
    version: Literal[1]
    plan_id: NonEmptyStr
    label: Literal["rehearsal"]
    purpose: NonEmptyStr
    derived_from: DerivedFrom
    differences: list[Difference]
    spec: ExperimentSpec

    @model_validator(mode="after")
    def _unique_fields(self) -> RehearsalPlan:
        seen: set[str] = set()
        for i, d in enumerate(self.differences):
            if d.field in seen:
                raise rule_error(f"differences[{i}].field", f"{d.field!r} is listed twice")
            seen.add(d.field)
        return self


MODELS: dict[str, type[_Model]] = {
    "experiment_spec": ExperimentSpec, "bounded_diagnostic": BoundedDiagnostic, "rehearsal": RehearsalPlan,
}


# ----------------------------------------------------------------------------- Plan


@dataclass(frozen=True)
class Plan:
    raw: dict[str, Any]
    sha256: str  # of the exact file bytes
    kind: PlanKind
    path: Path | None = None
    data: bytes = field(default=b"", repr=False)
    model: BaseModel | None = field(default=None, repr=False, compare=False)  # the validated pydantic model

    @property
    def name(self) -> str:
        return self.path.name if self.path else f"plan-{self.sha256[:12]}.json"

    @property
    def spec(self) -> dict[str, Any]:
        """The experiment spec this plan runs: the plan itself, or a rehearsal's inner spec."""
        if self.kind == "experiment_spec":
            return self.raw
        if self.kind == "rehearsal":
            spec: dict[str, Any] = self.raw["spec"]
            return spec
        raise PlanError("kind: a bounded_diagnostic plan carries no experiment spec")

    @property
    def base_model(self) -> str:
        if self.kind == "bounded_diagnostic":
            return str(self.raw["fixed_settings"]["base_model"])
        return str(self.spec["base_model"])

    @property
    def planned_model(self) -> str:
        """The model the experiment is about: a rehearsal's derived-from spec names it (its own
        base_model is the declared stand-in), every other plan its base_model."""
        if self.kind == "rehearsal":
            for d in self.raw["differences"]:
                if d["field"] == "base_model":
                    return str(d["spec"])
        return self.base_model

    @property
    def experiment_features(self) -> dict[str, bool]:
        src = self.raw if self.kind == "bounded_diagnostic" else self.spec
        return dict(src["experiment_features"])

    @property
    def budget(self) -> dict[str, float]:
        """{'gpu_hours', 'max_wall_minutes'} that this plan allows."""
        if self.kind == "bounded_diagnostic":
            caps = self.raw["caps"]
            return {"gpu_hours": float(caps["gpu_hours_cap"]), "max_wall_minutes": float(caps["max_wall_minutes"])}
        b = self.spec["budget"]
        return {"gpu_hours": float(b["gpu_hours"]), "max_wall_minutes": float(b["max_wall_minutes"])}

    @property
    def deviations(self) -> list[dict[str, str]]:
        """Deviations the plan itself declares (a rehearsal's differences, in the brief's fields)."""
        if self.kind == "rehearsal":
            return [rehearsal_deviation(d) for d in self.raw["differences"]]
        return [dict(d) for d in self.raw.get("deviations", [])]


def detect_kind(raw: Any) -> PlanKind:
    if not isinstance(raw, dict):
        raise _fail("", f"expected object, got {type_name(raw)}")
    if "kind" in raw:
        kind = raw["kind"]
        if kind not in ("bounded_diagnostic", "rehearsal"):
            raise _fail("kind", "expected one of ['bounded_diagnostic', 'rehearsal'] "
                                f"(a saved experiment spec has no kind), got {kind!r}")
        return kind  # type: ignore[no-any-return]
    return "experiment_spec"


def validate_model(raw: Any) -> tuple[PlanKind, BaseModel]:
    """Validate a decoded plan against its kind's model; returns (kind, model) or raises PlanError."""
    kind = detect_kind(raw)
    try:
        return kind, MODELS[kind].model_validate(raw)
    except ValidationError as exc:
        raise PlanError(first_error(exc)) from None


def validate_plan(raw: Any) -> PlanKind:
    """Validate a decoded plan against its kind's schema; returns the kind or raises PlanError."""
    return validate_model(raw)[0]


def parse_plan(data: bytes, path: Path | None = None, *, repo_root: Path | None = None) -> Plan:
    """Decode and validate plan bytes. A rehearsal is also checked against its derived-from spec,
    found under `repo_root` (default: the nearest directory above `path` that holds it)."""
    where = f"{path}: " if path else ""
    try:
        raw = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise PlanError(f"{where}<root>: not UTF-8 ({exc})") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{where}<root>: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:
        raise PlanError(f"{where}<root>: {exc}") from None
    try:
        kind, model = validate_model(raw)
        if kind == "rehearsal":
            check_rehearsal(raw, _derived_from_file(raw["derived_from"]["path"], path, repo_root))
    except PlanError as exc:
        raise PlanError(f"{where}{exc}") from None
    return Plan(raw=raw, sha256=hashlib.sha256(data).hexdigest(), kind=kind, path=path, data=data, model=model)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed")


def load_plan(path: str | Path, *, repo_root: Path | None = None) -> Plan:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read plan file ({exc.strerror})") from None
    return parse_plan(data, path, repo_root=repo_root)


def check_original_plan(diagnostic: Plan, plans_dir: Path | None = None) -> Plan:
    """Load the original plan a diagnostic names, and require its sha256 to match the recorded one."""
    if diagnostic.kind != "bounded_diagnostic":
        raise PlanError("kind: check_original_plan needs a bounded_diagnostic plan")
    ref = diagnostic.raw["original_plan"]
    if plans_dir is None and diagnostic.path is None:
        from dppo_harness.project import plans_dir as project_plans

        plans_dir = project_plans()
    base = plans_dir or diagnostic.path.parent
    original = load_plan(base / ref["file"])
    if original.sha256 != ref["sha256"]:
        raise PlanError(
            f"original_plan.sha256: recorded {ref['sha256']} but {ref['file']} hashes to {original.sha256}"
        )
    return original


# ----------------------------------------------------------------------------- rehearsal rules

# Spec subtrees a rehearsal may not change (its gates and thresholds stay as written), as
# (pattern over the leaf path, exception pattern or None).
_FROZEN = (
    re.compile(r"^activation_gate(\.|\[|$)"),
    re.compile(r"^decision_rule(\.|\[|$)"),
    re.compile(r"^success_criterion$"),
    re.compile(r"^correctness_preflight(\.|\[|$)"),
    re.compile(r"^arms\[\d+\]\.(loss|updates_per_batch)$"),
    re.compile(r"^restoration_preflight(\.|\[|$)"),
)
_FOLLOWS_BASE_MODEL = re.compile(r"^activation_gate\.checks\[(\d+)\]\.one_of(\[\d+\])?$")
_FOLLOWS_LR = re.compile(r"^restoration_preflight\.groups\[\d+\]\.arms\[\d+\]\.optimizer_config\.learning_rate$")
_MISSING: Any = object()
# Brief deviation field for a difference, by the spec's top-level key (default "objective").
_DEVIATION_FIELD_OF = {"base_model": "model", "steps": "steps", "batch_size": "effective_batch",
                       "dataset": "dataset", "eval": "evaluator", "primary_endpoint": "endpoint"}


def _leaves(obj: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(path, value) of every leaf; an empty object or list is a leaf itself."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _parse_path(dotted: str) -> tuple[str | int, ...]:
    out: list[str | int] = []
    for part in dotted.split("."):
        name, *idx = part.split("[")
        out.append(name)
        out += [int(i.rstrip("]")) for i in idx]
    return tuple(out)


def _get(obj: Any, path: tuple[str | int, ...]) -> Any:
    for p in path:
        in_list = isinstance(p, int) and isinstance(obj, list) and p < len(obj)
        if not (in_list or (isinstance(p, str) and isinstance(obj, dict) and p in obj)):
            return _MISSING
        obj = obj[p]
    return obj


def _same(a: Any, b: Any) -> bool:
    """JSON equality that keeps true apart from 1 (and 1 from 1.0 only by value)."""
    if a is _MISSING or b is _MISSING:
        return a is b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) or (
        type(a) in (int, float) and type(b) in (int, float) and a == b)


def _changed_leaves(a: Any, b: Any) -> list[tuple[str | int, ...]]:
    return sorted({p for p, v in _leaves(b) if not _same(_get(a, p), v)}
                  | {p for p, v in _leaves(a) if not _same(_get(b, p), v)}, key=str)


def leaf_differences(a: Any, b: Any) -> dict[str, tuple[Any, Any]]:
    """Field path -> (value in a, value in b) of every leaf where two JSON documents differ
    (None where one side lacks the leaf)."""
    out: dict[str, tuple[Any, Any]] = {}
    for p in _changed_leaves(a, b):
        x, y = _get(a, p), _get(b, p)
        out[format_path(p)] = (None if x is _MISSING else x, None if y is _MISSING else y)
    return out


def _derived_from_file(rel: str, plan_path: Path | None, repo_root: Path | None) -> Path:
    if repo_root is not None:
        return Path(repo_root) / rel
    if plan_path is None:
        raise PlanError("derived_from.path: a rehearsal given as bytes needs repo_root to find its derived-from spec")
    for base in Path(plan_path).resolve().parents:
        if (base / rel).is_file():
            return base / rel
    raise PlanError(f"derived_from.path: {rel} not found in any directory above {plan_path}")


def check_rehearsal(raw: Mapping[str, Any], derived_path: Path) -> None:
    """The rules a rehearsal plan obeys against the spec it derives from (PlanError naming the field):
    the derived-from file's sha256 matches; the frozen subtrees are unchanged; every leaf that
    differs is declared in `differences` with matching values, and every declared difference
    really differs."""
    ref = raw["derived_from"]
    try:
        data = derived_path.read_bytes()
    except OSError as exc:
        raise _fail("derived_from.path", f"cannot read {derived_path} ({exc.strerror})") from None
    got = hashlib.sha256(data).hexdigest()
    if got != ref["sha256"]:
        raise _fail("derived_from.sha256", f"recorded {ref['sha256']} but {ref['path']} hashes to {got}")
    try:
        base_plan = parse_plan(data, derived_path)
    except PlanError as exc:
        raise _fail("derived_from.path", f"not a usable plan ({exc})") from None
    if base_plan.kind != "experiment_spec":
        raise _fail("derived_from.path", f"expected an experiment spec, got kind {base_plan.kind!r}")
    base, spec = base_plan.raw, raw["spec"]
    declared = [(i, d, _parse_path(d["field"])) for i, d in enumerate(raw["differences"])]

    for p in _changed_leaves(base, spec):
        leaf = format_path(p)
        _check_not_frozen(leaf, spec)
        if not any(p[: len(dp)] == dp for _, _, dp in declared):
            raise _fail(f"spec.{leaf}", f"differs from {ref['path']} ({_show(_get(base, p))} -> "
                                        f"{_show(_get(spec, p))}) but is not listed in differences")
    for i, d, dp in declared:
        old, new = _get(base, dp), _get(spec, dp)
        if old is _MISSING or new is _MISSING:
            raise _fail(f"differences[{i}].field", f"{d['field']!r} is not a field of both specs")
        if _same(old, new):
            raise _fail(f"differences[{i}]", f"{d['field']!r} does not differ: both specs have {_show(old)}")
        if not _same(d["spec"], old):
            raise _fail(f"differences[{i}].spec", f"expected {_show(old)} (the value in {ref['path']}), "
                                                  f"got {_show(d['spec'])}")
        if not _same(d["rehearsal"], new):
            raise _fail(f"differences[{i}].rehearsal", f"expected {_show(new)} (the value in spec), "
                                                       f"got {_show(d['rehearsal'])}")


def _check_not_frozen(leaf: str, spec: Mapping[str, Any]) -> None:
    m = _FOLLOWS_BASE_MODEL.match(leaf)
    if m:
        check = spec["activation_gate"]["checks"][int(m.group(1))]
        if check.get("metric") == "executed_base_model" and spec["base_model"] in check.get("one_of", []):
            return  # the executed-model check follows base_model
    if _FOLLOWS_LR.match(leaf) and _same(_get(spec, _parse_path(leaf)), spec["optimizer"]["lr"]):
        return  # the restoration preflight's learning rate follows optimizer.lr
    if any(f.match(leaf) for f in _FROZEN):
        raise _fail(f"spec.{leaf}", "a rehearsal keeps the spec's gates and thresholds as written "
                                    "(activation_gate, decision_rule, success_criterion, correctness_preflight, "
                                    "arms[*].loss, arms[*].updates_per_batch, restoration_preflight)")


def _show(v: Any) -> str:
    return "<absent>" if v is _MISSING else json.dumps(v)


def rehearsal_deviation(d: Mapping[str, Any]) -> dict[str, str]:
    """A declared rehearsal difference as a brief deviation ({field, original, effective, reason})."""
    top = str(d["field"]).split(".")[0].split("[")[0]
    return {"field": _DEVIATION_FIELD_OF.get(top, "objective"),
            "original": f"{d['field']} = {json.dumps(d['spec'])}",
            "effective": f"{d['field']} = {json.dumps(d['rehearsal'])}",
            "reason": f"rehearsal: {d['reason']}"}


# ----------------------------------------------------------------------------- backend + effective config


SERVED_MODEL_UNAVAILABLE = "unavailable"  # BackendInfo.served_model when the service named no model


@dataclass(frozen=True)
class BackendInfo:
    """What actually serves the run. `served_model` is the model that really computes."""

    backend: Literal["local", "tinker"]
    requested_model: str
    served_model: str
    base_url: str | None = None
    sdk_versions: Mapping[str, str] = field(default_factory=dict)
    # Explicit size reductions of the run, each {field, original, effective, reason}.
    size_reductions: Sequence[Mapping[str, str]] = ()

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> BackendInfo:
        return cls(
            backend=m["backend"], requested_model=m["requested_model"], served_model=m["served_model"],
            base_url=m.get("base_url"), sdk_versions=dict(m.get("sdk_versions", {})),
            size_reductions=tuple(m.get("size_reductions", ())),
        )


def backend_deviations(plan: Plan, backend_info: BackendInfo | Mapping[str, Any]) -> list[dict[str, str]]:
    """Deviations that come from where the plan runs, not from the plan itself."""
    info = backend_info if isinstance(backend_info, BackendInfo) else BackendInfo.from_mapping(backend_info)
    out: list[dict[str, str]] = []
    if info.backend == "local":
        out.append({
            "field": "model",
            "original": plan.planned_model,
            "effective": f"{info.served_model} (embedded local CPU server on loopback, answering to the name {plan.base_model})",
            "reason": "no Tinker/Spindle service is reachable from this machine; this run is a local rehearsal of the harness, not a measurement of the planned model",
        })
    elif info.served_model != plan.base_model and not info.served_model.startswith(SERVED_MODEL_UNAVAILABLE):
        out.append({
            "field": "model", "original": plan.base_model, "effective": info.served_model,
            "reason": "the service reported a different model at client creation",
        })
    for red in info.size_reductions:
        d = {k: str(red[k]) for k in ("field", "original", "effective", "reason")}
        if d["field"] not in DEVIATION_FIELDS:
            raise PlanError(f"size_reductions.field: expected one of {list(DEVIATION_FIELDS)}, got {d['field']!r}")
        out.append(d)
    return out


def generation_audit_applicability(plan: Plan) -> dict[str, Any]:
    """Resolve whether the generation audit applies, from the plan's experiment_features.

    generated_training_data=true requires it (overriding a legacy required=false); false makes it
    not applicable unless an explicit contract (generation_audit.required=true) asks for it.
    """
    src = plan.raw if plan.kind == "bounded_diagnostic" else plan.spec
    features = src.get("experiment_features", {})
    explicit = src.get("generation_audit", {}).get("required") if plan.kind != "bounded_diagnostic" else None
    gen = features.get("generated_training_data")
    if gen is True:
        return {"applicable": True, "status": "required",
                "reason": "experiment_features.generated_training_data is true"}
    if explicit is True:
        return {"applicable": True, "status": "required", "reason": "generation_audit.required is true"}
    if gen is False:
        return {"applicable": False, "status": "not_applicable",
                "reason": "experiment_features.generated_training_data is false: no generated training data is used "
                          "(GSM8K train items only), and no explicit contract requires the audit"}
    return {"applicable": None, "status": "unknown",
            "reason": "experiment_features.generated_training_data is missing: applicability cannot be established"}


# The normalization the spec's arms, the gate pilot and the feasibility pilot train with (the spec
# declares none; comparison.NORMALIZATION and gate.NORMALIZATION are this value, checked by a test).
HARNESS_NORMALIZATION = "token_mean"


def effective_config(plan: Plan, backend_info: BackendInfo | Mapping[str, Any]) -> dict[str, Any]:
    """The configuration that will actually run, in the brief's feasibility.effective_config terms."""
    info = backend_info if isinstance(backend_info, BackendInfo) else BackendInfo.from_mapping(backend_info)
    raw = plan.raw if plan.kind == "bounded_diagnostic" else plan.spec
    if plan.kind != "bounded_diagnostic":
        body: dict[str, Any] = {
            "base_model": raw["base_model"],
            "lora_rank": raw["lora_rank"],
            "arms": [dict(a) for a in raw["arms"]],
            "steps": raw["steps"],
            "batch_size": raw["batch_size"],
            "max_seq_len": raw["max_seq_len"],
            "n_eval": raw["eval"]["n_examples"],
            "optimizer": dict(raw["optimizer"]),
            "seed": raw["arms"][0]["seed"],
        }
    else:
        fs, sch = raw["fixed_settings"], raw["schedule"]
        body = {
            "base_model": fs["base_model"],
            "lora_rank": fs["lora_rank"],
            "arms": [{"name": fs["treatment"]["arm"], "loss": fs["treatment"]["loss"], "trained": True},
                     {"name": "ppo_counterfactual", "loss": fs["counterfactual_baseline"]["loss"], "trained": False}],
            "steps": sch["max_optimizer_updates"],
            "batch_size": sch["groups_per_batch"] * sch["group_size"],
            "sequences_per_update": sch["groups_per_minibatch"] * sch["group_size"],
            "max_tokens": fs["sampling"]["max_tokens"],
            "n_eval": 0,
            "seed": fs["seed"],
            "optimizer": dict(fs["optimizer"]),
            "treatment": dict(fs["treatment"]),
            "counterfactual_baseline": dict(fs["counterfactual_baseline"]),
            "sampling": dict(fs["sampling"]),
            "loss_normalization": dict(fs["loss_normalization"]),
            "schedule": dict(sch),
            "caps": dict(raw["caps"]),
            "analysis_criteria": [dict(c) for c in raw["analysis"]["criteria"]],
        }
    from dppo_harness import losses, tokenizer

    # Declared for every plan: the renderer's thinking mode (read off a rendered prompt) and the
    # loss normalization, against the cookbook ppo's sum.
    mode = raw["fixed_settings"]["loss_normalization"]["mode"] if plan.kind == "bounded_diagnostic" else HARNESS_NORMALIZATION
    declared = {"renderer": tokenizer.default_renderer_declaration(),
                "loss_normalization": losses.normalization_declaration(mode)}
    plan_block: dict[str, Any] = {"name": plan.name, "kind": plan.kind, "sha256": plan.sha256}
    if plan.kind == "rehearsal":
        plan_block.update(label="rehearsal", derived_from=dict(plan.raw["derived_from"]))
    return {
        "plan": plan_block,
        "backend": {
            "backend": info.backend,
            "requested_model": info.requested_model,
            "served_model": info.served_model,
            "sdk_versions": dict(info.sdk_versions),
        },
        "pinned": {
            "ppo_eps": constants.PPO_EPS, "dppo_delta": constants.DPPO_DELTA,
            "dppo_ratio_cap": constants.DPPO_RATIO_CAP, "renderer": constants.RENDERER_NAME,
            "reference_revision": constants.REFERENCE_REVISION, "baseline_revision": constants.BASELINE_REVISION,
        },
        "budget": plan.budget,
        "generation_audit": generation_audit_applicability(plan),
        "config": body,
        **declared,
        "deviations": plan.deviations + backend_deviations(plan, info),
    }

"""Strict pydantic models of the three plan kinds (docs/plans.md): the saved experiment spec,
verbatim as exchanged (no `kind` key), the requester's `bounded_diagnostic`, and a `rehearsal` (a
complete spec at rehearsal size with every difference from its saved spec declared). An invalid
plan raises `PlanError` whose message starts with the field path. The strict base and its one-line
error wording (`describe`; a cross-field rule names its sub-field through `rule_error`) serve result.json too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, ClassVar, Literal, NoReturn, cast, get_args

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

# strict: no coercion ("1" is not a number, 1.0 not an int, 1 not a bool); no NaN/inf; no extra keys.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
RULE = "rule"


def rule_error(at: str, message: str) -> PydanticCustomError:
    """A cross-field rule's failure, reported at `at` (dotted path below the model, '' = the model)."""
    return PydanticCustomError(RULE, "{message}", {"message": message, "at": at})


def type_name(value: object) -> str:
    return {type(None): "null", dict: "object"}.get(type(value), type(value).__name__)


def format_path(loc: Sequence[str | int]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


_EXPECTED = {
    "float_type": "number",
    "int_type": "integer",
    "bool_type": "bool",
    "string_type": "string",
    "list_type": "list",
    "dict_type": "object",
    "model_type": "object",
    "model_attributes_type": "object",
}
_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "less_than_equal": ("<=", "le"),
    "greater_than": (">", "gt"),
    "less_than": ("<", "lt"),
}


def describe(err: ErrorDetails) -> str:
    """`path: message` for one pydantic error, in the harness's wording."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    loc = list(err["loc"])
    if kind == RULE:
        loc += [p for p in str(ctx["at"]).split(".") if p]
        msg = str(ctx["message"])
    elif kind == "missing":
        msg = "missing required key"
    elif kind == "extra_forbidden":
        msg = "unknown key"
    elif kind in _EXPECTED:
        msg = f"expected {_EXPECTED[kind]}, got {type_name(value)}"
    elif kind == "finite_number":
        msg = f"expected a finite number, got {value!r}"
    elif kind == "literal_error" and isinstance(value, bool) and ctx["expected"] in ("True", "False"):
        msg = f"expected {ctx['expected'].lower()}, got {str(value).lower()}"
    elif kind == "literal_error":
        msg = f"expected one of [{ctx['expected']}], got {value!r}"
    elif kind == "string_pattern_mismatch":
        msg = f"expected a string matching {ctx['pattern']!r}, got {value!r}"
    elif kind in _BOUNDS:
        op, bound = _BOUNDS[kind]
        msg = f"expected a number {op} {ctx[bound]}, got {value!r}"
    elif kind == "too_short":
        msg = f"expected at least {ctx['min_length']} items, got {ctx['actual_length']}"
    elif kind == "too_long":
        msg = f"expected at most {ctx['max_length']} items, got {ctx['actual_length']}"
    else:
        msg = err["msg"]
    return f"{format_path(loc) or '<root>'}: {msg}"


def first_error(exc: ValidationError) -> str:
    """The first error (in field order), plus how many more there were."""
    errors = exc.errors(include_url=False)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return describe(errors[0]) + more


PlanKind = Literal["experiment_spec", "bounded_diagnostic", "rehearsal"]
# A deviation's `field` is one of these (the structured output's deviation fields; no other is reported).
DeviationField = Literal["model", "objective", "effective_batch", "steps", "dataset", "evaluator", "endpoint"]
DEVIATION_FIELDS: tuple[str, ...] = get_args(DeviationField)


class PlanError(ValueError):
    """A plan file that cannot be used; the message names the offending field path."""


NonNeg = Annotated[float, Field(ge=0)]
Unit = Annotated[float, Field(ge=0, le=1)]
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
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


def _fail(path: str, msg: str) -> PlanError:
    return PlanError(f"{path or '<root>'}: {msg}")


class _Bounded(StrictModel):
    """A check that states at least one bound, its min not above its max (the fields are the
    subclass's, so that they keep their place in its field order)."""

    @model_validator(mode="after")
    def _bounded(self) -> _Bounded:
        keys = ("min", "max", "one_of", "min_exclusive")
        if all(getattr(self, k, None) is None for k in keys):
            raise rule_error("", f"expected at least one of {', '.join(keys)}")
        lo, hi = getattr(self, "min", None), getattr(self, "max", None)
        if lo is not None and hi is not None and lo > hi:
            raise rule_error("max", f"max {hi!r} is below min {lo!r}")
        return self


# ----------------------------------------------------------------------------- experiment_spec


class ExperimentFeatures(StrictModel):
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


class Tolerance(StrictModel):
    atol: NonNeg
    rtol: NonNeg
    min_cosine: Annotated[float, Field(ge=-1, le=1)] | None = None


class OptimizerConfig(StrictModel):
    learning_rate: NonNeg
    beta1: Unit
    beta2: Unit
    eps: NonNeg
    weight_decay: NonNeg | None = None
    grad_clip_norm: NonNeg | None = None


class GateCheck(_Bounded):
    metric: str
    measures: str
    min: float | None = None
    max: float | None = None
    one_of: Annotated[list[str], Field(min_length=1)] | None = None


class SpecDataset(StrictModel):
    name: str
    hf_path: str
    split: str
    n_examples: PosInt


class SpecOptimizer(StrictModel):
    name: str
    lr: NonNeg


class SpecEval(StrictModel):
    benchmark: str
    metric: str
    n_examples: PosInt
    aggregation: str | None


class CorrectnessPath(StrictModel):
    id: str
    kind: str
    baseline_revision: str
    reference_revision: str
    tolerances: dict[str, Tolerance]


class CorrectnessPreflight(StrictModel):
    required: bool
    status: str
    paths: list[CorrectnessPath]


class ActivationGate(StrictModel):
    applicable: bool
    reason: str
    checks: list[GateCheck]


class RestorationArm(StrictModel):
    name: str
    optimizer: str
    optimizer_config: OptimizerConfig


class RestorationGroup(StrictModel):
    arms: Annotated[list[RestorationArm], Field(min_length=1)]


class RestorationPreflight(StrictModel):
    applicable: bool
    reason: str
    fixed_batch_required: bool
    groups: list[RestorationGroup]


class DecisionCriterion(StrictModel):
    id: str
    metric: str
    weights: dict[str, float]
    margin: float
    bounds: Annotated[list[float], Field(min_length=2, max_length=2)]


class DecisionRule(StrictModel):
    version: int
    estimand: str
    unit: str
    seeds: list[int]
    alpha: Annotated[float, Field(gt=0, lt=1)]
    method: str
    criteria: Annotated[list[DecisionCriterion], Field(min_length=1)]


class SpecArm(StrictModel):
    name: str
    loss: str
    seed: int
    lr: NonNeg
    updates_per_batch: PosInt


class Budget(StrictModel):
    gpu_hours: NonNeg
    max_wall_minutes: NonNeg


class GenerationAudit(StrictModel):
    required: bool
    answer_comparison: str
    min_sample_size: NonNegInt
    max_label_errors: NonNegInt
    max_eval_overlaps: NonNegInt


class FeasibilityCheck(StrictModel):
    status: str
    problems: list[str]
    wall_seconds: float | None
    gpu_hours: float | None
    known_gpu_hours: float
    phases: dict[str, JsonValue]


class ExperimentSpec(StrictModel):
    """The saved experiment spec, verbatim as exchanged (no `kind` key)."""

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
    launch: Launch | None = None  # not in the exchange's format: a user adds it to authorize stages


# ----------------------------------------------------------------------------- bounded_diagnostic


class Initialization(StrictModel):
    source: str
    require_observed_successful_load: bool
    trained_pilot_weights_allowed: bool


class Treatment(StrictModel):
    arm: str
    loss: Literal["dppo_binary_tv"]
    delta: NonNeg
    ratio_cap: NonNeg
    variant: str
    variant_note: str
    anchor: Literal["sampler_logprobs"]
    divergence: str
    reference_revision: str


class CounterfactualBaseline(StrictModel):
    loss: str
    ppo_eps: NonNeg
    trained: bool
    note: str


class DiagnosticOptimizer(StrictModel):
    name: Literal["adamw"]
    learning_rate: NonNeg
    beta1: Unit
    beta2: Unit
    eps: NonNeg
    weight_decay: NonNeg
    grad_clip_norm: NonNeg


class Sampling(StrictModel):
    renderer: str
    dataset: str
    split: Literal["train"]
    temperature: NonNeg
    max_tokens: PosInt


class LossNormalization(StrictModel):
    mode: Literal["sum", "token_mean"]
    denominator: str
    reason: str


class FixedSettings(StrictModel):
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


class DiagnosticSchedule(StrictModel):
    """A bounded diagnostic's schedule: one sampled batch reused over epochs of minibatches."""

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
    def _consistent(self) -> DiagnosticSchedule:
        if self.minibatches_per_epoch * self.groups_per_minibatch != self.groups_per_batch:
            raise rule_error(
                "groups_per_minibatch", "minibatches_per_epoch x groups_per_minibatch must equal groups_per_batch"
            )
        if self.max_optimizer_updates > self.epochs * self.minibatches_per_epoch:
            raise rule_error("max_optimizer_updates", "exceeds epochs x minibatches_per_epoch")
        return self


class Caps(StrictModel):
    max_wall_minutes: NonNeg
    wall_clock_includes: list[str]
    gpu_hours_cap: NonNeg
    gpu_hours_cap_source: str
    stop_rule: str
    on_setup_exhausting_cap: str
    check_remaining_budget_before_service_work: bool


class Sentinels(StrictModel):
    source: str
    compare: str
    after_updates: Annotated[list[NonNegInt], Field(min_length=1)]
    purpose: str


class Recording(StrictModel):
    before_each_loss_and_update: Annotated[list[str], Field(min_length=1)]
    sentinels: Sentinels


class Outcomes(StrictModel):
    inactive: str
    active: str
    verdict: str


class UnavailableReference(StrictModel):
    ref: str
    reason: str


class OriginalPlanRef(StrictModel):
    file: str
    sha256: Sha256
    experiment_version: str
    kept_intact: Literal[True]


# Stages that train beyond setup: on a service that is not the embedded server (a rehearsal, never
# refused) each needs the plan's launch block to authorize it, in the requester's words: the scope
# is data in the plan, never a code edit. An unauthorized one is refused before any client exists,
# in one line saying what would authorize it. The preflight (connectivity, restoration probes,
# timing pilot) is the setup every authorized stage needs, so it is never refused.
AuthorizableStage = Literal["gate", "diagnostic", "comparison"]
AUTHORIZABLE_STAGES: tuple[str, ...] = get_args(AuthorizableStage)


class Launch(StrictModel):
    """What this launch authorizes, in the requester's words, and the stages that it lets run
    on a real service."""

    source: NonEmptyStr
    launch_mode: str
    scope: NonEmptyStr
    only_authorized_run: bool
    authorized_stages: list[AuthorizableStage]

    @model_validator(mode="after")
    def _unique(self) -> Launch:
        if len(set(self.authorized_stages)) != len(self.authorized_stages):
            raise rule_error("authorized_stages", "lists a stage twice")
        return self


def unauthorized_stages(launch: Launch | None, stages: Sequence[str]) -> list[str]:
    """The selected stages that need authorization and that `launch` does not authorize."""
    allowed = set(launch.authorized_stages) if launch is not None else set()
    return [s for s in stages if s in AUTHORIZABLE_STAGES and s not in allowed]


def launch_refusal(
    plan_name: str,
    launch: Launch | None,
    stages: Sequence[str],
    *,
    embedded: bool,
    service: str,
    stated_in: str | None = None,
) -> str | None:
    """The one-line refusal for running `stages` under this launch, or None when allowed.
    `stated_in`: the resolution file the launch comes from, when the plan (a verbatim spec) holds none."""
    what = ", ".join(unauthorized_stages(launch, stages))
    if embedded or not what:
        return None
    if launch is None:
        has = f"plan {plan_name} carries no launch block"
    else:
        where = f" (stated in {stated_in})" if stated_in else ""
        has = (
            f"plan {plan_name}'s launch{where} authorizes {', '.join(launch.authorized_stages) or 'no training stage'} "
            f"({launch.scope})"
        )
    return (
        f"launch scope: stage {what} is not authorized on {service} (not the embedded server): {has}; a plan "
        f"whose launch.authorized_stages lists {what} would authorize it"
    )


def launch_undecided_refusal(
    plan_name: str, launch: Launch | None, stages: Sequence[str], *, service: str, seen: str
) -> str | None:
    """The one-line refusal when the stages need this launch's authorization unless `service` is the
    embedded server, and the check could not tell (`seen`: what the connectivity preflight saw).
    None when nothing selected needs authorization."""
    what = ", ".join(unauthorized_stages(launch, stages))
    if not what:
        return None
    return (
        f"launch scope: stage {what} is authorized only on the embedded server by plan {plan_name}, and whether "
        f"{service} is that server could not be told ({seen}); run again when the service answers, or with a plan "
        f"whose launch.authorized_stages lists {what}"
    )


class AnalysisCriterion(_Bounded):
    id: str
    metric: str
    measures: str
    pooling: Literal["token_weighted_ratio", "pooled_quantile", "token_count_sum"]
    min: float | None = None
    max: float | None = None
    min_exclusive: float | None = None
    applies_when: str | None = None


class Analysis(StrictModel):
    scope: str
    pooling: str
    selection_rule: str
    criteria: Annotated[list[AnalysisCriterion], Field(min_length=1)]
    engagement_exclusions: list[str]
    original_gate_report: str


class PlanDeviation(StrictModel):
    field: DeviationField
    original: str
    effective: str
    reason: str


class DeclaredServiceWork(StrictModel):
    id: str
    stage: str
    optimizer_updates: Annotated[int, Field(ge=0)]
    sampling_batches: Annotated[int, Field(ge=0)]
    client: str
    reason: Annotated[str, Field(min_length=1)]


class ServiceWork(StrictModel):
    """Every optimizer update and sampling batch of the session, declared before execution
    (so executed work can be checked against what was planned)."""

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


class BoundedDiagnostic(StrictModel):
    kind: Literal["bounded_diagnostic"]
    version: Annotated[int, Field(ge=1, le=1)]
    plan_id: str
    title: str
    original_plan: OriginalPlanRef
    launch: Launch
    question: str
    original_hypothesis_tested: bool
    tested_instead: str
    experiment_features: ExperimentFeatures
    fixed_settings: FixedSettings
    schedule: DiagnosticSchedule
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
                raise rule_error(
                    "service_work.items", "the diagnostic's optimizer_updates must equal schedule.max_optimizer_updates"
                )
            if sum(i.sampling_batches for i in diag) != self.schedule.sampling_batches:
                raise rule_error(
                    "service_work.items", "the diagnostic's sampling_batches must equal schedule.sampling_batches"
                )
        if self.original_hypothesis_tested is False and not self.tested_instead.strip():
            raise rule_error(
                "tested_instead", "must describe the claim tested when original_hypothesis_tested is false"
            )
        cap = self.schedule.max_optimizer_updates
        if any(u > cap for u in self.recording.sentinels.after_updates):
            raise rule_error(
                "recording.sentinels.after_updates", f"an update index exceeds max_optimizer_updates {cap}"
            )
        return self


# ----------------------------------------------------------------------------- rehearsal


class DerivedFrom(StrictModel):
    path: NonEmptyStr  # relative to the repository root holding the plan file
    sha256: Sha256


class Difference(StrictModel):
    field: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*)*$")]
    spec: JsonValue
    rehearsal: JsonValue
    reason: NonEmptyStr
    _nullable: ClassVar[frozenset[str]] = frozenset({"spec", "rehearsal"})


class RehearsalPlan(StrictModel):
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
    launch: Launch | None = None

    @model_validator(mode="after")
    def _unique_fields(self) -> RehearsalPlan:
        seen: set[str] = set()
        for i, d in enumerate(self.differences):
            if d.field in seen:
                raise rule_error(f"differences[{i}].field", f"{d.field!r} is listed twice")
            seen.add(d.field)
        return self


PlanModel = ExperimentSpec | BoundedDiagnostic | RehearsalPlan
MODELS: dict[PlanKind, type[PlanModel]] = {
    "experiment_spec": ExperimentSpec,
    "bounded_diagnostic": BoundedDiagnostic,
    "rehearsal": RehearsalPlan,
}


def detect_kind(raw: JsonValue) -> PlanKind:
    if not isinstance(raw, dict):
        raise _fail("", f"expected object, got {type_name(raw)}")
    if "kind" not in raw:
        return "experiment_spec"
    if raw["kind"] in ("bounded_diagnostic", "rehearsal"):
        return cast(PlanKind, raw["kind"])
    raise _fail(
        "kind",
        f"expected one of ['bounded_diagnostic', 'rehearsal'] (a saved experiment spec has no kind), got {raw['kind']!r}",
    )


def validate_model(raw: JsonValue) -> tuple[PlanKind, PlanModel]:
    """Validate a decoded plan against its kind's model; returns (kind, model) or raises PlanError."""
    kind = detect_kind(raw)
    try:
        return kind, MODELS[kind].model_validate(raw)
    except ValidationError as exc:
        raise PlanError(first_error(exc)) from None


def decode(data: bytes, path: Path | None = None) -> JsonValue:
    """The JSON value of plan bytes (UTF-8, no NaN/inf), or PlanError naming the file."""
    where = f"{path}: " if path else ""
    try:
        value: JsonValue = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
        return value
    except UnicodeDecodeError as exc:
        raise PlanError(f"{where}<root>: not UTF-8 ({exc})") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{where}<root>: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:
        raise PlanError(f"{where}<root>: {exc}") from None


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"non-finite number {name} is not allowed")

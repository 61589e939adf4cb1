"""The loaded plan (exact bytes, sha256, validated model, typed run config), the backend's
deviations and the effective config. Stages read `Plan.run`, `Plan.experiment`,
`Plan.diagnostic` and `Plan.launch`, never the raw JSON.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal, cast

from pydantic import BaseModel, ValidationError

from dppo_harness import constants
from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.loss import loss_registry as losses
from dppo_harness.plans.models import (
    MODELS,
    BoundedDiagnostic,
    ExperimentSpec,
    Launch,
    PlanError,
    PlanKind,
    PlanModel,
    RehearsalPlan,
    decode,
    describe,
    detect_kind,
    validate_model,
)
from dppo_harness.plans.rehearsal import _derived_from_file, check_rehearsal, rehearsal_deviation
from dppo_harness.plans.resolution import Resolution, load_resolution, quoted_values, resolution_path
from dppo_harness.plans.run_config import RunConfig, build_run_config, registered_dataset
from dppo_harness.project import plans_dir as project_plans

BackendKind = Literal["local", "tinker"]  # the embedded server ("local") or a service at TINKER_BASE_URL


@dataclass(frozen=True)
class Plan:
    raw: JsonObject  # the decoded JSON (the plans package's business; stages read the models)
    sha256: str  # of the exact file bytes
    kind: PlanKind
    model: PlanModel = field(repr=False, compare=False)  # the validated pydantic model
    path: Path | None = None
    data: bytes = field(default=b"", repr=False)
    run: RunConfig | None = field(default=None, repr=False, compare=False)  # typed run config (spec kinds)
    resolution: Resolution | None = field(default=None, repr=False, compare=False)  # the file beside the plan

    @property
    def name(self) -> str:
        return self.path.name if self.path else f"plan-{self.sha256[:12]}.json"

    @property
    def spec_run(self) -> RunConfig:
        """The typed run config of a spec-kind plan (built at load); PlanError for a bounded
        diagnostic (its original plan's is `spec_plan.spec_run`)."""
        if self.run is None:
            raise PlanError(f"kind: a {self.kind} plan has no run config of its own (see Plan.spec_plan)")
        return self.run

    @property
    def spec(self) -> JsonObject:
        """The experiment spec this plan runs as JSON: the plan itself, or a rehearsal's inner spec."""
        if self.kind == "bounded_diagnostic":
            raise PlanError("kind: a bounded_diagnostic plan carries no experiment spec")
        return self.raw if self.kind == "experiment_spec" else cast(JsonObject, self.raw["spec"])

    @property
    def spec_bytes(self) -> bytes:
        """The executed spec as bytes: the file's exact bytes for a saved spec, a rehearsal's inner
        spec as JSON (what the spec validator CLI reads)."""
        if self.kind == "experiment_spec":
            return self.data
        return json.dumps(self.spec).encode()

    @property
    def experiment(self) -> ExperimentSpec:
        """The validated experiment spec this plan runs (a rehearsal's inner spec)."""
        if isinstance(self.model, RehearsalPlan):
            return self.model.spec
        if isinstance(self.model, ExperimentSpec):
            return self.model
        raise PlanError("kind: a bounded_diagnostic plan carries no experiment spec (see Plan.spec_plan)")

    @property
    def diagnostic(self) -> BoundedDiagnostic:
        if not isinstance(self.model, BoundedDiagnostic):
            raise PlanError(f"kind: {self.kind} is not a bounded_diagnostic plan")
        return self.model

    @property
    def launch(self) -> Launch | None:
        """The plan's own launch block, else its resolution file's (a verbatim spec holds none)."""
        own = self.model.launch
        return own if own is not None or self.resolution is None else self.resolution.model.launch

    @property
    def launch_stated_in(self) -> str | None:
        """The resolution file's name when the launch comes from it, else None (the plan's own, or none)."""
        own = self.model.launch
        return self.resolution.file if own is None and self.resolution and self.resolution.model.launch else None

    @cached_property
    def original(self) -> Plan:
        """A bounded diagnostic's original plan, its sha256 the recorded one."""
        ref = self.diagnostic.original_plan
        path = project_plans() / ref.file
        if self.path is not None and (self.path.parent / ref.file).is_file():
            path = self.path.parent / ref.file  # else a diagnostic plan kept elsewhere names a project plan
        original = load_plan(path)
        if original.kind != "experiment_spec":
            raise PlanError(f"original_plan.file: {ref.file} is a {original.kind} plan, not an experiment spec")
        if original.sha256 != ref.sha256:
            raise PlanError(f"original_plan.sha256: recorded {ref.sha256} but {ref.file} hashes to {original.sha256}")
        return original

    @property
    def spec_plan(self) -> Plan:
        """The plan whose experiment spec this session executes or diagnoses: itself, or a
        diagnostic's original plan. Its `run` is always set."""
        return self.original if self.kind == "bounded_diagnostic" else self

    @property
    def base_model(self) -> str:
        if self.kind == "bounded_diagnostic":
            return self.diagnostic.fixed_settings.base_model
        return self.experiment.base_model

    @property
    def planned_model(self) -> str:
        """The model the experiment is about: a rehearsal's derived-from spec names it (its own
        base_model is the declared stand-in), every other plan its base_model."""
        if isinstance(self.model, RehearsalPlan):
            for d in self.model.differences:
                if d.field == "base_model":
                    return str(d.spec)
        return self.base_model

    @property
    def budget(self) -> dict[str, float]:
        """{'gpu_hours', 'max_wall_minutes'} that this plan allows."""
        if self.kind == "bounded_diagnostic":
            caps = self.diagnostic.caps
            return {"gpu_hours": float(caps.gpu_hours_cap), "max_wall_minutes": float(caps.max_wall_minutes)}
        b = self.experiment.budget
        return {"gpu_hours": float(b.gpu_hours), "max_wall_minutes": float(b.max_wall_minutes)}

    @property
    def deviations(self) -> list[dict[str, str]]:
        """Deviations the plan itself declares (a rehearsal's differences, as {field, original,
        effective, reason} with a DEVIATION_FIELDS field)."""
        if isinstance(self.model, RehearsalPlan):
            return [rehearsal_deviation(d) for d in self.model.differences]
        if self.kind == "bounded_diagnostic":
            return [d.model_dump() for d in self.diagnostic.deviations]
        return []


def _run_config(spec: ExperimentSpec, prefix: str, path: Path | None, resolution: Resolution | None) -> RunConfig:
    """`prefix` leads the field paths of a spec inside a rehearsal plan ("spec.")."""
    file = resolution.file if resolution else resolution_path(path or Path("<plan file>")).name
    values, base = quoted_values(spec, resolution, file)
    try:
        return build_run_config(spec, values, base, f"baseline_arm in {file}")
    except PlanError as exc:
        raise PlanError(f"{prefix}{exc}") from None


def _check_resolution(model: PlanModel, resolution: Resolution | None) -> None:
    """A resolution's launch cannot stand beside the plan's own, and a bounded diagnostic states its
    schedule in its own fields."""
    if resolution is None:
        return
    if resolution.model.launch is not None and model.launch is not None:
        raise PlanError(f"{resolution.file}: launch: the plan states its own launch block; state it in one place")
    if (resolution.model.values or resolution.model.baseline_arm) and isinstance(model, BoundedDiagnostic):
        raise PlanError(
            f"{resolution.file}: values: a bounded_diagnostic plan states its schedule and arm in its own fields"
        )


def parse_plan(data: bytes, path: Path | None = None, *, repo_root: Path | None = None) -> Plan:
    """Decode and validate plan bytes. A rehearsal is also checked against its derived-from spec,
    found under `repo_root` (default: the nearest directory above `path` that holds it); every
    spec kind gets its RunConfig; a diagnostic loaded from a file resolves its original plan."""
    where = f"{path}: " if path else ""
    raw = decode(data, path)
    resolution = load_resolution(path)
    try:
        kind, model = validate_model(raw)
        assert isinstance(raw, dict)  # validate_model accepts an object only
        _check_resolution(model, resolution)
        run = None
        if isinstance(model, RehearsalPlan):
            check_rehearsal(model, raw, _derived_from_file(model.derived_from.path, path, repo_root))
            run = _run_config(model.spec, "spec.", path, resolution)
        elif isinstance(model, ExperimentSpec):
            run = _run_config(model, "", path, resolution)
        plan = Plan(raw, hashlib.sha256(data).hexdigest(), kind, model, path, data, run, resolution)
        if isinstance(model, BoundedDiagnostic):
            _check_diagnostic(plan, resolve_original=path is not None)
    except PlanError as exc:
        raise PlanError(f"{where}{exc}") from None
    return plan


def _check_diagnostic(plan: Plan, *, resolve_original: bool) -> None:
    """A diagnostic samples a registered dataset and trains one arm of its original spec, whose
    loss is the DPPO Binary-TV rule the plan kind pins."""
    fs = plan.diagnostic.fixed_settings
    registered_dataset(fs.sampling.dataset, "fixed_settings.sampling.dataset")
    if not resolve_original:
        return
    original = plan.original
    assert original.run is not None
    names = [a.name for a in original.run.arms]
    if fs.treatment.arm not in names:
        raise PlanError(
            f"fixed_settings.treatment.arm: {fs.treatment.arm!r} is not an arm of the original plan "
            f"{plan.diagnostic.original_plan.file} ({names})"
        )
    loss = original.run.arm(fs.treatment.arm).loss
    if loss != losses.DPPO_LOSS:
        raise PlanError(
            f"fixed_settings.treatment.arm: {fs.treatment.arm!r} trains {loss!r} in the original plan, "
            f"not the DPPO Binary-TV loss ({losses.DPPO_LOSS}) a bounded diagnostic measures"
        )


def load_plan(path: str | Path, *, repo_root: Path | None = None) -> Plan:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read plan file ({exc.strerror})") from None
    return parse_plan(data, path, repo_root=repo_root)


# ----------------------------------------------------------------------------- effective config


def generation_audit_applicability(plan: Plan) -> JsonObject:
    """The effective config's `generation_audit`: generated training data requires the audit
    (overriding a legacy required=false); without it, only an explicit contract does."""
    src = plan.diagnostic if plan.kind == "bounded_diagnostic" else plan.experiment
    if src.experiment_features.generated_training_data:
        reason = "experiment_features.generated_training_data is true"
    elif isinstance(src, ExperimentSpec) and src.generation_audit.required:
        reason = "generation_audit.required is true"
    else:
        return {
            "applicable": False,
            "status": "not_applicable",
            "reason": "experiment_features.generated_training_data is false: no generated training data is used "
            "(GSM8K train items only), and no explicit contract requires the audit",
        }
    return {"applicable": True, "status": "required", "reason": reason}


def _dump(m: BaseModel) -> JsonObject:
    """A validated model as the effective config writes it (JSON values, unset optional keys left out)."""
    return m.model_dump(mode="json", exclude_none=True)


def plan_config(plan: Plan) -> JsonObject:
    """The effective config as far as the plan alone decides it (no backend yet)."""
    body: JsonObject
    if plan.run is not None:  # a spec kind
        spec, run = plan.experiment, plan.run
        body = {
            "base_model": spec.base_model,
            "lora_rank": spec.lora_rank,
            "arms": [_dump(a) for a in spec.arms],
            "steps": spec.steps,
            "batch_size": spec.batch_size,
            "max_seq_len": spec.max_seq_len,
            "max_tokens": run.max_tokens,
            "n_eval": spec.eval.n_examples,
            "optimizer": _dump(spec.optimizer),
            "seed": run.seed,
            "run": run.as_json(),
        }
    else:
        d = plan.diagnostic
        fs, sch = d.fixed_settings, d.schedule
        body = {
            "base_model": fs.base_model,
            "lora_rank": fs.lora_rank,
            "arms": [
                {"name": fs.treatment.arm, "loss": fs.treatment.loss, "trained": True},
                {"name": "ppo_counterfactual", "loss": fs.counterfactual_baseline.loss, "trained": False},
            ],
            "steps": sch.max_optimizer_updates,
            "batch_size": sch.groups_per_batch * sch.group_size,
            "sequences_per_update": sch.groups_per_minibatch * sch.group_size,
            "max_tokens": fs.sampling.max_tokens,
            "n_eval": 0,
            "seed": fs.seed,
            "optimizer": _dump(fs.optimizer),
            "treatment": _dump(fs.treatment),
            "counterfactual_baseline": _dump(fs.counterfactual_baseline),
            "sampling": _dump(fs.sampling),
            "loss_normalization": _dump(fs.loss_normalization),
            "schedule": _dump(sch),
            "caps": _dump(d.caps),
            "analysis_criteria": [_dump(c) for c in d.analysis.criteria],
        }
    plan_block: JsonObject = {"name": plan.name, "kind": plan.kind, "sha256": plan.sha256}
    if isinstance(plan.model, RehearsalPlan):
        plan_block.update(label="rehearsal", derived_from=_dump(plan.model.derived_from))
    if plan.launch is not None:
        plan_block["launch"] = _dump(plan.launch)
    if plan.resolution is not None:
        plan_block["resolution"] = plan.resolution.as_json()
    return {
        "plan": plan_block,
        "pinned": {
            "ppo_eps": constants.PPO_EPS,
            "dppo_delta": losses.DPPO_DELTA,
            "dppo_ratio_cap": constants.DPPO_RATIO_CAP,
            "renderer": constants.RENDERER_NAME,
            "reference_revision": constants.REFERENCE_REVISION,
            "baseline_revision": constants.BASELINE_REVISION,
        },
        "budget": dict(plan.budget.items()),
        "generation_audit": generation_audit_applicability(plan),
        "config": body,
        "deviations": [as_object(d) for d in plan.deviations],
    }


def plan_errors(path: str | Path, *, repo_root: Path | None = None) -> list[str]:
    """Every problem of a plan file, one line each ([] when it loads): all schema errors when the
    model does not validate, else the first cross-field problem."""
    path = Path(path)
    try:
        load_plan(path, repo_root=repo_root)
        return []
    except PlanError as exc:
        first = str(exc)
    try:
        raw = decode(path.read_bytes(), path)
        MODELS[detect_kind(raw)].model_validate(raw)
    except ValidationError as exc:
        return [f"{path}: {describe(e)}" for e in exc.errors(include_url=False)]
    except (PlanError, OSError):
        pass
    return [first]

"""Frozen plans: the plan models, loading (sha256 of the exact bytes), the typed run config,
rehearsal rules, launch scope, effective config and deviations.

Modules: `models` (strict pydantic models per kind, decoding, on `model_base`; a diagnostic's
settings blocks in `diagnostic_settings`; `schema_errors` words their errors), `resolution` (the
file beside a plan that states what the spec has no field for: the schedule values its prose
states, each with the sentence it quotes, and the baseline arm), `run_config` (the typed
`RunConfig` stages read; its arms and criteria from `arm_roles`), `rehearsal` (the rules a
rehearsal plan obeys), `launch` (what a launch authorizes on a real service), `plan` (`Plan`,
`load_plan`, `effective_config`). CLI: `python -m dppo_harness.plans validate PLAN`.
"""

from dppo_harness.json_types import JsonObject
from dppo_harness.plans.arm_roles import ArmConfig, CriterionConfig
from dppo_harness.plans.diagnostic_settings import DiagnosticSchedule
from dppo_harness.plans.launch import refusal as launch_refusal
from dppo_harness.plans.launch import unauthorized_stages
from dppo_harness.plans.launch import undecided_refusal as launch_undecided_refusal
from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.models import (
    AUTHORIZABLE_STAGES,
    DEVIATION_FIELDS,
    ExperimentSpec,
    Launch,
    PlanKind,
    detect_kind,
    validate_model,
)
from dppo_harness.plans.plan import (
    SERVED_MODEL_UNAVAILABLE,
    BackendInfo,
    BackendKind,
    GenerationAuditApplicability,
    Plan,
    backend_deviations,
    check_original_plan,
    effective_config,
    generation_audit_applicability,
    load_plan,
    parse_plan,
    plan_config,
    plan_errors,
    resized_plan,
    validate_plan,
)
from dppo_harness.plans.rehearsal import _get, _parse_path, check_rehearsal, leaf_differences, rehearsal_deviation
from dppo_harness.plans.resolution import Stated
from dppo_harness.plans.run_config import NORMALIZATION as HARNESS_NORMALIZATION
from dppo_harness.plans.run_config import RunConfig, build_run_config

__all__ = [
    "AUTHORIZABLE_STAGES",
    "DEVIATION_FIELDS",
    "HARNESS_NORMALIZATION",
    "SERVED_MODEL_UNAVAILABLE",
    "ArmConfig",
    "BackendInfo",
    "BackendKind",
    "CriterionConfig",
    "DiagnosticSchedule",
    "ExperimentSpec",
    "GenerationAuditApplicability",
    "JsonObject",
    "Launch",
    "Plan",
    "PlanError",
    "PlanKind",
    "RunConfig",
    "Stated",
    "_get",
    "_parse_path",
    "backend_deviations",
    "build_run_config",
    "check_original_plan",
    "check_rehearsal",
    "detect_kind",
    "effective_config",
    "generation_audit_applicability",
    "launch_refusal",
    "launch_undecided_refusal",
    "leaf_differences",
    "load_plan",
    "parse_plan",
    "plan_config",
    "plan_errors",
    "rehearsal_deviation",
    "resized_plan",
    "unauthorized_stages",
    "validate_model",
    "validate_plan",
]

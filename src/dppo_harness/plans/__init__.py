"""Frozen plans: the plan models (`models`), loading and the plan's config (`plan`), the typed
run config (`run_config`), the resolution file beside a spec (`resolution`), rehearsal rules
(`rehearsal`); launch scope is `models`'s. CLI: `python -m dppo_harness.plans validate PLAN`.
"""

from dppo_harness.plans.models import (
    DEVIATION_FIELDS,
    ExperimentSpec,
    PlanError,
    launch_refusal,
    launch_undecided_refusal,
    unauthorized_stages,
)
from dppo_harness.plans.plan import (
    BackendKind,
    Plan,
    load_plan,
    parse_plan,
    plan_config,
)
from dppo_harness.plans.run_config import ArmConfig, CriterionConfig, RunConfig

__all__ = [
    "DEVIATION_FIELDS",
    "ArmConfig",
    "BackendKind",
    "CriterionConfig",
    "ExperimentSpec",
    "Plan",
    "PlanError",
    "RunConfig",
    "launch_refusal",
    "launch_undecided_refusal",
    "load_plan",
    "parse_plan",
    "plan_config",
    "unauthorized_stages",
]

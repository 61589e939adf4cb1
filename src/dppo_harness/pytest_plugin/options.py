"""The plugin's options resolved once at configure time: backend, plan, evidence dir, resume,
waits; a bad value or an unsafe credential is one usage error, before anything is collected.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dppo_harness import constants, project
from dppo_harness.evidence.files import unwritable_reason
from dppo_harness.evidence.provenance import ARCHIVED, archived_paths
from dppo_harness.plans import BackendKind, Plan, PlanError, load_plan
from dppo_harness.pytest_plugin import stages
from dppo_harness.pytest_plugin.session import HarnessOptions, StageState
from dppo_harness.service.secrets_scan import live_secret_items, unsafe_credentials


def validated_plan(config: pytest.Config, options: HarnessOptions) -> Plan | None:
    """Load the session's plan now: an explicit --plan always, the default plan when a stage that
    uses it is selected. A malformed plan is a usage error naming the field."""
    explicit = config.getoption("--plan") is not None
    if not explicit and set(options.selected_stages) <= {"unit"}:
        return None
    try:
        return load_plan(options.plan_path)
    except PlanError as exc:
        raise pytest.UsageError(f"{'--plan' if explicit else 'default plan'}: {exc}") from None


def _user_path(config: pytest.Config, value: str) -> Path:
    """A path the user wrote on the command line, relative to where pytest was invoked."""
    return (config.invocation_params.dir / Path(value).expanduser()).resolve()


def _default_plan(run_stages: tuple[str, ...], backend: str) -> Path:
    """The stage's default plan, from the project the package came from (never the cwd)."""
    try:
        return project.plan_file(stages.default_plan_name(run_stages, backend))
    except project.ProjectNotFound as exc:
        raise pytest.UsageError(f"default plan: {exc}") from None


# Where a credential value must not occur: everything the code archive holds (library, embedded
# server, vendored data, tests, plans), and the docs a placeholder could be copied from.
HARNESS_FILES = ("README.md", "docs")


def refuse_unsafe_credentials() -> None:
    """Before anything is collected or called: a credential the evidence scan cannot guard (too
    short, or found in the harness's own files) is one usage error naming the variable."""
    if not live_secret_items():
        return
    try:
        root = project.project_root()
        files = archived_paths(root, (*ARCHIVED, *HARNESS_FILES))
    except project.ProjectNotFound:
        root = project.PACKAGE_DIR.parent
        files = archived_paths(root, (project.PACKAGE_DIR.name,))
    problems = unsafe_credentials(None, files, root=root)
    if problems:
        raise pytest.UsageError("; ".join(p.line() for p in problems))


def skip_setup_stages_on_resume(config: pytest.Config, state: StageState) -> None:
    """--resume continues a comparison: its preflight and gate are not run again (their saved
    evidence is reused and re-verified by the comparison); unit parity still runs first."""
    if config.getoption("--resume") is None:
        return
    if state.run is None or "comparison" not in state.run:
        raise pytest.UsageError("--resume RUN_ID continues a comparison: select it with -m comparison")
    for stage in ("preflight", "gate"):
        if not state.run.get(stage, True):  # a prerequisite only, not selected itself
            del state.run[stage]


def resolve_options(config: pytest.Config, state: StageState) -> HarnessOptions:
    backend_opt = config.getoption("--backend")
    backend: BackendKind = backend_opt or ("tinker" if os.environ.get("TINKER_BASE_URL") else "local")
    if backend == "tinker" and not os.environ.get("TINKER_BASE_URL"):
        raise pytest.UsageError("--backend tinker needs the environment variable TINKER_BASE_URL")
    run_stages = tuple(state.run) if state.run else ("unit",)
    plan_opt = config.getoption("--plan")
    plan_path = _user_path(config, plan_opt) if plan_opt else _default_plan(run_stages, backend)
    if plan_opt and not plan_path.is_file():
        raise pytest.UsageError(f"--plan: no such plan file: {plan_path}")
    evidence_opt = config.getoption("--evidence-dir")
    if evidence_opt:
        evidence_dir = _user_path(config, evidence_opt)
    else:
        try:
            evidence_dir = project.default_evidence_dir()
        except project.ProjectNotFound as exc:
            raise pytest.UsageError(f"--evidence-dir not given and no default: {exc}") from None
    if evidence_dir.exists() and not evidence_dir.is_dir():
        raise pytest.UsageError(f"--evidence-dir: not a directory: {evidence_dir}")
    if run_stages != ("unit",) and (problem := unwritable_reason(evidence_dir)) is not None:
        raise pytest.UsageError(
            f"--evidence-dir {evidence_dir}: {problem}; nothing was run (give a writable directory with room)"
        )
    save_every = config.getoption("--save-every")
    if not 1 <= save_every <= constants.MAX_SAVE_EVERY:
        raise pytest.UsageError(
            f"--save-every: {save_every} is not in 1..{constants.MAX_SAVE_EVERY} (each arm's "
            f"state is saved at least every {constants.MAX_SAVE_EVERY} steps)"
        )
    waits = ("capacity_patience_s", "capacity_patience_after_steps_s", "service_timeout_s")
    return HarnessOptions(
        backend,
        plan_path,
        evidence_dir,
        run_stages,
        resume=_resume_run_id(config, config.getoption("--resume"), evidence_dir),
        comparison_schedule=config.getoption("--comparison-schedule"),
        save_every=save_every,
        proxy_credentials=config.getoption("--proxy-credentials"),
        sdk_telemetry=config.getoption("--sdk-telemetry"),
        **{name: _wait_seconds(config, "--" + name.replace("_", "-")) for name in waits},
    )


def _wait_seconds(config: pytest.Config, opt: str) -> float | None:
    """A wait option's seconds (None: the policy's default); anything but a positive finite number is refused."""
    value: float | None = config.getoption(opt)
    if value is not None and not (value > 0 and value != float("inf")):
        raise pytest.UsageError(f"{opt}: expected a positive number of seconds, got {value}")
    return value


def _resume_run_id(config: pytest.Config, value: str | None, evidence_dir: Path) -> str | None:
    """--resume takes a run id, or the path of that run's bundle under the evidence dir."""
    if value is None or "/" not in value:
        return value
    path = _user_path(config, value)
    if path.parent != evidence_dir:
        raise pytest.UsageError(
            f"--resume: {value} is not a run under the evidence dir {evidence_dir}; give its run "
            f"id, or --evidence-dir {path.parent}"
        )
    return path.name

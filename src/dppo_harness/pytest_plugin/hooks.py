"""Pytest hooks of the harness plugin: options, stage selection and order, fail-fast, launch scope,
and the session's closing records. Registered through the `pytest11` entry point named after this
module, so `--plan` and friends are known wherever pytest runs (the project's conftest.py names it
too; pytest then skips it as registered). Options are resolved once at configure time: a bad value,
a malformed plan or an unsafe credential is one usage error, before anything is collected.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import pytest

from dppo_harness import constants, project
from dppo_harness.evidence import UnwritableEvidenceError
from dppo_harness.evidence.files import unwritable_reason
from dppo_harness.evidence.provenance import ARCHIVED, archived_paths
from dppo_harness.evidence.run_summary import TITLE, summary_lines
from dppo_harness.evidence.session import finish_session, unclosed_line
from dppo_harness.plans import (
    BackendKind,
    Plan,
    PlanError,
    launch_refusal,
    launch_undecided_refusal,
    load_plan,
    unauthorized_stages,
)
from dppo_harness.pytest_plugin import stages
from dppo_harness.pytest_plugin.rootdir import reroot
from dppo_harness.service.config import redact_url
from dppo_harness.service.secrets_scan import live_secret_items, unsafe_credentials
from dppo_harness.service.wait.policy import ServiceConfigError, ServiceStopped, WaitPolicy

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.service.connectivity import ConnectivityReport
    from dppo_harness.service.observed import ClientRegistry

STAGE_KEY = pytest.StashKey[str]()
STATE_KEY = pytest.StashKey["StageState"]()
PLAN_KEY = pytest.StashKey[Plan]()
CONNECTIVITY_KEY: pytest.StashKey[ConnectivityReport] = pytest.StashKey()


@dataclass(frozen=True)
class HarnessOptions:
    backend: BackendKind  # "local": embedded server; "tinker": TINKER_BASE_URL
    plan_path: Path
    evidence_dir: Path
    selected_stages: tuple[str, ...]  # the stages this session runs, in order
    # -- comparison stage
    resume: str | None = None  # --resume RUN_ID: continue that run's saved comparison state
    # None: the default for the service (comparison.config.comparison_schedule)
    comparison_schedule: Literal["interleaved"] | None = None
    save_every: int = 5  # --save-every N: each arm's state (weights + optimizer) every N rollout steps
    # the session's one service wait policy: the options given, else its defaults (capacity_scale)
    wait_policy: WaitPolicy = field(default_factory=WaitPolicy)
    proxy_credentials: Literal["modal", "runs"] = "modal"  # which proxy tokens feed Modal-Key/Modal-Secret
    sdk_telemetry: bool = False  # let the SDK post its telemetry (off: TINKER_TELEMETRY=0)


OPTIONS_KEY = pytest.StashKey[HarnessOptions]()


class StageOutcomes(TypedDict):
    """Test outcome counts of one stage (unit-parity-summary.json, in this key order)."""

    passed: int
    failed: int
    skipped: int
    failed_tests: list[str]  # "<nodeid> (<phase>)" of each failed test


@dataclass
class StageState:
    run: dict[str, bool] | None = None  # stage -> selected itself (None: no stage selection)
    first_failure: dict[str, str] = field(default_factory=dict)  # stage -> failing nodeid
    started: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    current: str | None = None
    bundle: EvidenceBundle | None = None  # the session's bundle, once a test asked for it
    registry: ClientRegistry | None = None  # the session's client registry, once a test asked for it
    # Final result fields a stage proposed (status, verdict, outcome_reason...: EvidenceBundle.finish's
    # keywords), applied if nothing failed.
    outcome: dict[str, Any] | None = None
    budget_checked: set[str] = field(default_factory=set)  # stages whose entry budget check ran
    outcomes: dict[str, StageOutcomes] = field(default_factory=dict)  # stage -> test outcome counts


# The wait policy's options, by WaitPolicy field.
WAIT_OPTIONS = {
    "capacity_patience_s": "give up after the service paused for S seconds, no step done (600)",
    "capacity_patience_after_steps_s": "the same once a comparison step completed (1800)",
    "service_timeout_s": "stop the stage when an active request gives no answer for S seconds (900)",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    """The harness's options; docs/service.md and docs/evidence.md say more of each."""
    add = parser.getgroup("dppo_harness", "DPPO experiment harness").addoption
    add("--backend", choices=("local", "tinker"), help="'tinker' when TINKER_BASE_URL is set, else 'local' (embedded)")
    add("--plan", help="plan JSON (default: chosen by the selected stage)")
    add("--evidence-dir", help="evidence root (default: the project's evidence/)")
    add("--resume", metavar="RUN_ID", help="continue a stopped comparison from its arms' last saved state")
    add("--save-every", type=int, default=5, metavar="N", help="comparison: save each arm every N steps (1..10)")
    add("--comparison-schedule", choices=("interleaved",), help="how the arms advance: one after the other")
    for dest, help_text in WAIT_OPTIONS.items():
        add(f"--{dest.replace('_', '-')}", type=float, metavar="S", help=help_text)
    add("--proxy-credentials", choices=("modal", "runs"), default="modal", help="proxy tokens: MODAL_* or RUNS_*")
    add("--sdk-telemetry", action="store_true", help="let the tinker SDK post its telemetry (off: it may hold headers)")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """`--evidence-dir DIR` with a space: pytest chose its rootdir taking DIR for a test path."""
    reroot(early_config, parser, args)


def pytest_configure(config: pytest.Config) -> None:
    for stage in stages.STAGES:
        config.addinivalue_line("markers", f"{stage}: test of the '{stage}' experiment stage")
    config.addinivalue_line(
        "markers",
        "integration: end to end (the embedded server or engine, a CLI in a "
        "subprocess); stage 'unit', but not part of unit parity",
    )
    # The SDK's own use of pydantic v1 API warns at every run; ours would still be shown.
    config.addinivalue_line("filterwarnings", r"ignore::pydantic.warnings.PydanticDeprecatedSince20:tinker\.")
    state = StageState()
    selected = stages.parse_stage_selection(config.option.markexpr)
    if selected is not None:
        # We select by stage ourselves so that prerequisites run too.
        state.run = stages.expand_selection(selected)
        config.option.markexpr = ""
    config.stash[STATE_KEY] = state
    if config.getoption("--resume") is not None:
        # --resume continues a comparison: its preflight and gate are not run again (the comparison
        # reuses and re-verifies their saved evidence); unit parity still runs first.
        if state.run is None or "comparison" not in state.run:
            raise pytest.UsageError("--resume RUN_ID continues a comparison: select it with -m comparison")
        for stage in ("preflight", "gate"):
            if not state.run.get(stage, True):  # a prerequisite only, not selected itself
                del state.run[stage]
    options = config.stash[OPTIONS_KEY] = _resolve_options(config, state)
    if not config.option.help:
        _refuse_unsafe_credentials()
    # The plan is loaded now: an explicit --plan always, the default plan when a stage that uses it
    # is selected. A malformed plan is a usage error naming the field.
    explicit = config.getoption("--plan") is not None
    if explicit or not set(options.selected_stages) <= {"unit"}:
        try:
            config.stash[PLAN_KEY] = load_plan(options.plan_path)
        except PlanError as exc:
            raise pytest.UsageError(f"{'--plan' if explicit else 'default plan'}: {exc}") from None
    config.pluginmanager.import_plugin("dppo_harness.pytest_plugin.fixtures")


def _user_path(config: pytest.Config, value: str) -> Path:
    """A path the user wrote on the command line, relative to where pytest was invoked."""
    return (config.invocation_params.dir / Path(value).expanduser()).resolve()


# Where a credential value must not occur: everything the code archive holds (library, embedded
# server, vendored data, tests, plans), and the docs a placeholder could be copied from.
HARNESS_FILES = ("README.md", "docs")


def _refuse_unsafe_credentials() -> None:
    """A credential the evidence scan cannot guard (too short, or found in the harness's own files)
    is one usage error naming the variable."""
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
        raise pytest.UsageError("; ".join(problems))


def _resolve_options(config: pytest.Config, state: StageState) -> HarnessOptions:
    backend_opt = config.getoption("--backend")
    backend: BackendKind = backend_opt or ("tinker" if os.environ.get("TINKER_BASE_URL") else "local")
    if backend == "tinker" and not os.environ.get("TINKER_BASE_URL"):
        raise pytest.UsageError("--backend tinker needs the environment variable TINKER_BASE_URL")
    run_stages = tuple(state.run) if state.run else ("unit",)
    plan_opt = config.getoption("--plan")
    try:  # the default plan comes from the project the package came from (never the cwd)
        plan_path = (
            _user_path(config, plan_opt)
            if plan_opt
            else project.plan_file(stages.default_plan_name(run_stages, backend))
        )
    except project.ProjectNotFound as exc:
        raise pytest.UsageError(f"default plan: {exc}") from None
    if plan_opt and not plan_path.is_file():
        raise pytest.UsageError(f"--plan: no such plan file: {plan_path}")
    evidence_opt = config.getoption("--evidence-dir")
    try:
        evidence_dir = _user_path(config, evidence_opt) if evidence_opt else project.default_evidence_dir()
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
    try:
        policy = WaitPolicy.from_options(backend=backend, **{n: config.getoption(n) for n in WAIT_OPTIONS})
    except ServiceConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    resume: str | None = config.getoption("--resume")
    if resume is not None and "/" in resume:  # a run id, or the path of that run's bundle under the evidence dir
        path = _user_path(config, resume)
        if path.parent != evidence_dir:
            raise pytest.UsageError(
                f"--resume: {resume} is not a run under the evidence dir {evidence_dir}; give its run "
                f"id, or --evidence-dir {path.parent}"
            )
        resume = path.name
    return HarnessOptions(
        backend,
        plan_path,
        evidence_dir,
        run_stages,
        resume=resume,
        comparison_schedule=config.getoption("--comparison-schedule"),
        save_every=save_every,
        proxy_credentials=config.getoption("--proxy-credentials"),
        sdk_telemetry=config.getoption("--sdk-telemetry"),
        wait_policy=policy,
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[STATE_KEY]
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        stage = stages.stage_of(markers, item.path)
        item.stash[STAGE_KEY] = stage
        item.add_marker(stage)
        in_tests = stages.stage_from_path(item.path) is not None or stage != "unit"
        if in_tests and item.path.parent.name == stages.INTEGRATION_FOLDER:
            item.add_marker("integration")
    selected = [_selected_for_run(config, state, item) for item in items]
    keep = [item for item, chosen in zip(items, selected) if chosen]
    drop = [item for item, chosen in zip(items, selected) if not chosen]
    if drop:
        config.hook.pytest_deselected(items=drop)
    # Stable sort: collection order inside a stage, stage order across stages.
    keep.sort(key=lambda it: stages.stage_index(it.stash[STAGE_KEY]))
    items[:] = keep


def _selected_for_run(config: pytest.Config, state: StageState, item: pytest.Item) -> bool:
    stage = item.stash[STAGE_KEY]
    if state.run is not None:
        if stage not in state.run:
            return False
        # As a mere prerequisite, stage "unit" means unit parity: tests/unit without the integration-marked tests.
        return state.run[stage] or item.get_closest_marker("integration") is None
    # Without a stage selection: explicit paths run as given; the default run is unit + integration.
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return True
    return stage == "unit"


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Launch scope, once, before the first test, from the plan that will run however the stages
    were selected (`-m`, paths, node ids): on a service that is not the embedded server, a collected
    stage the plan's launch does not authorize ends the session at once with one line saying what
    would authorize it (plans.launch_refusal); so does a connectivity preflight that cannot tell which
    service it is. Its report is reused by the `connectivity` fixture; nothing else is created."""
    config = session.config
    options = config.stash[OPTIONS_KEY]
    if options.backend != "tinker":  # local: the harness's own embedded server
        return
    collected = sorted({it.stash.get(STAGE_KEY, "unit") for it in session.items}, key=stages.stage_index)
    plan = config.stash.get(PLAN_KEY, None)
    if plan is None:
        if not unauthorized_stages(None, collected):
            return  # nothing selected trains beyond setup: no plan needed to decide
        try:
            plan = config.stash[PLAN_KEY] = load_plan(options.plan_path)  # the one the `plan` fixture would load
        except PlanError as exc:
            pytest.exit(f"launch scope: plan {options.plan_path.name}: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
    if not unauthorized_stages(plan.launch, collected):
        return
    # The connectivity check loads the tinker SDK and torch (seconds): only a session on a service pays for it.
    from dppo_harness.service.connectivity import ConnectivityError

    url = os.environ["TINKER_BASE_URL"]
    try:
        report = session_connectivity(config, "tinker", url, plan)
    except ConnectivityError as exc:
        line = launch_undecided_refusal(
            plan.name,
            plan.launch,
            collected,
            service=redact_url(url) or "the service",
            seen=f"connectivity preflight ({exc.check}): {exc.line}",
        )
        pytest.exit(str(line), returncode=pytest.ExitCode.USAGE_ERROR)  # stages need authorization: never None
    line = launch_refusal(
        plan.name,
        plan.launch,
        collected,
        embedded=report.embedded,
        service=report.base_url,
        stated_in=plan.launch_stated_in,
    )
    if line is not None:
        pytest.exit(line, returncode=pytest.ExitCode.USAGE_ERROR)


def session_connectivity(config: pytest.Config, backend: BackendKind, url: str, plan: Plan) -> ConnectivityReport:
    """The session's one connectivity preflight (raises ConnectivityError): the launch-scope check's
    report is the `connectivity` fixture's."""
    report = config.stash.get(CONNECTIVITY_KEY, None)
    if report is None:
        from dppo_harness.service.connectivity import check_connectivity  # the SDK: only when a check runs

        options = config.stash[OPTIONS_KEY]
        report = check_connectivity(
            backend, url, plan.base_model, proxy_tokens=options.proxy_credentials, sdk_telemetry=options.sdk_telemetry
        )
        config.stash[CONNECTIVITY_KEY] = report
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    state = item.config.stash[STATE_KEY]
    stage = item.stash.get(STAGE_KEY, "unit")
    enter_stage(state, stage)
    check_budget_on_entry(state, stage)  # before the stage's first service call, so a spent budget costs nothing
    if state.first_failure.get(stage, "").startswith("blocked_by_budget"):
        pytest.skip(f"{state.first_failure[stage]}: the run budget is spent (see ledger.json)")
    idx = stages.stage_index(stage)
    for failed_stage, nodeid in state.first_failure.items():
        if stages.stage_index(failed_stage) < idx:
            pytest.skip(f"blocked: stage '{failed_stage}' failed ({nodeid})")


def enter_stage(state: StageState, stage: str) -> None:
    if state.current == stage:
        return
    if state.current is not None:
        close_stage(state, state.current)
    state.current = stage
    state.started.setdefault(stage, time.monotonic())
    if state.registry is not None:  # training clients are counted per stage they were created in
        state.registry.current_stage = stage


def check_budget_on_entry(state: StageState, stage: str) -> None:
    """Once per service stage, before its first test: a spent run budget blocks the stage (recorded
    as blocked_by_budget in the ledger; evidence so far stays persisted) and fails it."""
    if stage == "unit" or state.bundle is None or stage in state.budget_checked:
        return
    state.budget_checked.add(stage)
    if state.bundle.remaining_seconds() is not None and not state.bundle.budget_allows(stage, 0.0):
        state.first_failure.setdefault(stage, f"blocked_by_budget before {stage}")


def close_stage(state: StageState, stage: str) -> None:
    state.finished[stage] = time.monotonic()
    if state.registry is not None:
        state.registry.release_stage(stage)
    bundle = state.bundle
    if bundle is None:
        return
    if state.registry is not None and stage != "unit":
        created = state.registry.training_clients_by_stage().get(stage, 0)
        bundle.update_result(metrics={f"clients/training_created/{stage}": float(created)})
    status = "failed" if stage in state.first_failure else "passed"
    bundle.stage_timing(stage, state.finished[stage] - state.started[stage], status)
    if stage != "unit":  # the result at each service stage's end, kept in the journal (a killed run keeps it)
        bundle.journal.snapshot(stage, f"stage {stage} end")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, ServiceStopped):  # the wait policy stopped the stage: its one line, not a traceback
        report.longrepr = exc.line
    refused = _unwritable_evidence(exc)
    if refused is not None:  # nothing more can be recorded: its one line, and no later test runs
        report.longrepr = refused
        item.session.shouldstop = refused
    state, stage = item.config.stash[STATE_KEY], item.stash.get(STAGE_KEY, "unit")
    if report.when == "call" or report.outcome != "passed":
        counts = state.outcomes.setdefault(stage, {"passed": 0, "failed": 0, "skipped": 0, "failed_tests": []})
        counts[report.outcome] += 1
        if report.failed:
            counts["failed_tests"].append(f"{item.nodeid} ({report.when})")
    if report.failed:
        state.first_failure.setdefault(stage, item.nodeid)
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close the stage and the evidence: every step before the final result runs on whatever
    failed before it (each failure noted in the ledger and failing the session), so the final
    result.json is always written."""
    state = session.config.stash.get(STATE_KEY, None)
    if state is None or state.current is None:
        return
    say = session.config.get_terminal_writer().line
    stage, state.current = state.current, None
    problems: dict[str, str] = {}
    for step, run in (
        ("close_stage", lambda: close_stage(state, stage)),
        ("session_records", lambda: write_session_records(state)),
        ("stage_outcome", lambda: _apply_outcome(state)),
    ):
        if state.bundle is None and step != "close_stage":
            return
        try:
            run()
        except Exception as exc:  # noted, then the close goes on: the final result must be written
            problems[step] = f"{type(exc).__name__}: {exc}"
            state.first_failure.setdefault("session_close", f"{step}: {problems[step]}")
            say(f"evidence: {step} failed, the run closes without it: {problems[step]}", red=True)
    if state.bundle is None:
        return
    try:
        if problems:
            state.bundle.note_ledger(session_close_problems=problems)
        finish_session(state.bundle, stage_failures=dict(state.first_failure))
    except UnwritableEvidenceError as exc:  # the close itself was refused: one line, never a traceback
        say(str(exc), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    line = unclosed_line(state.bundle)
    if line is not None:
        say(line, red=True)
    if line is not None or state.bundle.unwritable is not None:  # a failed run, not an interrupted one
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _apply_outcome(state: StageState) -> None:
    if state.outcome is not None and not state.first_failure and state.bundle is not None:
        state.bundle.finish(**state.outcome)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """The run's closing block (run_summary.summary_lines), when a stage opened an evidence bundle."""
    state = config.stash.get(STATE_KEY, None)
    if state is None or state.bundle is None:
        return
    messages: dict[str, str] = {}
    for rep in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", []):
        for stage, nodeid in state.first_failure.items():
            if getattr(rep, "nodeid", None) == nodeid and stage not in messages:
                crash = getattr(getattr(rep, "longrepr", None), "reprcrash", None)
                messages[stage] = f"{nodeid}: {(getattr(crash, 'message', '') or 'failed').splitlines()[0]}"
    terminalreporter.write_sep("=", TITLE)
    for line in summary_lines(
        state.bundle.result,
        state.bundle.dir,
        stage_failures=state.first_failure,
        failure_messages=messages,
        stage_order=stages.STAGES,
    ):
        terminalreporter.write_line(line)


def _unwritable_evidence(exc: BaseException | None) -> str | None:
    """The one line of a refused evidence write behind a failure (disk full, read-only, permission),
    if any: the write itself, or what the stage raised while it handled it."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, UnwritableEvidenceError):
            return str(exc)
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def write_session_records(state: StageState) -> None:
    """Unit-parity summary and client-release records as evidence files (what a reviewer checks ran). The
    session's own clients are released here, before the result is closed, so the record is true."""
    bundle = state.bundle
    if state.registry is not None:
        state.registry.release_remaining()
    if bundle is None:  # pytest_sessionfinish writes the records only once a bundle exists
        return
    if bundle.entry("client-releases.json") is None:
        from dppo_harness.service.observed import ClientRegistry  # the SDK: only a session with a bundle

        # With no session opened, the empty record.
        bundle.register_json("client-releases.json", "log", (state.registry or ClientRegistry()).evidence())
    unit = state.outcomes.get("unit")
    if unit is not None and bundle.entry("unit-parity-summary.json") is None:
        bundle.register_json(
            "unit-parity-summary.json",
            "report",
            {
                "kind": "unit_parity_summary",
                "stage": "unit",
                **unit,
                # Which run this is: this pytest session (the bundle's), before any service stage.
                "selection": "tests/unit without the tests marked integration, in this pytest session",
                "seconds": (state.finished["unit"] - state.started["unit"]) if "unit" in state.finished else None,
                "all_stages": {
                    k: {kk: vv for kk, vv in v.items() if kk != "failed_tests"} for k, v in state.outcomes.items()
                },
            },
        )

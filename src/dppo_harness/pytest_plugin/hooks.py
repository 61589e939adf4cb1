"""Pytest plugin: the experiment's gated stages, their order, fail-fast and session fixtures.

Registered through the `pytest11` entry point `dppo_harness.pytest_plugin.hooks` (pyproject.toml), so
`--plan` and friends are known wherever pytest runs; the project's conftest.py names the same
module, which pytest then skips as already registered (the entry point's name is the module
name). Stage rules live in `stages.py`; the plan is validated in pytest_configure, so a
malformed plan is a one-line usage error before anything is collected.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest

from dppo_harness import constants, project
from dppo_harness.plans import Plan, PlanError, load_plan
from dppo_harness.pytest_plugin import stages

if TYPE_CHECKING:
    import tinker

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.local_server.process import LocalServerProcess
    from dppo_harness.service.clients import ClientRegistry

STAGE_KEY = pytest.StashKey[str]()
_STATE_KEY = pytest.StashKey["_StageState"]()
_PLAN_KEY = pytest.StashKey[Plan]()
_ITEMS_KEY = pytest.StashKey[list[pytest.Item]]()
_CONNECTIVITY_KEY = pytest.StashKey[Any]()

# Fixture modules of later stages; each owns the session fixtures of its step.
FIXTURE_PLUGINS = ("dppo_harness.pytest_plugin.fixtures_preflight", "dppo_harness.pytest_plugin.fixtures_stages",
                   "dppo_harness.pytest_plugin.fixtures_connectivity")  # connectivity + served identity


@dataclass(frozen=True)
class HarnessOptions:
    backend: Literal["local", "tinker"]  # "local": embedded server; "tinker": TINKER_BASE_URL
    plan_path: Path
    evidence_dir: Path
    selected_stages: tuple[str, ...]  # the stages this session runs, in order
    # -- comparison stage (issue 9)
    resume: str | None = None  # --resume RUN_ID: continue that run's saved comparison state
    comparison_schedule: str | None = None  # None: the default for the service (comparison.default_schedule)
    save_every: int = 5  # --save-every N: each arm's state (weights + optimizer) every N rollout steps
    wandb_project: str | None = None  # --wandb-project or WANDB_PROJECT; None: W&B is never touched
    wandb_source: str = "not requested"
    # -- the service wait policy (service_wait.WaitPolicy); None: the default (capacity defaults
    # shrunk by DPPO_HARNESS_CAPACITY_SCALE, or 100x on the local backend)
    capacity_patience_s: float | None = None
    capacity_patience_after_steps_s: float | None = None
    service_timeout_s: float | None = None
    proxy_credentials: Literal["modal", "runs"] = "modal"  # which proxy tokens feed Modal-Key/Modal-Secret
    sdk_telemetry: bool = False  # let the SDK post its telemetry (off: TINKER_TELEMETRY=0)


@dataclass
class _StageState:
    run: dict[str, bool] | None = None  # stage -> selected itself (None: no stage selection)
    first_failure: dict[str, str] = field(default_factory=dict)  # stage -> failing nodeid
    started: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    current: str | None = None
    bundle: EvidenceBundle | None = None  # the session's bundle, once a test asked for it
    registry: ClientRegistry | None = None  # the session's client registry, once a test asked for it
    outcome: dict[str, Any] | None = None  # final result fields a stage proposed, applied if nothing failed
    budget_checked: set[str] = field(default_factory=set)  # stages whose entry budget check ran
    releases: list[dict[str, Any]] = field(default_factory=list)  # client releases, when (issue 11 §8)
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> test outcome counts


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dppo_harness", "DPPO experiment harness")
    group.addoption(
        "--backend",
        choices=("local", "tinker"),
        default=None,
        help="training backend: 'tinker' when TINKER_BASE_URL is set, else 'local' (embedded server)",
    )
    group.addoption("--plan", default=None, help="plan JSON (default: chosen by the selected stage)")
    group.addoption("--evidence-dir", default=None, help="evidence root (default: the project's evidence/)")
    # -- comparison stage (issue 9)
    group.addoption("--resume", default=None, metavar="RUN_ID",
                    help="continue a stopped comparison from its arms' last saved state, reusing that run's "
                         "preflight and gate evidence after re-verifying its hashes (refused if the plan, "
                         "evaluator or code changed)")
    group.addoption("--save-every", type=int, default=5, metavar="N",
                    help="comparison: save each arm's state (weights + optimizer) every N rollout steps and at the "
                         "end; 1 <= N <= 10 (the brief asks for a save at least every 10 steps); a resume restarts "
                         "from the last step every arm saved")
    group.addoption("--comparison-schedule", choices=("interleaved", "concurrent"), default=None,
                    help="how the two arms advance step by step (default: concurrent on a real service, interleaved "
                         "on the embedded server; see benchmarks/comparison_schedule.py)")
    group.addoption("--wandb-project", default=None, metavar="PROJECT",
                    help="also log each arm's cookbook metrics to this W&B project (default: WANDB_PROJECT; "
                         "unset: no W&B at all)")
    # -- service waits (docs/service.md)
    group.addoption("--capacity-patience-s", type=float, default=None, metavar="S",
                    help="give up after the service paused or refused work for S seconds before any comparison "
                         "step completed (default 600)")
    group.addoption("--capacity-patience-after-steps-s", type=float, default=None, metavar="S",
                    help="the same window once a comparison step completed (default 1800)")
    group.addoption("--service-timeout-s", type=float, default=None, metavar="S",
                    help="stop the stage when a request whose queue is active gives no answer for S seconds "
                         "(default 900)")
    group.addoption("--proxy-credentials", choices=("modal", "runs"), default="modal",
                    help="Modal-Key/Modal-Secret from MODAL_PROXY_TOKEN_* (shared Spindle, default) or "
                         "RUNS_PROXY_TOKEN_* (the brief's fork)")
    group.addoption("--sdk-telemetry", action="store_true", default=False,
                    help="let the tinker SDK post its telemetry to the service (off by default: on auth "
                         "errors its events carry the request headers, credentials included)")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """`--evidence-dir DIR` with a space: pytest chose its rootdir taking DIR for a test path."""
    from dppo_harness.pytest_plugin.rootdir import reroot

    reroot(early_config, parser, args)


def pytest_configure(config: pytest.Config) -> None:
    for stage in stages.STAGES:
        config.addinivalue_line("markers", f"{stage}: test of the '{stage}' experiment stage")
    config.addinivalue_line("markers", "integration: end to end (the embedded server or engine, a CLI in a "
                                       "subprocess); stage 'unit', but not part of unit parity")
    state = _StageState()
    selected = stages.parse_stage_selection(config.option.markexpr)
    if selected is not None:
        # We select by stage ourselves so that prerequisites run too.
        state.run, _ = stages.expand_selection(selected)
        config.option.markexpr = ""
    config.stash[_STATE_KEY] = state
    _skip_setup_stages_on_resume(config, state)
    options = _resolve_options(config, state)
    if not config.option.help:
        _refuse_unsafe_credentials()
    config.stash[_OPTIONS_KEY] = options
    plan = _validated_plan(config, options)
    if plan is not None:
        config.stash[_PLAN_KEY] = plan
    for name in FIXTURE_PLUGINS:
        config.pluginmanager.import_plugin(name)


_OPTIONS_KEY = pytest.StashKey[HarnessOptions]()


def _validated_plan(config: pytest.Config, options: HarnessOptions) -> Plan | None:
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
        if backend == "local" and "comparison" in run_stages:  # the declared rehearsal
            return project.plan_file(project.REHEARSAL_PLAN)
        return project.plan_file(stages.default_plan_name(run_stages))
    except project.ProjectNotFound as exc:
        raise pytest.UsageError(f"default plan: {exc}") from None


# Where a credential value must not occur: everything the code archive holds (library, embedded
# server, vendored data, tests, plans), and the docs a placeholder could be copied from.
HARNESS_FILES = ("README.md", "docs")


def _refuse_unsafe_credentials() -> None:
    """Before anything is collected or called: a credential the evidence scan cannot guard (too
    short, or found in the harness's own files) is one usage error naming the variable."""
    from dppo_harness.service.secrets_scan import live_secret_items, unsafe_credentials

    if not live_secret_items():
        return
    from dppo_harness.evidence.archive import ARCHIVED, archived_paths

    try:
        root = project.project_root()
        files = archived_paths(root, (*ARCHIVED, *HARNESS_FILES))
    except project.ProjectNotFound:
        root = project.PACKAGE_DIR.parent
        files = archived_paths(root, (project.PACKAGE_DIR.name,))
    problems = unsafe_credentials(None, files, root=root)
    if problems:
        raise pytest.UsageError("; ".join(p.line() for p in problems))


def _skip_setup_stages_on_resume(config: pytest.Config, state: _StageState) -> None:
    """--resume continues a comparison: its preflight and gate are not run again (their saved
    evidence is reused and re-verified by the comparison); unit parity still runs first."""
    if config.getoption("--resume") is None:
        return
    if state.run is None or "comparison" not in state.run:
        raise pytest.UsageError("--resume RUN_ID continues a comparison: select it with -m comparison")
    for stage in ("preflight", "gate"):
        if not state.run.get(stage, True):  # a prerequisite only, not selected itself
            del state.run[stage]


def _resolve_options(config: pytest.Config, state: _StageState) -> HarnessOptions:
    backend_opt = config.getoption("--backend")
    backend: Literal["local", "tinker"] = backend_opt or (
        "tinker" if os.environ.get("TINKER_BASE_URL") else "local"
    )
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
    save_every = config.getoption("--save-every")
    if not 1 <= save_every <= constants.MAX_SAVE_EVERY:
        raise pytest.UsageError(f"--save-every: {save_every} is not in 1..{constants.MAX_SAVE_EVERY} (the brief asks "
                                f"for each arm's state to be saved at least every {constants.MAX_SAVE_EVERY} steps)")
    waits = {}
    for opt in ("--capacity-patience-s", "--capacity-patience-after-steps-s", "--service-timeout-s"):
        value = config.getoption(opt)
        if value is not None and not (value > 0 and value != float("inf")):
            raise pytest.UsageError(f"{opt}: expected a positive number of seconds, got {value}")
        waits[opt.removeprefix("--").replace("-", "_")] = value
    from dppo_harness.instrument.cookbook_metrics import wandb_problem, wandb_request

    wandb = wandb_request(config.getoption("--wandb-project"))
    if wandb_problem(wandb):
        raise pytest.UsageError(wandb_problem(wandb))
    return HarnessOptions(backend, plan_path, evidence_dir, run_stages,
                          resume=_resume_run_id(config, config.getoption("--resume"), evidence_dir),
                          comparison_schedule=config.getoption("--comparison-schedule"), save_every=save_every,
                          proxy_credentials=config.getoption("--proxy-credentials"),
                          sdk_telemetry=config.getoption("--sdk-telemetry"),
                          wandb_project=wandb.project, wandb_source=wandb.source, **waits)


def _resume_run_id(config: pytest.Config, value: str | None, evidence_dir: Path) -> str | None:
    """--resume takes a run id, or the path of that run's bundle under the evidence dir."""
    if value is None or "/" not in value:
        return value
    path = _user_path(config, value)
    if path.parent != evidence_dir:
        raise pytest.UsageError(f"--resume: {value} is not a run under the evidence dir {evidence_dir}; give its run "
                                f"id, or --evidence-dir {path.parent}")
    return path.name


def stage_started_at(config: pytest.Config, stage: str) -> float | None:
    """time.monotonic() when the stage's first test began, or None before that."""
    state = config.stash.get(_STATE_KEY, None)
    return state.started.get(stage) if state is not None else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[_STATE_KEY]
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        stage = stages.stage_of(markers, item.path)
        item.stash[STAGE_KEY] = stage
        item.add_marker(stage)
        if stages.stage_from_path(item.path) is None and stage == "unit":
            continue
        if item.path.parent.name == stages.INTEGRATION_FOLDER:
            item.add_marker("integration")

    keep, drop = [], []
    for item in items:
        if _selected(config, state, item):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # Stable sort: collection order inside a stage, stage order across stages.
    keep.sort(key=lambda it: stages.stage_index(it.stash[STAGE_KEY]))
    items[:] = keep


def _selected(config: pytest.Config, state: _StageState, item: pytest.Item) -> bool:
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
    """Launch scope, before the first test: on a service that is not the embedded server, a
    collected stage the plan's launch does not authorize ends the session at once, with one line
    saying what would authorize it (plans.launch). Only then is the connectivity preflight read
    early (its report is reused by the `connectivity` fixture); nothing else is created."""
    config = session.config
    plan = config.stash.get(_PLAN_KEY, None)
    options = config.stash[_OPTIONS_KEY]
    if plan is None or options.backend != "tinker":  # local: the harness's own embedded server
        return
    from dppo_harness.plans import launch_refusal, unauthorized_stages

    collected = sorted({it.stash.get(STAGE_KEY, "unit") for it in session.items}, key=stages.stage_index)
    if not unauthorized_stages(plan.launch, collected):
        return
    from dppo_harness.service.connectivity import ConnectivityError, check_connectivity

    try:
        report = check_connectivity("tinker", os.environ["TINKER_BASE_URL"], plan.base_model,
                                    proxy_tokens=options.proxy_credentials, sdk_telemetry=options.sdk_telemetry)
    except ConnectivityError:
        return  # the connectivity fixture reports it, with its one line
    config.stash[_CONNECTIVITY_KEY] = report
    line = launch_refusal(plan.name, plan.launch, collected, embedded=report.embedded, service=report.base_url)
    if line is not None:
        pytest.exit(line, returncode=pytest.ExitCode.USAGE_ERROR)


def early_connectivity(config: pytest.Config) -> Any:
    """The connectivity report the launch-scope check read before the first test, else None."""
    return config.stash.get(_CONNECTIVITY_KEY, None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    state = item.config.stash[_STATE_KEY]
    stage = item.stash.get(STAGE_KEY, "unit")
    _enter_stage(state, stage)
    _check_budget_on_entry(state, stage)  # issue 11 point 6: before the stage's first service call
    if state.first_failure.get(stage, "").startswith("blocked_by_budget"):
        pytest.skip(f"{state.first_failure[stage]}: the run budget is spent (see ledger.json)")
    idx = stages.stage_index(stage)
    for failed_stage, nodeid in state.first_failure.items():
        if stages.stage_index(failed_stage) < idx:
            pytest.skip(f"blocked: stage '{failed_stage}' failed ({nodeid})")


def _enter_stage(state: _StageState, stage: str) -> None:
    if state.current == stage:
        return
    if state.current is not None:
        _close_stage(state, state.current)
    state.current = stage
    state.started.setdefault(stage, time.monotonic())
    if state.registry is not None:  # training clients are counted per stage they were created in
        state.registry.current_stage = stage


def _check_budget_on_entry(state: _StageState, stage: str) -> None:
    """Once per service stage, before its first test: a spent run budget blocks the stage (recorded
    as blocked_by_budget in the ledger; evidence so far stays persisted) and fails it."""
    if stage == "unit" or state.bundle is None or stage in state.budget_checked:
        return
    state.budget_checked.add(stage)
    if state.bundle.remaining_seconds() is not None and not state.bundle.budget_allows(stage, 0.0):
        state.first_failure.setdefault(stage, f"blocked_by_budget before {stage}")


def _close_stage(state: _StageState, stage: str) -> None:
    state.finished[stage] = time.monotonic()
    if state.registry is not None:
        _note_releases(state, state.registry.release_stage(stage))
    bundle = state.bundle
    if bundle is None:
        return
    if state.registry is not None and stage != "unit":
        created = state.registry.training_clients_by_stage().get(stage, 0)
        bundle.update_result(metrics={f"clients/training_created/{stage}": float(created)})
    status = "failed" if stage in state.first_failure else "passed"
    bundle.stage_timing(stage, state.finished[stage] - state.started[stage], status)
    if stage != "unit":  # an immutable result snapshot at each service stage's end (issue 11 §7)
        from dppo_harness.evidence.snapshots import post_snapshot

        post_snapshot(bundle, f"stage {stage} end", reserve=4)


def _note_releases(state: _StageState, records: list[dict[str, Any]]) -> None:
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state.releases += [dict(r, released_at=at) for r in records]


def record_client_releases(config: pytest.Config, records: list[dict[str, Any]]) -> None:
    """Release records of clients a fixture released itself (kept for client-releases.json)."""
    _note_releases(config.stash[_STATE_KEY], records)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    stop = _service_stop(call.excinfo.value if call.excinfo is not None else None)
    if stop is not None:  # the wait policy stopped the stage: its one line, not a traceback
        report.longrepr = stop.line
    if report.when == "call" or report.outcome != "passed":
        counts = item.config.stash[_STATE_KEY].outcomes.setdefault(
            item.stash.get(STAGE_KEY, "unit"), {"passed": 0, "failed": 0, "skipped": 0, "failed_tests": []})
        counts[report.outcome] += 1
        if report.failed:
            counts["failed_tests"].append(f"{item.nodeid} ({report.when})")
    if report.failed:
        state = item.config.stash[_STATE_KEY]
        state.first_failure.setdefault(item.stash.get(STAGE_KEY, "unit"), item.nodeid)


_SAY_LOCK = threading.Lock()  # progress.Watchdog writes from a background thread too


def progress_printer(config: pytest.Config) -> Callable[[str], None]:
    """A function printing one progress line on the terminal (past pytest's output capture);
    writers on several threads take turns."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def say(msg: str) -> None:
        with _SAY_LOCK:
            if reporter is None:
                print(msg, flush=True)
                return
            if capture is not None:
                with capture.global_and_fixture_disabled():
                    reporter.write_line(msg)
            else:
                reporter.write_line(msg)

    return say


def stops_stage(fixture: Callable[..., Any]) -> Callable[..., Any]:
    """For a stage's session fixture: a stop by the service wait policy (service_wait.ServiceStopped,
    a BaseException so that stage code cannot swallow it) fails the requesting test with its one
    line, cached like any fixture failure, so every later test of the stage gets the same line."""

    @functools.wraps(fixture)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fixture(*args, **kwargs)
        except BaseException as exc:
            stop = _service_stop(exc)
            if stop is None:
                raise
            line = stop.line
        pytest.fail(line, pytrace=False)  # outside the except: the line, without a chained traceback

    return run


def _service_stop(exc: BaseException | None) -> Any:
    """The service_wait.ServiceStopped behind a failure, if any (the module is loaded only once
    a service client exists, so a session without one never imports the SDK here)."""
    import sys

    module = sys.modules.get("dppo_harness.service.service_wait_policy")
    if exc is None or module is None:
        return None
    return exc if isinstance(exc, module.ServiceStopped) else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_STATE_KEY, None)
    if state is None or state.current is None:
        return
    _close_stage(state, state.current)
    state.current = None
    if state.bundle is None:
        return
    from dppo_harness.evidence import LimitError

    try:
        _write_session_records(state)
    except LimitError as exc:  # the records do not fit: say so in the ledger, still close the result
        state.bundle.note_ledger(session_records_not_written=str(exc))
        session.config.get_terminal_writer().line(f"evidence: session records not written: {exc}", red=True)
    if state.outcome is not None and not state.first_failure:
        state.bundle.finish(**state.outcome)
    state.bundle.finish_session(stage_failures=dict(state.first_failure))
    from dppo_harness.service.identity import finalize_labels  # the stand-in stays named

    finalize_labels(state.bundle)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The run's closing block (run_summary.summary_lines), when a stage opened an evidence bundle."""
    state = config.stash.get(_STATE_KEY, None)
    if state is None or state.bundle is None:
        return
    from dppo_harness.evidence.run_summary import TITLE, summary_lines

    messages = {}
    for rep in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", []):
        for stage, nodeid in state.first_failure.items():
            if getattr(rep, "nodeid", None) == nodeid and stage not in messages:
                crash = getattr(getattr(rep, "longrepr", None), "reprcrash", None)
                messages[stage] = f"{nodeid}: {(getattr(crash, 'message', '') or 'failed').splitlines()[0]}"
    terminalreporter.write_sep("=", TITLE)
    for line in summary_lines(state.bundle.result, state.bundle.dir, stage_failures=state.first_failure,
                              failure_messages=messages, stage_order=stages.STAGES):
        terminalreporter.write_line(line)


def _release_remaining(state: _StageState) -> None:
    """Release every client not yet released and note when (the session fixture's teardown may
    run before pytest_sessionfinish, so both call this; the second call finds nothing pending)."""
    if state.registry is None:
        return
    pending = [r for r in state.registry.records() if not r["released"]]
    if not pending:
        return
    state.registry.release_all()
    now = {(r["label"], r["stage"]): r for r in state.registry.records()}
    _note_releases(state, [dict(r, released=now[(r["label"], r["stage"])]["released"],
                                error=now[(r["label"], r["stage"])]["error"]) for r in pending])


def _write_session_records(state: _StageState) -> None:
    """Unit-parity summary and client-release records as evidence files (issue 11 point 8). The
    session's own clients are released here, before the result is closed, so the record is true."""
    bundle = state.bundle
    _release_remaining(state)
    if bundle.entry("client-releases.json") is None:
        bundle.register_json("client-releases.json", "log", client_release_record(state))
    unit = state.outcomes.get("unit")
    if unit is not None and bundle.entry("unit-parity-summary.json") is None:
        bundle.register_json("unit-parity-summary.json", "report", {
            "kind": "unit_parity_summary", "stage": "unit", **unit,
            # Which run this is: this pytest session (the bundle's), before any service stage.
            "selection": "tests/unit without the tests marked integration, in this pytest session",
            "seconds": (state.finished["unit"] - state.started["unit"]) if "unit" in state.finished else None,
            "all_stages": {k: {kk: vv for kk, vv in v.items() if kk != "failed_tests"} for k, v in state.outcomes.items()}})


CLIENT_RELEASE_NOTE = (
    "tinker 0.38.0 has no per-client release: ServiceClient.close(status) finishes its session, which ends every "
    "training and sampling client the session created. Each session below lists the training clients it created "
    "(stage, SDK method, role); `events` says, at each release, which sessions it closed and which stayed open.")


def client_release_record(state: _StageState) -> dict[str, Any]:
    """client-releases.json: every session (ServiceClient) with its training clients, when each was
    closed, what stayed open at each release, and training clients created per stage."""
    reg = state.registry
    sessions = reg.records() if reg is not None else []
    by_stage = reg.training_clients_by_stage() if reg is not None else {}
    return {"kind": "client_releases", "all_released": all(r["released"] for r in state.releases),
            "sessions": sessions, "events": list(reg.events) if reg is not None else [],
            "training_clients_by_stage": by_stage, "training_clients_total": sum(by_stage.values()),
            "releases": state.releases, "note": CLIENT_RELEASE_NOTE}


def unit_parity_passed(config: pytest.Config) -> bool:
    """Stage 'unit' ran in this session (on this code) and none of its tests failed."""
    state = config.stash[_STATE_KEY]
    counts = state.outcomes.get("unit", {})
    return counts.get("passed", 0) > 0 and not counts.get("failed", 0) and "unit" not in state.first_failure


def propose_outcome(config: pytest.Config, **fields: object) -> None:
    """A stage's final status/verdict/outcome_reason, written at session end only if no test failed."""
    config.stash[_STATE_KEY].outcome = dict(fields)


# ---- session fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def harness_options(pytestconfig: pytest.Config) -> HarnessOptions:
    return pytestconfig.stash[_OPTIONS_KEY]


@dataclass(frozen=True)
class ServiceBackend:
    kind: Literal["local", "tinker"]
    base_url: str
    server: LocalServerProcess | None  # the embedded server when kind == "local"


@pytest.fixture(scope="session")
def service_backend(harness_options: HarnessOptions, tmp_path_factory: pytest.TempPathFactory,
                    harness_progress: Any) -> Iterator[ServiceBackend]:
    if harness_options.backend == "tinker":
        yield ServiceBackend("tinker", os.environ["TINKER_BASE_URL"], None)
        return
    from dppo_harness.local_server.process import LocalServerProcess

    run_dir = tmp_path_factory.mktemp("local-server")
    if "comparison" in harness_options.selected_stages:  # issue 9: --resume loads states saved by an earlier server
        run_dir = harness_options.evidence_dir / "local-server"
        run_dir.mkdir(parents=True, exist_ok=True)
    # The first start builds the stand-in model (minutes on 2 cores): its progress is forwarded.
    with LocalServerProcess(run_dir=run_dir, progress=harness_progress) as server:
        yield ServiceBackend("local", server.base_url, server)


@pytest.fixture(scope="session")
def client_registry(pytestconfig: pytest.Config) -> Iterator[ClientRegistry]:
    """Every service client the harness creates; stage-scoped ones are released at stage end."""
    from dppo_harness.service.clients import ClientRegistry

    registry = ClientRegistry()
    registry.install_atexit()
    state = pytestconfig.stash[_STATE_KEY]
    state.registry = registry
    registry.current_stage = state.current
    yield registry
    _release_remaining(pytestconfig.stash[_STATE_KEY])  # recorded for client-releases.json
    registry.release_all()


@pytest.fixture(scope="session")
def service_waiter(request: pytest.FixtureRequest, harness_options: HarnessOptions, service_backend: ServiceBackend,
                   evidence_bundle: EvidenceBundle, client_registry: ClientRegistry) -> Any:
    """The session's one wait policy: every client of every ServiceClient the harness makes waits
    under it; long waits are posted to the evidence, a stop releases the clients and records why."""
    from dppo_harness.service.service_wait import ServiceWaiter
    from dppo_harness.service.service_wait_policy import CAPACITY_SCALE_VAR, WaitPolicy
    from dppo_harness.service.wait_evidence import BundlePoster

    # The local rehearsal has no shared capacity to wait for: capacity defaults 100x shorter, same rules.
    scale = 0.01 if service_backend.kind == "local" and not os.environ.get(CAPACITY_SCALE_VAR) else None
    policy = WaitPolicy.from_options(capacity_patience_s=harness_options.capacity_patience_s,
                                     capacity_patience_after_steps_s=harness_options.capacity_patience_after_steps_s,
                                     service_timeout_s=harness_options.service_timeout_s, scale=scale)
    poster = BundlePoster(evidence_bundle, client_registry)
    return ServiceWaiter(policy, on_post=poster.post, on_stop=poster.stop, say=progress_printer(request.config))


@pytest.fixture(scope="session")
def service_client(service_backend: ServiceBackend, client_registry: ClientRegistry, harness_options: HarnessOptions,
                   training_client_observer: Any, service_waiter: Any) -> tinker.ServiceClient:
    """The session's client: the restored arms live on it across stages; released on exit."""
    from dppo_harness.service.clients import make_service_client

    return make_service_client(
        service_backend.kind, service_backend.base_url, registry=client_registry, stage="session",
        observer=training_client_observer,  # every training client's identity -> evidence
        label="session: the arms' training clients and evaluation samplers (open until the session ends)",
        waiter=service_waiter, proxy_tokens=harness_options.proxy_credentials,
        sdk_telemetry=harness_options.sdk_telemetry,
    )


@pytest.fixture(scope="session")
def plan(pytestconfig: pytest.Config, harness_options: HarnessOptions) -> Plan:
    """The plan validated at configure time (the same bytes), else loaded now."""
    return pytestconfig.stash.get(_PLAN_KEY, None) or load_plan(harness_options.plan_path)


@pytest.fixture(scope="session")
def evidence_bundle(pytestconfig: pytest.Config, harness_options: HarnessOptions, plan: Plan,
                    service_backend: ServiceBackend, connectivity: Any) -> EvidenceBundle:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.stages.feasibility import rehearsal_sizing

    bundle = EvidenceBundle.create(harness_options.evidence_dir)
    # Recorded before any service call: a local run rehearses the spec at a declared, fixed size.
    _, reductions = rehearsal_sizing(plan, embedded_server=connectivity.embedded)
    bundle.start_session(
        backend=harness_options.backend,
        plan=plan,
        stages=harness_options.selected_stages,
        project_root=project.project_root(),
        test_files=sorted({str(p) for p in _stage_test_files(pytestconfig)}),
        size_reductions=reductions,
        # The embedded server names its stand-in model; a real service names it at client creation.
        served_model=(connectivity.marker.stand_in if connectivity.marker and connectivity.marker.stand_in
                      else service_backend.server.stats()["served_model"] if service_backend.server else None),
    )
    # the connectivity report; on the embedded server (marker), the rehearsal label.
    from dppo_harness.service.clients import sdk_versions
    from dppo_harness.service.identity import record_session_identity

    record_session_identity(bundle, connectivity, harness_options.backend, sdk_versions())
    pytestconfig.stash[_STATE_KEY].bundle = bundle
    return bundle


def _stage_test_files(config: pytest.Config) -> list[Path]:
    return [Path(it.path) for it in config.stash.get(_ITEMS_KEY, [])]


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_ITEMS_KEY] = list(session.items)

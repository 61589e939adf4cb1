"""Pytest hooks of the harness plugin: options, stage selection and order, fail-fast, launch scope,
and the session's closing records. Registered through the `pytest11` entry point named after this
module, so `--plan` and friends are known wherever pytest runs (the project's conftest.py names it
too; pytest then skips it as registered). A malformed plan is a usage error at configure time.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

from dppo_harness.evidence import UnwritableEvidenceError
from dppo_harness.evidence.run_summary import TITLE, summary_lines
from dppo_harness.evidence.session import finish_session, unclosed_line
from dppo_harness.plans import PlanError, launch_refusal, launch_undecided_refusal, load_plan, unauthorized_stages
from dppo_harness.pytest_plugin import stages
from dppo_harness.pytest_plugin.options import (
    refuse_unsafe_credentials,
    resolve_options,
    skip_setup_stages_on_resume,
    validated_plan,
)
from dppo_harness.pytest_plugin.rootdir import reroot
from dppo_harness.pytest_plugin.session import (
    CONNECTIVITY_KEY,
    OPTIONS_KEY,
    PLAN_KEY,
    STAGE_KEY,
    STATE_KEY,
    StageState,
    check_budget_on_entry,
    close_stage,
    enter_stage,
    new_stage_outcomes,
    selected_for_run,
    unwritable_evidence,
    write_session_records,
)
from dppo_harness.service.config import redact_url
from dppo_harness.service.wait.policy import ServiceStopped


def pytest_addoption(parser: pytest.Parser) -> None:
    """The harness's options; docs/service.md and docs/evidence.md say more of each."""
    add = parser.getgroup("dppo_harness", "DPPO experiment harness").addoption
    add("--backend", choices=("local", "tinker"), help="'tinker' when TINKER_BASE_URL is set, else 'local' (embedded)")
    add("--plan", help="plan JSON (default: chosen by the selected stage)")
    add("--evidence-dir", help="evidence root (default: the project's evidence/)")
    add("--resume", metavar="RUN_ID", help="continue a stopped comparison from its arms' last saved state")
    add("--save-every", type=int, default=5, metavar="N", help="comparison: save each arm every N steps (1..10)")
    add("--comparison-schedule", choices=("interleaved", "concurrent"), help="how the arms advance (interleaved)")
    for name, help_text in (
        ("--capacity-patience-s", "give up after the service paused for S seconds, no step done (600)"),
        ("--capacity-patience-after-steps-s", "the same once a comparison step completed (1800)"),
        ("--service-timeout-s", "stop the stage when an active request gives no answer for S seconds (900)"),
    ):
        add(name, type=float, metavar="S", help=help_text)
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
        state.run, _ = stages.expand_selection(selected)
        config.option.markexpr = ""
    config.stash[STATE_KEY] = state
    skip_setup_stages_on_resume(config, state)
    options = resolve_options(config, state)
    if not config.option.help:
        refuse_unsafe_credentials()
    config.stash[OPTIONS_KEY] = options
    if (plan := validated_plan(config, options)) is not None:
        config.stash[PLAN_KEY] = plan
    config.pluginmanager.import_plugin("dppo_harness.pytest_plugin.fixtures")


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
    selected = [selected_for_run(config, state, item) for item in items]
    keep = [item for item, chosen in zip(items, selected) if chosen]
    drop = [item for item, chosen in zip(items, selected) if not chosen]
    if drop:
        config.hook.pytest_deselected(items=drop)
    # Stable sort: collection order inside a stage, stage order across stages.
    keep.sort(key=lambda it: stages.stage_index(it.stash[STAGE_KEY]))
    items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Launch scope, once, before the first test, from the plan that will run however the stages
    were selected (`-m`, paths, node ids): on a service that is not the embedded server, a collected
    stage the plan's launch does not authorize ends the session at once with one line saying what
    would authorize it (plans.launch); so does a connectivity preflight that cannot tell which
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
    from dppo_harness.service.connectivity import ConnectivityError, check_connectivity

    url = os.environ["TINKER_BASE_URL"]
    try:
        report = check_connectivity(
            "tinker", url, plan.base_model, proxy_tokens=options.proxy_credentials, sdk_telemetry=options.sdk_telemetry
        )
    except ConnectivityError as exc:
        line = launch_undecided_refusal(
            plan.name,
            plan.launch,
            collected,
            service=redact_url(url) or "the service",
            seen=f"connectivity preflight ({exc.check}): {exc.line}",
        )
        pytest.exit(str(line), returncode=pytest.ExitCode.USAGE_ERROR)  # stages need authorization: never None
    config.stash[CONNECTIVITY_KEY] = report
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, ServiceStopped):  # the wait policy stopped the stage: its one line, not a traceback
        report.longrepr = exc.line
    refused = unwritable_evidence(exc)
    if refused is not None:  # nothing more can be recorded: its one line, and no later test runs
        report.longrepr = refused
        item.session.shouldstop = refused
    state, stage = item.config.stash[STATE_KEY], item.stash.get(STAGE_KEY, "unit")
    if report.when == "call" or report.outcome != "passed":
        counts = state.outcomes.setdefault(stage, new_stage_outcomes())
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

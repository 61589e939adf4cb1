"""Pytest plugin: the experiment's gated stages, their order, fail-fast and session fixtures.

Registered from the project's top-level conftest.py. Stage rules live in `stages.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dppo_harness import stages

STAGE_KEY = pytest.StashKey[str]()
_STATE_KEY = pytest.StashKey["_StageState"]()

# Fixture modules of later stages; each owns the session fixtures of its step.
FIXTURE_PLUGINS = ("dppo_harness.fixtures_preflight", "dppo_harness.fixtures_stages",
                   "dppo_harness.fixtures_connectivity")  # issue 10: connectivity + served identity


@dataclass(frozen=True)
class HarnessOptions:
    backend: str  # "local" (embedded server) or "tinker" (TINKER_BASE_URL)
    plan_path: Path
    evidence_dir: Path
    selected_stages: tuple[str, ...]  # the stages this session runs, in order


@dataclass
class _StageState:
    run: dict[str, bool] | None = None  # stage -> selected itself (None: no stage selection)
    first_failure: dict[str, str] = field(default_factory=dict)  # stage -> failing nodeid
    started: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    current: str | None = None
    bundle: object | None = None  # the session's EvidenceBundle, once a test asked for it
    registry: object | None = None  # the session's ClientRegistry, once a test asked for it
    outcome: dict | None = None  # final result fields a stage proposed, applied if nothing failed


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dppo_harness", "DPPO experiment harness")
    group.addoption(
        "--backend",
        choices=("local", "tinker"),
        default=None,
        help="training backend: 'tinker' when TINKER_BASE_URL is set, else 'local' (embedded server)",
    )
    group.addoption("--plan", default=None, help="plan JSON (default: chosen by the selected stage)")
    group.addoption("--evidence-dir", default=None, help="evidence root (default: ./evidence)")


def pytest_configure(config: pytest.Config) -> None:
    for stage in stages.STAGES:
        config.addinivalue_line("markers", f"{stage}: test of the '{stage}' experiment stage")
    config.addinivalue_line("markers", "integration: needs the embedded server (stage 'unit')")
    state = _StageState()
    selected = stages.parse_stage_selection(config.option.markexpr)
    if selected is not None:
        # We select by stage ourselves so that prerequisites run too.
        state.run, _ = stages.expand_selection(selected)
        config.option.markexpr = ""
    config.stash[_STATE_KEY] = state
    config.stash[_OPTIONS_KEY] = _resolve_options(config, state)
    for name in FIXTURE_PLUGINS:
        config.pluginmanager.import_plugin(name)


_OPTIONS_KEY = pytest.StashKey[HarnessOptions]()


def _resolve_options(config: pytest.Config, state: _StageState) -> HarnessOptions:
    backend = config.getoption("--backend") or (
        "tinker" if os.environ.get("TINKER_BASE_URL") else "local"
    )
    if backend == "tinker" and not os.environ.get("TINKER_BASE_URL"):
        raise pytest.UsageError("--backend tinker needs the environment variable TINKER_BASE_URL")
    run_stages = tuple(state.run) if state.run else ("unit",)
    plan_opt = config.getoption("--plan")
    plan_path = (
        Path(plan_opt) if plan_opt else config.rootpath / "plans" / stages.default_plan_name(run_stages)
    )
    if plan_opt and not plan_path.is_file():
        raise pytest.UsageError(f"--plan: no such plan file: {plan_path}")
    evidence_opt = config.getoption("--evidence-dir")
    evidence_dir = Path(evidence_opt) if evidence_opt else config.rootpath / "evidence"
    if evidence_dir.exists() and not evidence_dir.is_dir():
        raise pytest.UsageError(f"--evidence-dir: not a directory: {evidence_dir}")
    return HarnessOptions(backend, plan_path.resolve(), evidence_dir.resolve(), run_stages)


def stage_started_at(config: pytest.Config, stage: str) -> float | None:
    """time.monotonic() when the stage's first test began, or None before that."""
    state = config.stash.get(_STATE_KEY, None)
    return state.started.get(stage) if state is not None else None


def _tests_root(config: pytest.Config) -> Path:
    return config.rootpath / "tests"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[_STATE_KEY]
    root = _tests_root(config)
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        stage = stages.stage_of(markers, item.path, root)
        item.stash[STAGE_KEY] = stage
        item.add_marker(stage)
        if stages.stage_from_path(item.path, root) is None and stage == "unit":
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
        # As a mere prerequisite, stage "unit" means unit parity: tests/unit, not the server tests.
        return state.run[stage] or item.get_closest_marker("integration") is None
    # Without a stage selection: explicit paths run as given; the default run is unit + integration.
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return True
    return stage == "unit"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    state = item.config.stash[_STATE_KEY]
    stage = item.stash.get(STAGE_KEY, "unit")
    _enter_stage(state, stage)
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


def _close_stage(state: _StageState, stage: str) -> None:
    state.finished[stage] = time.monotonic()
    if state.registry is not None:
        state.registry.release_stage(stage)
    bundle = state.bundle
    if bundle is None:
        return
    status = "failed" if stage in state.first_failure else "passed"
    bundle.stage_timing(stage, state.finished[stage] - state.started[stage], status)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        state = item.config.stash[_STATE_KEY]
        state.first_failure.setdefault(item.stash.get(STAGE_KEY, "unit"), item.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_STATE_KEY, None)
    if state is None or state.current is None:
        return
    _close_stage(state, state.current)
    state.current = None
    if state.bundle is None:
        return
    if state.outcome is not None and not state.first_failure:
        state.bundle.finish(**state.outcome)
    state.bundle.finish_session(stage_failures=dict(state.first_failure))
    from dppo_harness.identity import finalize_labels  # issue 10: the stand-in stays named

    finalize_labels(state.bundle)


def propose_outcome(config: pytest.Config, **fields: object) -> None:
    """A stage's final status/verdict/outcome_reason, written at session end only if no test failed."""
    config.stash[_STATE_KEY].outcome = dict(fields)


# ---- session fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def harness_options(pytestconfig: pytest.Config) -> HarnessOptions:
    return pytestconfig.stash[_OPTIONS_KEY]


@dataclass(frozen=True)
class ServiceBackend:
    kind: str  # "local" or "tinker"
    base_url: str
    server: object | None  # the LocalServerProcess when kind == "local"


@pytest.fixture(scope="session")
def service_backend(harness_options: HarnessOptions, tmp_path_factory) -> Iterator[ServiceBackend]:
    if harness_options.backend == "tinker":
        yield ServiceBackend("tinker", os.environ["TINKER_BASE_URL"], None)
        return
    from dppo_harness.local_server.process import LocalServerProcess

    run_dir = tmp_path_factory.mktemp("local-server")
    with LocalServerProcess(run_dir=run_dir) as server:
        yield ServiceBackend("local", server.base_url, server)


@pytest.fixture(scope="session")
def client_registry(pytestconfig: pytest.Config) -> Iterator[object]:
    """Every service client the harness creates; stage-scoped ones are released at stage end."""
    from dppo_harness.service import ClientRegistry

    registry = ClientRegistry()
    registry.install_atexit()
    pytestconfig.stash[_STATE_KEY].registry = registry
    yield registry
    registry.release_all()


@pytest.fixture(scope="session")
def service_client(service_backend: ServiceBackend, client_registry, training_client_observer):
    """The session's client: the restored arms live on it across stages; released on exit."""
    from dppo_harness.service import make_service_client

    return make_service_client(
        service_backend.kind, service_backend.base_url, registry=client_registry, stage="session",
        observer=training_client_observer,  # issue 10: every training client's identity -> evidence
    )


@pytest.fixture(scope="session")
def spec_plan(pytestconfig: pytest.Config):
    from dppo_harness.plans import load_plan

    return load_plan(pytestconfig.rootpath / "plans" / "exp_e6b0965af3.json")


@pytest.fixture(scope="session")
def plan(harness_options: HarnessOptions):
    from dppo_harness.plans import load_plan

    return load_plan(harness_options.plan_path)


@pytest.fixture(scope="session")
def evidence_bundle(pytestconfig: pytest.Config, harness_options: HarnessOptions, plan, service_backend,
                    connectivity):
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.feasibility import local_rehearsal

    bundle = EvidenceBundle.create(harness_options.evidence_dir)
    # Recorded before any service call: a local run rehearses the spec at a declared, fixed size.
    _, reductions = local_rehearsal(plan) if harness_options.backend == "local" else ({}, [])
    bundle.start_session(
        backend=harness_options.backend,
        plan=plan,
        stages=harness_options.selected_stages,
        project_root=pytestconfig.rootpath,
        test_files=sorted({str(p) for p in _stage_test_files(pytestconfig)}),
        size_reductions=reductions,
        # The embedded server names its stand-in model; a real service names it at client creation.
        served_model=(connectivity.marker.stand_in if connectivity.marker and connectivity.marker.stand_in  # issue 10
                      else service_backend.server.stats()["served_model"] if service_backend.server else None),
    )
    # issue 10: the connectivity report; on the embedded server (marker), the rehearsal label.
    from dppo_harness.identity import record_session_identity
    from dppo_harness.service import sdk_versions

    record_session_identity(bundle, connectivity, harness_options.backend, sdk_versions())
    pytestconfig.stash[_STATE_KEY].bundle = bundle
    return bundle


def _stage_test_files(config: pytest.Config) -> list[Path]:
    session = getattr(config, "_harness_session", None)
    items = session.items if session is not None else []
    return [Path(it.path) for it in items]


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config._harness_session = session  # type: ignore[attr-defined]

"""Session state of the harness plugin: options, stage bookkeeping, client-release records and the
helpers fixtures use to talk to the session (progress lines, stops, proposed outcomes).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypedDict, TypeVar

import pytest

from dppo_harness.evidence.errors import UnwritableEvidenceError
from dppo_harness.evidence.snapshots import post_snapshot
from dppo_harness.plans import BackendKind, Plan
from dppo_harness.service.wait.policy import ServiceStopped

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.service.connectivity import ConnectivityReport
    from dppo_harness.service.release import ClientRegistry

# One session's release record as ClientRegistry.records()/release_stage() return it (service.release
# builds it as a dict), plus `released_at` once noted here; written to client-releases.json.
ReleaseRecord = dict[str, Any]


STAGE_KEY = pytest.StashKey[str]()


STATE_KEY = pytest.StashKey["StageState"]()


PLAN_KEY = pytest.StashKey[Plan]()


ITEMS_KEY = pytest.StashKey[list[pytest.Item]]()


CONNECTIVITY_KEY = pytest.StashKey["ConnectivityReport"]()


@dataclass(frozen=True)
class HarnessOptions:
    backend: BackendKind  # "local": embedded server; "tinker": TINKER_BASE_URL
    plan_path: Path
    evidence_dir: Path
    selected_stages: tuple[str, ...]  # the stages this session runs, in order
    # -- comparison stage
    resume: str | None = None  # --resume RUN_ID: continue that run's saved comparison state
    comparison_schedule: Literal["interleaved", "concurrent"] | None = (
        None  # None: the default for the service (comparison.config.comparison_schedule)
    )
    save_every: int = 5  # --save-every N: each arm's state (weights + optimizer) every N rollout steps
    # -- the service wait policy (service.wait.policy.WaitPolicy); None: the default (capacity defaults
    # shrunk by DPPO_HARNESS_CAPACITY_SCALE, or 100x on the local backend)
    capacity_patience_s: float | None = None
    capacity_patience_after_steps_s: float | None = None
    service_timeout_s: float | None = None
    proxy_credentials: Literal["modal", "runs"] = "modal"  # which proxy tokens feed Modal-Key/Modal-Secret
    sdk_telemetry: bool = False  # let the SDK post its telemetry (off: TINKER_TELEMETRY=0)


OPTIONS_KEY = pytest.StashKey[HarnessOptions]()


class StageOutcomes(TypedDict):
    """Test outcome counts of one stage (unit-parity-summary.json, in this key order)."""

    passed: int
    failed: int
    skipped: int
    failed_tests: list[str]  # "<nodeid> (<phase>)" of each failed test


def new_stage_outcomes() -> StageOutcomes:
    return {"passed": 0, "failed": 0, "skipped": 0, "failed_tests": []}


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
    releases: list[ReleaseRecord] = field(default_factory=list)  # client releases, when (client-releases.json)
    outcomes: dict[str, StageOutcomes] = field(default_factory=dict)  # stage -> test outcome counts


def early_connectivity(config: pytest.Config) -> ConnectivityReport | None:
    """The connectivity report the launch-scope check read before the first test, else None."""
    return config.stash.get(CONNECTIVITY_KEY, None)


def selected_for_run(config: pytest.Config, state: StageState, item: pytest.Item) -> bool:
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
        note_releases(state, state.registry.release_stage(stage))
    bundle = state.bundle
    if bundle is None:
        return
    if state.registry is not None and stage != "unit":
        created = state.registry.training_clients_by_stage().get(stage, 0)
        bundle.update_result(metrics={f"clients/training_created/{stage}": float(created)})
    status = "failed" if stage in state.first_failure else "passed"
    bundle.stage_timing(stage, state.finished[stage] - state.started[stage], status)
    if (
        stage != "unit"
    ):  # an immutable result snapshot at each service stage's end (a killed run keeps each finished stage's result)
        post_snapshot(bundle, f"stage {stage} end", reserve=4, stage_end=True)


def note_releases(state: StageState, records: list[ReleaseRecord]) -> None:
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state.releases += [dict(r, released_at=at) for r in records]


def record_client_releases(config: pytest.Config, records: list[ReleaseRecord]) -> None:
    """Release records of clients a fixture released itself (kept for client-releases.json)."""
    note_releases(config.stash[STATE_KEY], records)


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


_P = ParamSpec("_P")
_T = TypeVar("_T")


def stops_stage(fixture: Callable[_P, _T]) -> Callable[_P, _T]:
    """For a stage's session fixture: a stop by the service wait policy (service.wait.policy.ServiceStopped,
    a BaseException so that stage code cannot swallow it) fails the requesting test with its one
    line, cached like any fixture failure, so every later test of the stage gets the same line."""

    @functools.wraps(fixture)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return fixture(*args, **kwargs)
        except BaseException as exc:
            stop = service_stop(exc)
            if stop is None:
                raise
            line = stop.line
        pytest.fail(line, pytrace=False)  # outside the except: the line, without a chained traceback

    return run


def service_stop(exc: BaseException | None) -> ServiceStopped | None:
    """The ServiceStopped behind a failure, if any."""
    return exc if isinstance(exc, ServiceStopped) else None


def unwritable_evidence(exc: BaseException | None) -> str | None:
    """The one line of a refused evidence write behind a failure (disk full, read-only, permission),
    if any: the write itself, or what the stage raised while it handled it."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, UnwritableEvidenceError):
            return str(exc)
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def release_remaining(state: StageState) -> None:
    """Release every client not yet released and note when (the session fixture's teardown may
    run before pytest_sessionfinish, so both call this; the second call finds nothing pending)."""
    if state.registry is None:
        return
    pending = [r for r in state.registry.records() if not r["released"]]
    if not pending:
        return
    state.registry.release_all()
    now = {(r["label"], r["stage"]): r for r in state.registry.records()}
    note_releases(
        state,
        [
            dict(r, released=now[(r["label"], r["stage"])]["released"], error=now[(r["label"], r["stage"])]["error"])
            for r in pending
        ],
    )


def write_session_records(state: StageState) -> None:
    """Unit-parity summary and client-release records as evidence files (what a reviewer checks ran). The
    session's own clients are released here, before the result is closed, so the record is true."""
    bundle = state.bundle
    release_remaining(state)
    if bundle is None:  # pytest_sessionfinish writes the records only once a bundle exists
        return
    if bundle.entry("client-releases.json") is None:
        bundle.register_json("client-releases.json", "log", client_release_record(state))
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


CLIENT_RELEASE_NOTE = (
    "tinker 0.25.0 has no session finish and no close: a model stays loaded until it is unloaded or the "
    "service's idle sweep reclaims it. Each session below lists the training clients it created (stage, SDK "
    "method, role) and, per model, how it was released: `unload_model` (POST /api/v1/unload_model, the "
    "SDK's UnloadModelRequest), whether the service answered it and what it said. A session counts as "
    "released only when every unload was answered; `events` says, at each release, which sessions it "
    "released and which stayed open."
)


class ClientReleaseRecord(TypedDict):
    """client-releases.json, in this key order."""

    kind: Literal["client_releases"]
    all_released: bool
    sessions: list[dict[str, Any]]  # ClientRegistry.records(): one per ServiceClient session
    events: list[dict[str, Any]]  # ClientRegistry.events: what each release closed and what stayed open
    training_clients_by_stage: dict[str, int]
    training_clients_total: int
    releases: list[ReleaseRecord]
    note: str


def client_release_record(state: StageState) -> ClientReleaseRecord:
    """client-releases.json: every session (ServiceClient) with its training clients, when each was
    closed, what stayed open at each release, and training clients created per stage."""
    reg = state.registry
    sessions = reg.records() if reg is not None else []
    by_stage = reg.training_clients_by_stage() if reg is not None else {}
    return {
        "kind": "client_releases",
        "all_released": all(r["released"] for r in state.releases),
        "sessions": sessions,
        "events": list(reg.events) if reg is not None else [],
        "training_clients_by_stage": by_stage,
        "training_clients_total": sum(by_stage.values()),
        "releases": state.releases,
        "note": CLIENT_RELEASE_NOTE,
    }


def unit_parity_passed(config: pytest.Config) -> bool:
    """Stage 'unit' ran in this session (on this code) and none of its tests failed."""
    state = config.stash[STATE_KEY]
    counts = state.outcomes.get("unit")
    return counts is not None and counts["passed"] > 0 and not counts["failed"] and "unit" not in state.first_failure


def propose_outcome(config: pytest.Config, **fields: object) -> None:
    """A stage's final status/verdict/outcome_reason, written at session end only if no test failed."""
    config.stash[STATE_KEY].outcome = dict(fields)

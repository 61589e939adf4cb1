"""Session fixtures of the harness plugin (registered by `hooks.pytest_configure`): the session's
backend, clients, plan and evidence (one `Harness` record), and one fixture per stage's run, a thin
adapter calling the stage's library function. The stages, the service modules and the embedded
server load the tinker SDK, torch or httpx (seconds): each fixture imports them when a test first
asks for it, so that pytest start-up and unit-only sessions never pay.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import pytest

from dppo_harness import project
from dppo_harness.evidence import EvidenceBundle
from dppo_harness.evidence.backend import SERVED_MODEL_UNAVAILABLE, Backend, served_name
from dppo_harness.evidence.files import SERVER_DIR, STATE_ROOT
from dppo_harness.evidence.progress import Watchdog
from dppo_harness.evidence.session import effective_config, start_session
from dppo_harness.plans import BackendKind, Plan, load_plan
from dppo_harness.pytest_plugin.hooks import OPTIONS_KEY, PLAN_KEY, STATE_KEY, HarnessOptions, session_connectivity
from dppo_harness.service.config import sdk_versions
from dppo_harness.service.wait.policy import CapacityExhausted, ServiceDied, ServiceStopped
from dppo_harness.stages import write
from dppo_harness.stages.comparison.config import ComparisonError, comparison_schedule
from dppo_harness.stages.comparison.wall_guard import wall_guard_from_feasibility

if TYPE_CHECKING:
    import tinker

    from dppo_harness.local_server.process import LocalServerProcess  # lazy: see the module docstring
    from dppo_harness.service.connectivity import ConnectivityReport  # lazy: see the module docstring
    from dppo_harness.service.observed import ClientRegistry, TrainingClientRecorder  # lazy: see the module docstring
    from dppo_harness.service.wait.waiter import ServiceWaiter  # lazy: see the module docstring
    from dppo_harness.stages.comparison.run import ComparisonResult  # lazy: see the module docstring
    from dppo_harness.stages.diagnostic.loop import DiagnosticResult  # lazy: see the module docstring
    from dppo_harness.stages.feasibility import FeasibilityResult  # lazy: see the module docstring
    from dppo_harness.stages.gate import GateReport  # lazy: see the module docstring
    from dppo_harness.stages.restoration import RestorationResult  # lazy: see the module docstring


_SAY_LOCK = threading.Lock()  # progress.Watchdog writes from a background thread too
_P = ParamSpec("_P")
_T = TypeVar("_T")


def stops_stage(fixture: Callable[_P, _T]) -> Callable[_P, _T]:
    """For a stage's session fixture: a stop by the service wait policy (ServiceStopped, a
    BaseException so that stage code cannot swallow it) fails the requesting test with its one
    line, cached like any fixture failure, so every later test of the stage gets the same line."""

    @functools.wraps(fixture)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return fixture(*args, **kwargs)
        except ServiceStopped as exc:
            line = exc.line
        pytest.fail(line, pytrace=False)  # outside the except: the line, without a chained traceback

    return run


@pytest.fixture(scope="session")
def harness_options(pytestconfig: pytest.Config) -> HarnessOptions:
    return pytestconfig.stash[OPTIONS_KEY]


@pytest.fixture(scope="session")
def harness_progress(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """The session's progress writer: one terminal line past pytest's output capture (every long
    phase uses it); writers on several threads take turns."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def say(msg: str) -> None:
        with _SAY_LOCK:
            if reporter is None:
                print(msg, flush=True)
                return
            with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
                reporter.write_line(msg)

    return say


@dataclass(frozen=True)
class ServiceBackend:
    kind: BackendKind
    base_url: str
    server: LocalServerProcess | None  # the embedded server when kind == "local"


@pytest.fixture(scope="session")
def service_backend(
    harness_options: HarnessOptions, tmp_path_factory: pytest.TempPathFactory, harness_progress: Callable[[str], None]
) -> Iterator[ServiceBackend]:
    if harness_options.backend == "tinker":
        yield ServiceBackend("tinker", os.environ["TINKER_BASE_URL"], None)
        return
    from dppo_harness.local_server.process import LocalServerProcess  # lazy: see the module docstring

    run_dir = tmp_path_factory.mktemp(SERVER_DIR)
    if "comparison" in harness_options.selected_stages:  # --resume loads states saved by an earlier server
        run_dir = harness_options.evidence_dir / SERVER_DIR
        run_dir.mkdir(parents=True, exist_ok=True)
    # The server's start-up progress lines are forwarded while waiting for it to be ready.
    with LocalServerProcess(run_dir=run_dir, progress=harness_progress) as server:
        yield ServiceBackend("local", server.base_url, server)


@pytest.fixture(scope="session")
def client_registry(pytestconfig: pytest.Config) -> Iterator[ClientRegistry]:
    """Every service client the harness creates; stage-scoped ones are released at stage end."""
    from dppo_harness.service.observed import ClientRegistry  # lazy: see the module docstring

    registry = ClientRegistry()
    registry.install_atexit()
    state = pytestconfig.stash[STATE_KEY]
    state.registry = registry
    registry.current_stage = state.current
    yield registry
    registry.release_remaining()  # recorded for client-releases.json
    registry.release_all()


@dataclass(frozen=True)
class Harness:
    """The session's record every stage fixture reads: options, backend, plan, evidence, client
    registry, the one wait policy, the training clients' identity recorder and the progress writer."""

    config: pytest.Config
    options: HarnessOptions
    backend: ServiceBackend
    plan: Plan
    bundle: EvidenceBundle
    registry: ClientRegistry
    waiter: ServiceWaiter
    observer: TrainingClientRecorder
    say: Callable[[str], None]

    def open_session(self, stage: str, label: str) -> tinker.ServiceClient:
        """A stage's own ServiceClient session: observed, waited and registered before its first
        call, so a stop on the way releases it with the rest (stage "session": the session's own)."""
        from dppo_harness.service.observed import make_service_client  # lazy: see the module docstring

        return make_service_client(
            self.backend.kind,
            self.backend.base_url,
            observer=self.observer,
            registry=self.registry,
            stage=stage,
            label=label,
            waiter=self.waiter,
            proxy_tokens=self.options.proxy_credentials,
            sdk_telemetry=self.options.sdk_telemetry,
        )

    @contextlib.contextmanager
    def stage_session(self, stage: str, label: str) -> Iterator[tinker.ServiceClient]:
        """open_session, released (and the release recorded) when its work ends, before any arm trains."""
        client = self.open_session(stage, label)
        try:
            yield client
        finally:
            self.registry.release_stage(stage)


@pytest.fixture(scope="session")
def harness(
    pytestconfig: pytest.Config,
    harness_options: HarnessOptions,
    harness_progress: Callable[[str], None],
    service_backend: ServiceBackend,
    client_registry: ClientRegistry,
    evidence_bundle: EvidenceBundle,
    plan: Plan,
    connectivity: ConnectivityReport,
) -> Iterator[Harness]:
    """Every client of every ServiceClient the harness makes waits under the session's one policy:
    long waits are posted to the evidence, a stop releases the clients and records why. Every
    training client's served identity is recorded, flushed in one file at the end (the file limit)."""
    from dppo_harness.service.observed import TrainingClientRecorder  # lazy: see the module docstring
    from dppo_harness.service.wait.waiter import BundlePoster, ServiceWaiter  # lazy: see the module docstring

    observer = TrainingClientRecorder(evidence_bundle, connectivity.capabilities)
    poster = BundlePoster(evidence_bundle, client_registry)
    waiter = ServiceWaiter(harness_options.wait_policy, on_post=poster.post, on_stop=poster.stop, say=harness_progress)
    server = service_backend.server
    if server is not None:  # the embedded server dying ends every wait at once, with its exit code and log

        def died(srv: LocalServerProcess) -> None:
            code, tail = srv.death_report()
            client_registry.service_gone(f"the embedded server (pid {srv.pid}) exited (exit code {code})")
            waiter.service_died(ServiceDied(f"the embedded server (pid {srv.pid})", code, tail))

        server.on_death = died
    yield Harness(
        pytestconfig,
        harness_options,
        service_backend,
        plan,
        evidence_bundle,
        client_registry,
        waiter,
        observer,
        harness_progress,
    )
    observer.flush()


@pytest.fixture(scope="session")
def service_client(harness: Harness) -> tinker.ServiceClient:
    """The session's client: the restored arms live on it across stages; released on exit."""
    return harness.open_session(
        "session", "session: the arms' training clients and evaluation samplers (open until the session ends)"
    )


@pytest.fixture(scope="session")
def plan(pytestconfig: pytest.Config, harness_options: HarnessOptions) -> Plan:
    """The plan validated at configure time (the same bytes), else loaded now."""
    return pytestconfig.stash.get(PLAN_KEY, None) or load_plan(harness_options.plan_path)


@pytest.fixture(scope="session")
def evidence_bundle(
    request: pytest.FixtureRequest,
    pytestconfig: pytest.Config,
    harness_options: HarnessOptions,
    plan: Plan,
    service_backend: ServiceBackend,
    connectivity: ConnectivityReport,
) -> EvidenceBundle:
    bundle = EvidenceBundle.create(harness_options.evidence_dir)
    # Known to the session before anything else is written, so whatever fails next, the session's
    # end closes this bundle's result.
    pytestconfig.stash[STATE_KEY].bundle = bundle
    # The embedded server names its stand-in model; a real service names it at client creation.
    served = connectivity.marker.stand_in if connectivity.marker else None
    if not served and service_backend.server:
        served = service_backend.server.stats()["served_model"]
    start_session(
        bundle,
        backend=harness_options.backend,
        plan=plan,
        stages=harness_options.selected_stages,
        project_root=project.project_root(),
        test_files=sorted({str(it.path) for it in request.session.items}),
        served_model=served,
    )
    # the connectivity report; on the embedded server (marker), the rehearsal label.
    write.write_connectivity(bundle, connectivity, harness_options.backend)
    return bundle


@pytest.fixture(scope="session")
def connectivity(request: pytest.FixtureRequest, service_backend: ServiceBackend, plan: Plan) -> ConnectivityReport:
    """The session's connectivity preflight on its backend (the launch-scope check's report, if it
    ran), before any training client; a failure fails the test with its one line."""
    from dppo_harness.service.connectivity import ConnectivityError  # lazy: see the module docstring

    try:
        return session_connectivity(request.config, service_backend.kind, service_backend.base_url, plan)
    except ConnectivityError as exc:
        line = f"connectivity preflight ({exc.check}): {exc.line}"
    pytest.fail(line, pytrace=False)  # outside the except: the one line, without a chained traceback


@pytest.fixture(scope="session")
def client_base_model(connectivity: ConnectivityReport, plan: Plan) -> str:
    """The base model the stages create training clients with (the plan's, or the preflight's
    same-family substitute)."""
    return connectivity.client_base_model(plan.base_model)


def backend_info(service_backend: ServiceBackend, plan: Plan, client: tinker.TrainingClient) -> Backend:
    """The backend with the model `client`'s get_info names (the one served-model rule); never
    the requested name when it names none."""
    served = served_name(client.get_info().model_dump(mode="json"))
    unavailable = SERVED_MODEL_UNAVAILABLE + " (get_info named no model_data.model_name)"
    return Backend(
        kind=service_backend.kind,
        requested_model=plan.base_model,
        served_model=served or unavailable,
        sdk_versions=sdk_versions(),
    )


@pytest.fixture(scope="session")
@stops_stage
def restoration(service_client: tinker.ServiceClient, harness: Harness, client_base_model: str) -> RestorationResult:
    """The restoration preflight for the initialization group of the plan's spec (a diagnostic's
    original plan), run once. Later stages reuse its shared initial checkpoint, the arms' restored
    clients (never updated here) and the fixed batch."""
    from dppo_harness.stages import restoration as restoration_module  # lazy: see the module docstring

    h, server = harness, harness.backend.server
    # Its own session, registered before its first call: a stop on the way (capacity, hang) releases it with the rest.
    with h.stage_session(
        "preflight-probes", "preflight setup and probe clients (closed when the preflight ends)"
    ) as sc:
        try:
            # Each step says so; a step that blocks long repeats itself every 10 s (progress.Watchdog).
            with Watchdog(h.say, every_s=10.0) as watch:
                result = restoration_module.run_restoration_preflight(
                    service_client,
                    h.plan,
                    h.bundle,
                    local_run_dir=server.run_dir if server else None,
                    probe_service_client=sc,
                    base_model=client_base_model,  # the served substitute
                    capacity=h.waiter.policy,  # the session's windows for refused creations
                    registry=h.registry,
                    progress=watch.say,
                )
            write.write_restoration(h.bundle, result)
            return result
        except restoration_module.RestorationError as exc:  # a response without a field the proof needs
            line = f"restoration preflight: {exc}"
        except CapacityExhausted as exc:  # the run ends with its capacity_block
            write.write_capacity_stop(h.bundle, exc.block)
            raise  # a ServiceStopped: stops_stage fails the test with its one line
    pytest.fail(line, pytrace=False)  # outside the except: the line without a chained traceback


@pytest.fixture(scope="session")
def verified_restoration(restoration: RestorationResult) -> RestorationResult:
    """The same object, but fails the requesting test unless every check passed."""
    if not restoration.passed:
        pytest.fail(restoration.failure_message(), pytrace=False)
    return restoration


@pytest.fixture(scope="session")
@stops_stage
def feasibility(
    harness: Harness, verified_restoration: RestorationResult, connectivity: ConnectivityReport
) -> FeasibilityResult:
    """The timing pilot + projection of the selected plan on this backend (runs once)."""
    from dppo_harness.stages import feasibility as feasibility_module  # lazy: see the module docstring

    h = harness
    if not feasibility_module.runs_feasibility_pilot(h.plan):
        pytest.skip("bounded diagnostic plan: feasibility is measured by the diagnostic itself (no extra pilot)")
    arm_client = next(iter(verified_restoration.clients.values()))
    # The plan is projected at its own size on every backend: the stages run it as written. Time
    # already spent in this session is the budget ledger's business (evidence.budget_allows per stage).
    eff = effective_config(h.plan, backend_info(h.backend, h.plan, arm_client))
    with (
        h.stage_session("feasibility-pilot", "feasibility timing pilot (closed when the pilot ends)") as pilot_sc,
        Watchdog(h.say, every_s=10.0) as watch,
    ):
        result = feasibility_module.run_feasibility(
            pilot_sc,
            h.plan,
            initial_checkpoint=verified_restoration.initial_checkpoint,
            backend_kind=h.backend.kind,
            effective_config=eff,
            measured_setup={"restoration_preflight": verified_restoration.wall_seconds},
            progress=watch.say,
            embedded_server=connectivity.embedded,
        )
        write.write_feasibility(h.bundle, result)
    return result


@pytest.fixture(scope="session")
@stops_stage
def gate_report(harness: Harness, restoration: RestorationResult) -> GateReport:
    """The plan's activation-gate pilot of its treatment arm, run once per session. The pilot's
    client lives in its own session, closed as soon as the pilot ends (before any arm trains)."""
    from dppo_harness.stages.gate import run_activation_gate  # lazy: see the module docstring

    h = harness
    with h.stage_session("gate-pilot", "activation-gate pilot (closed when the pilot ends)") as pilot_sc:
        report = run_activation_gate(
            pilot_sc, h.plan, h.bundle, restoration.initial_checkpoint, backend=h.backend.kind, progress=h.say
        )
        write.write_gate(h.bundle, report)
    return report


@pytest.fixture(scope="session")
@stops_stage
def comparison_run(
    request: pytest.FixtureRequest, service_client: tinker.ServiceClient, harness: Harness, client_base_model: str
) -> ComparisonResult:
    """The paired comparison (or its continuation with --resume RUN_ID), run once per session.

    A new run needs the preflight's restored arms and a passed gate; a resume reruns neither (the
    run reuses their saved evidence once it verifies by hash, see comparison_resume)."""
    from dppo_harness.stages.comparison.run import run_comparison  # lazy: see the module docstring

    h, bundle = harness, harness.bundle
    state = request.config.stash[STATE_KEY]
    unit = state.outcomes.get("unit")  # stage unit ran in this session (on this code) and passed
    if not unit or not unit["passed"] or unit["failed"] or "unit" in state.first_failure:
        pytest.fail("unit parity did not run and pass in this session: the comparison does not start", pytrace=False)
    restoration = None
    if h.options.resume is None:
        restoration = request.getfixturevalue("verified_restoration")
        gate_report = request.getfixturevalue("gate_report")
        if not gate_report.passed:
            pytest.fail(
                "activation gate failed: the comparison does not run\n  " + "\n  ".join(gate_report.failures()),
                pytrace=False,
            )
    schedule, source = comparison_schedule(
        h.options.comparison_schedule, (bundle.result.get("backend") or {}).get("kind")
    )
    # On a resume the feasibility block is not in this session's result yet: the guard then starts
    # from the finalize reserve alone and projects from the steps it measures.
    guard = wall_guard_from_feasibility(
        bundle.remaining_seconds,
        bundle.result.get("feasibility"),
        arms=len(h.plan.run.arms) if h.plan.run else 0,
        eval_items=h.plan.run.eval_items if h.plan.run else 0,
    )
    h.waiter.budget_left = bundle.remaining_seconds  # no wait in a step outlasts the budget
    try:
        run = run_comparison(
            service_client,
            h.plan,
            bundle,
            restoration,
            backend=h.backend.kind,
            state_root=h.options.evidence_dir / STATE_ROOT,
            resume_run_id=h.options.resume,
            schedule=schedule,
            schedule_source=source,
            guard=guard,
            save_every=h.options.save_every,
            registry=h.registry,
            capacity_policy=h.waiter.policy,  # the session's windows (scaled down on local)
            progress=h.say,
            base_model=client_base_model,
        )
    except ComparisonError as exc:  # a refused resume or configuration: its one line
        line = str(exc)
    else:
        write.write_comparison(bundle, run)
        # The stage's final status/verdict/outcome_reason, written at session end only if no test failed.
        state.outcome = {k: v for k, v in run.final.items() if k != "capacity_block"}
        return run
    finally:
        h.waiter.budget_left = None
    pytest.fail(line, pytrace=False)  # outside the except: the line without a chained traceback


@pytest.fixture(scope="session")
@stops_stage
def diagnostic_run(
    service_client: tinker.ServiceClient, harness: Harness, restoration: RestorationResult
) -> DiagnosticResult:
    """The requester's bounded diagnostic, run once; the wall cap counts from the SESSION start
    (the bundle's ledger clock): the 12 minutes include setup and earlier stages. It trains the
    preflight's loaded client of the trained arm (no third client)."""
    from dppo_harness.stages.diagnostic.loop import run_bounded_diagnostic  # lazy: see the module docstring

    h = harness
    run = run_bounded_diagnostic(
        service_client,
        h.plan,
        h.bundle,
        restoration.initial_checkpoint,
        backend=h.backend.kind,
        stage_start=time.monotonic() - h.bundle.elapsed_seconds(),
        spec=h.plan.original.experiment,
        progress=h.say,
        prior_service_work=restoration.preflight_service_work(),
        init_reference=restoration,
        restored=restoration.loaded.get(h.plan.diagnostic.fixed_settings.treatment.arm),
    )
    h.config.stash[STATE_KEY].outcome = dict(run.result_fields["final"])  # see comparison_run
    return run

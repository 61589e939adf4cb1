"""Session fixtures every service stage shares: options, backend (the embedded server when local),
client registry, the one wait policy, the session's ServiceClient, the plan and the evidence bundle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dppo_harness import project
from dppo_harness.evidence import EvidenceBundle
from dppo_harness.evidence.session import start_session
from dppo_harness.plans import BackendKind, Plan, load_plan
from dppo_harness.pytest_plugin.session import (
    ITEMS_KEY,
    OPTIONS_KEY,
    PLAN_KEY,
    STATE_KEY,
    HarnessOptions,
    progress_printer,
    release_remaining,
)
from dppo_harness.service.config import sdk_versions
from dppo_harness.service.wait.policy import ServiceDied, WaitPolicy
from dppo_harness.stages.session_rules import capacity_scale

if TYPE_CHECKING:
    import tinker

    from dppo_harness.local_server.process import LocalServerProcess
    from dppo_harness.service.connectivity import ConnectivityReport
    from dppo_harness.service.identity import TrainingClientRecorder
    from dppo_harness.service.release import ClientRegistry
    from dppo_harness.service.wait.waiter import ServiceWaiter


@pytest.fixture(scope="session")
def harness_options(pytestconfig: pytest.Config) -> HarnessOptions:
    return pytestconfig.stash[OPTIONS_KEY]


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
    # Only a local session starts the embedded server; its process module loads asyncio and its helpers.
    from dppo_harness.local_server.process import LocalServerProcess

    run_dir = tmp_path_factory.mktemp("local-server")
    if "comparison" in harness_options.selected_stages:  # --resume loads states saved by an earlier server
        run_dir = harness_options.evidence_dir / "local-server"
        run_dir.mkdir(parents=True, exist_ok=True)
    # The first start builds the stand-in model (minutes on 2 cores): its progress is forwarded.
    with LocalServerProcess(run_dir=run_dir, progress=harness_progress) as server:
        yield ServiceBackend("local", server.base_url, server)


@pytest.fixture(scope="session")
def client_registry(pytestconfig: pytest.Config) -> Iterator[ClientRegistry]:
    """Every service client the harness creates; stage-scoped ones are released at stage end."""
    # service.release loads the tinker SDK and torch (seconds): paid when a test first needs a client.
    from dppo_harness.service.release import ClientRegistry

    registry = ClientRegistry()
    registry.install_atexit()
    state = pytestconfig.stash[STATE_KEY]
    state.registry = registry
    registry.current_stage = state.current
    yield registry
    release_remaining(pytestconfig.stash[STATE_KEY])  # recorded for client-releases.json
    registry.release_all()


@pytest.fixture(scope="session")
def service_waiter(
    request: pytest.FixtureRequest,
    harness_options: HarnessOptions,
    service_backend: ServiceBackend,
    evidence_bundle: EvidenceBundle,
    client_registry: ClientRegistry,
) -> ServiceWaiter:
    """The session's one wait policy: every client of every ServiceClient the harness makes waits
    under it; long waits are posted to the evidence, a stop releases the clients and records why."""
    # The waiter and its evidence poster load the tinker SDK (seconds): paid when a test first needs a client.
    from dppo_harness.service.wait.evidence import bundle_waiter

    scale = capacity_scale(service_backend.kind, os.environ)
    policy = WaitPolicy.from_options(
        capacity_patience_s=harness_options.capacity_patience_s,
        capacity_patience_after_steps_s=harness_options.capacity_patience_after_steps_s,
        service_timeout_s=harness_options.service_timeout_s,
        scale=scale,
    )
    waiter = bundle_waiter(policy, evidence_bundle, client_registry, progress_printer(request.config))
    server = service_backend.server
    if server is not None:  # the embedded server dying ends every wait at once, with its exit code and log

        def died(srv: LocalServerProcess) -> None:
            code, tail = srv.death_report()
            client_registry.service_gone(f"the embedded server (pid {srv.pid}) exited (exit code {code})")
            waiter.service_died(ServiceDied(f"the embedded server (pid {srv.pid})", code, tail))

        server.on_death = died
    return waiter


@pytest.fixture(scope="session")
def service_client(stage_session_client: Callable[[str, str], tinker.ServiceClient]) -> tinker.ServiceClient:
    """The session's client: the restored arms live on it across stages; released on exit."""
    return stage_session_client(
        "session", "session: the arms' training clients and evaluation samplers (open until the session ends)"
    )


@pytest.fixture(scope="session")
def stage_session_client(
    service_backend: ServiceBackend,
    client_registry: ClientRegistry,
    training_client_observer: TrainingClientRecorder,
    service_waiter: ServiceWaiter,
    harness_options: HarnessOptions,
) -> Callable[[str, str], tinker.ServiceClient]:
    """A factory of a stage's own ServiceClient session (`stage`, `label`): observed, waited and
    registered before its first call, so a stop on the way releases it with the rest; the stage
    closes it when its work ends, before any arm trains (stage "session": the session's own)."""
    from dppo_harness.service.observed import make_service_client  # the tinker SDK (seconds), on first use

    def open_session(stage: str, label: str) -> tinker.ServiceClient:
        return make_service_client(
            service_backend.kind,
            service_backend.base_url,
            observer=training_client_observer,
            registry=client_registry,
            stage=stage,
            label=label,
            waiter=service_waiter,
            proxy_tokens=harness_options.proxy_credentials,
            sdk_telemetry=harness_options.sdk_telemetry,
        )

    return open_session


@pytest.fixture(scope="session")
def plan(pytestconfig: pytest.Config, harness_options: HarnessOptions) -> Plan:
    """The plan validated at configure time (the same bytes), else loaded now."""
    return pytestconfig.stash.get(PLAN_KEY, None) or load_plan(harness_options.plan_path)


@pytest.fixture(scope="session")
def evidence_bundle(
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
    start_session(
        bundle,
        backend=harness_options.backend,
        plan=plan,
        stages=harness_options.selected_stages,
        project_root=project.project_root(),
        test_files=sorted({str(p) for p in _stage_test_files(pytestconfig)}),
        # The embedded server names its stand-in model; a real service names it at client creation.
        served_model=(
            connectivity.marker.stand_in
            if connectivity.marker and connectivity.marker.stand_in
            else service_backend.server.stats()["served_model"]
            if service_backend.server
            else None
        ),
    )
    # the connectivity report; on the embedded server (marker), the rehearsal label.
    from dppo_harness.service.identity import record_session_identity  # httpx: paid once a stage opens a bundle

    record_session_identity(bundle, connectivity, harness_options.backend, sdk_versions())
    return bundle


def _stage_test_files(config: pytest.Config) -> list[Path]:
    return [Path(it.path) for it in config.stash.get(ITEMS_KEY, [])]

"""Session fixtures of the `preflight` stage (registered as a plugin by the harness plugin).

- `restoration`: the restoration preflight, run once per session. Later stages reuse its shared
  initial checkpoint, the arms' restored clients (never updated here) and the fixed batch.
- `verified_restoration`: the same object, but fails the requesting test unless every check passed.
- `feasibility`: the timing pilot + projection of the selected plan, run once per session.

Setup and probe clients live on their own ServiceClient session, closed (released) as soon as
the preflight ends; the feasibility pilot's client has its own session, closed when the pilot
ends; the arms' clients stay on the session's ServiceClient for later stages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from dppo_harness import plans
from dppo_harness.evidence import EvidenceBundle
from dppo_harness.evidence.backend import Backend, backend_of, served_model
from dppo_harness.evidence.progress import Watchdog
from dppo_harness.plans import Plan
from dppo_harness.pytest_plugin.fixtures_session import ServiceBackend
from dppo_harness.pytest_plugin.session import record_client_releases, stops_stage
from dppo_harness.service.config import redact_url, sdk_versions
from dppo_harness.service.wait.policy import CapacityExhausted
from dppo_harness.stages.session_rules import record_capacity_stop_before_training, runs_feasibility_pilot, trained_arms

if TYPE_CHECKING:
    import tinker

    from dppo_harness.service.connectivity import ConnectivityReport
    from dppo_harness.service.release import ClientRegistry
    from dppo_harness.service.wait.waiter import ServiceWaiter
    from dppo_harness.stages.feasibility import FeasibilityResult
    from dppo_harness.stages.restoration import RestorationResult

logger = logging.getLogger(__name__)

# The service, train and restoration modules load the tinker SDK and torch (seconds): each fixture
# imports them when a test first asks for it, so that pytest start-up and unit-only sessions never pay.


def backend_info(
    service_backend: ServiceBackend, plan: Plan, client: tinker.TrainingClient, backend_block: Backend | None = None
) -> plans.BackendInfo:
    """plans.BackendInfo from what the server reported at client creation."""
    info = client.get_info()
    served = (
        info.model_data.arch
        if service_backend.kind == "local" and info.model_data.arch
        else (info.model_data.model_name or info.model_name)
    )
    if backend_block:  # on the embedded server (marker seen) the stand-in computes
        served = served_model(info.model_data.model_dump(), backend_block).name or served
    if not served:  # both names are optional in the SDK's GetInfoResponse: never the requested name
        served = plans.SERVED_MODEL_UNAVAILABLE + " (get_info reported neither model_data.model_name nor model_name)"
    return plans.BackendInfo(
        backend=service_backend.kind,
        requested_model=plan.base_model,
        served_model=str(served),
        base_url=redact_url(service_backend.base_url),
        sdk_versions=sdk_versions(),
    )


@pytest.fixture(scope="session")
@stops_stage
def restoration(
    request: pytest.FixtureRequest,
    service_client: tinker.ServiceClient,
    service_backend: ServiceBackend,
    plan: Plan,
    evidence_bundle: EvidenceBundle,
    client_registry: ClientRegistry,
    client_base_model: str,
    service_waiter: ServiceWaiter,
    stage_session_client: Callable[[str, str], tinker.ServiceClient],
    harness_progress: Callable[[str], None],
) -> RestorationResult:
    """restoration.RestorationResult for the initialization group of the plan's spec (a
    diagnostic's original plan), run once."""
    from dppo_harness.stages import restoration as restoration_module  # the SDK and torch: see above

    # Its own session, registered before its first call: a stop on the way (capacity, hang)
    # releases it with the rest.
    probe_sc = stage_session_client(
        "preflight-probes", "preflight setup and probe clients (closed when the preflight ends)"
    )
    server = service_backend.server if service_backend.kind == "local" else None
    try:
        reader, update_norm = restoration_module.backend_update_norm(
            server.run_dir if server is not None else None, probe_sc
        )
        # Each step says so; a step that blocks long repeats itself every 10 s (progress.Watchdog).
        with Watchdog(harness_progress, every_s=10.0) as watch:
            return restoration_module.run_restoration_preflight(
                service_client,
                plan,
                evidence_bundle,
                checkpoint_reader=reader,
                update_norm=update_norm,
                probe_service_client=probe_sc,
                base_model=client_base_model,  # the served substitute
                capacity=service_waiter.policy,  # the session's windows for refused creations
                registry=client_registry,
                trained_arms=trained_arms(plan),
                progress=watch.say,
            )
    except restoration_module.RestorationError as exc:  # a response without a field the proof needs
        line = f"restoration preflight: {exc}"
    except CapacityExhausted as exc:  # the run ends with its capacity_block
        record_capacity_stop_before_training(evidence_bundle, exc.block)
        raise  # a ServiceStopped: stops_stage fails the test with its one line
    finally:
        # Release the setup/probe session before anything trains, and record it.
        record_client_releases(request.config, client_registry.release_stage("preflight-probes"))
    pytest.fail(line, pytrace=False)  # outside the except: the line without a chained traceback


@pytest.fixture(scope="session")
def verified_restoration(restoration: RestorationResult) -> RestorationResult:
    if not restoration.passed:
        pytest.fail(restoration.failure_message(), pytrace=False)
    return restoration


@pytest.fixture(scope="session")
@stops_stage
def feasibility(
    request: pytest.FixtureRequest,
    service_backend: ServiceBackend,
    plan: Plan,
    evidence_bundle: EvidenceBundle,
    verified_restoration: RestorationResult,
    client_registry: ClientRegistry,
    stage_session_client: Callable[[str, str], tinker.ServiceClient],
    harness_progress: Callable[[str], None],
    connectivity: ConnectivityReport,
) -> FeasibilityResult:
    """feasibility.FeasibilityResult of the selected plan on this backend (runs once); the pilot's
    client lives in its own session, closed when the pilot ends."""
    if not runs_feasibility_pilot(plan):
        pytest.skip("bounded diagnostic plan: feasibility is measured by the diagnostic itself (no extra pilot)")
    arm_client = next(iter(verified_restoration.clients.values()))
    # The plan is projected at its own size on every backend: the stages run it as written.
    eff = plans.effective_config(
        plan, backend_info(service_backend, plan, arm_client, backend_of(evidence_bundle.result))
    )
    # The plan's own budget is compared with the plan's projected work; time already spent in this
    # session is the budget ledger's business (evidence.budget_allows per stage).
    from dppo_harness.stages import feasibility as feasibility_module  # the SDK and torch: see above

    pilot_sc = stage_session_client("feasibility-pilot", "feasibility timing pilot (closed when the pilot ends)")
    try:
        with Watchdog(harness_progress, every_s=10.0) as watch:
            return feasibility_module.run_feasibility(
                pilot_sc,
                plan,
                evidence_bundle,
                initial_checkpoint=verified_restoration.initial_checkpoint,
                backend_kind=service_backend.kind,
                effective_config=eff,
                measured_setup={"restoration_preflight": verified_restoration.wall_seconds},
                progress=watch.say,
                embedded_server=connectivity.embedded,
            )
    finally:
        record_client_releases(request.config, client_registry.release_stage("feasibility-pilot"))

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
from typing import Any

import pytest

from dppo_harness.evidence.progress import Watchdog
from dppo_harness.pytest_plugin.session import stops_stage

logger = logging.getLogger(__name__)


def backend_info(service_backend: Any, plan: Any, client: Any, backend_block: Any = None) -> Any:
    """plans.BackendInfo from what the server reported at client creation."""
    from dppo_harness import plans
    from dppo_harness.service import clients as service
    from dppo_harness.service import identity

    info = client.get_info()
    served = info.model_data.arch if service_backend.kind == "local" and info.model_data.arch else (
        info.model_data.model_name or info.model_name)
    if backend_block:  # on the embedded server (marker seen) the stand-in computes
        served = identity.served_model(info.model_data.model_dump(), backend_block)[0] or served
    if not served:  # both names are optional in the SDK's GetInfoResponse: never the requested name
        served = plans.SERVED_MODEL_UNAVAILABLE + " (get_info reported neither model_data.model_name nor model_name)"
    return plans.BackendInfo(backend=service_backend.kind, requested_model=plan.base_model,
                             served_model=str(served), base_url=service.redact_url(service_backend.base_url),
                             sdk_versions=service.sdk_versions())


@pytest.fixture(scope="session")
@stops_stage
def restoration(request, service_client, service_backend, plan, evidence_bundle, client_registry,
                client_base_model, service_waiter, stage_session_client, harness_progress):
    """restoration.RestorationResult for the initialization group of the plan's spec (a
    diagnostic's original plan), run once."""
    from dppo_harness.service.clients import CapacityExhausted, call_with_capacity_retry
    from dppo_harness.stages import restoration as restoration_module
    from dppo_harness.stages.restoration.update_norm import LocalCheckpointReader
    from dppo_harness.train.clients import RestorationError

    reader = None
    if service_backend.kind == "local" and service_backend.server is not None:
        reader = LocalCheckpointReader(service_backend.server.run_dir)
    # Its own session, registered before its first call: a stop on the way (capacity, hang)
    # releases it with the rest.
    probe_sc = stage_session_client("preflight-probes",
                                    "preflight setup and probe clients (closed when the preflight ends)")
    policy = service_waiter.policy.capacity()  # the session's windows for refused creations
    plan_kind = plan.kind
    update_norm = None
    if reader is None:  # tinker backend: read trained weights back through the SDK (no local engine to ask)
        from dppo_harness.train.weights_readback import ExternalWeightsUpdateNorm

        update_norm = ExternalWeightsUpdateNorm(probe_sc.create_rest_client)
    failure = None
    try:
        # Each step says so; a step that blocks long repeats itself every 10 s (progress.Watchdog).
        with Watchdog(harness_progress, every_s=10.0) as watch:
            result = restoration_module.run_restoration_preflight(
                service_client, plan, evidence_bundle, checkpoint_reader=reader,
                probe_service_client=probe_sc, base_model=client_base_model,  # the served substitute
                # 429/503/capacity on client creation; scaled policy + capacity_block on give-up
                call=lambda fn: call_with_capacity_retry(fn, policy=policy, registry=client_registry),
                update_norm=update_norm,
                # Under the diagnostic plan only its treatment arm trains.
                trained_arms=(plan.diagnostic.fixed_settings.treatment.arm,) if plan_kind == "bounded_diagnostic" else None,
                progress=watch.say,
            )
    except RestorationError as exc:  # e.g. a response without a field the proof needs: one line
        failure = f"restoration preflight: {exc}"
    except CapacityExhausted as exc:  # the run ends with the brief's capacity_block
        fields = exc.block.result_fields()
        if evidence_bundle.result["original_hypothesis_tested"] is None:
            fields.update(original_hypothesis_tested=False,
                          tested_instead="nothing: the run stopped on service capacity before any training")
        evidence_bundle.update_result(**fields)
        raise  # a ServiceStopped: stops_stage fails the test with its one line
    finally:
        # Release the setup/probe session before anything trains, and record it.
        from dppo_harness.pytest_plugin.session import record_client_releases

        record_client_releases(request.config, client_registry.release_stage("preflight-probes"))
    if failure is not None:
        pytest.fail(failure, pytrace=False)  # outside the except: the line, without a chained traceback
    return result


@pytest.fixture(scope="session")
def verified_restoration(restoration):
    if not restoration.passed:
        pytest.fail(restoration.failure_message(), pytrace=False)
    return restoration


@pytest.fixture(scope="session")
@stops_stage
def feasibility(request, service_backend, plan, evidence_bundle, verified_restoration, client_registry,
                stage_session_client, harness_progress, connectivity):
    """feasibility.FeasibilityResult of the selected plan on this backend (runs once); the pilot's
    client lives in its own session, closed when the pilot ends."""
    from dppo_harness import plans
    from dppo_harness.pytest_plugin.session import record_client_releases
    from dppo_harness.stages import feasibility as feasibility_module

    if plan.kind == "bounded_diagnostic":
        # Under the diagnostic plan no extra pilot samples or trains (its budget is fixed); the
        # feasibility block comes from the diagnostic's own measured setup (diagnostic stage).
        pytest.skip("bounded diagnostic plan: feasibility is measured by the diagnostic itself (no extra pilot)")
    arm_client = next(iter(verified_restoration.clients.values()))
    # The plan is projected at its own size on every backend: the stages run it as written.
    eff = plans.effective_config(plan, backend_info(service_backend, plan, arm_client, evidence_bundle.result.get("backend")))
    # The plan's own budget is compared with the plan's projected work; time already spent in this
    # session is the budget ledger's business (evidence.budget_allows per stage).
    pilot_sc = stage_session_client("feasibility-pilot", "feasibility timing pilot (closed when the pilot ends)")
    try:
        with Watchdog(harness_progress, every_s=10.0) as watch:
            return feasibility_module.run_feasibility(
                pilot_sc, plan, evidence_bundle, initial_checkpoint=verified_restoration.initial_checkpoint,
                backend_kind=service_backend.kind, effective_config=eff,
                measured_setup={"restoration_preflight": verified_restoration.wall_seconds}, progress=watch.say,
                embedded_server=connectivity.embedded)
    finally:
        record_client_releases(request.config, client_registry.release_stage("feasibility-pilot"))

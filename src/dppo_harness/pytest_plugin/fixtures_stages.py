"""Session fixtures of the `gate`, `comparison` and `diagnostic` stages, and the session's progress
writer (registered by the harness plugin).

Thin adapters: they call `gate.run_activation_gate`, `comparison.run.run_comparison` and
`diagnostic.loop.run_bounded_diagnostic` with the session's service client, plan, evidence bundle
and the restoration preflight's shared initial checkpoint and restored arms, show progress lines on
the terminal (pytest captures ordinary output) and propose the stage's final outcome to the session.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.plans import Plan
from dppo_harness.pytest_plugin.fixtures_session import ServiceBackend
from dppo_harness.pytest_plugin.session import (
    HarnessOptions,
    progress_printer,
    propose_outcome,
    record_client_releases,
    stops_stage,
    unit_parity_passed,
)
from dppo_harness.stages.comparison.config import ComparisonError, comparison_schedule
from dppo_harness.stages.comparison.wall_guard import wall_guard_from_feasibility
from dppo_harness.stages.feasibility_projection import PilotFigures

if TYPE_CHECKING:
    import tinker

    from dppo_harness.service.release import ClientRegistry
    from dppo_harness.service.wait.waiter import ServiceWaiter
    from dppo_harness.stages.comparison.run import ComparisonResult
    from dppo_harness.stages.diagnostic.loop import DiagnosticResult
    from dppo_harness.stages.gate import GateReport
    from dppo_harness.stages.restoration import RestorationResult

# The gate, comparison and diagnostic loops load the tinker SDK and torch (seconds): each fixture imports
# its stage when a test first asks for it, so that pytest start-up and unit-only sessions never pay.


def _progress(request: pytest.FixtureRequest) -> Callable[[str], None]:
    return progress_printer(request.config)


@pytest.fixture(scope="session")
def harness_progress(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """The session's progress writer: terminal lines under pytest's capture (every long phase uses it)."""
    return _progress(request)


@pytest.fixture(scope="session")
@stops_stage
def gate_report(
    request: pytest.FixtureRequest,
    service_backend: ServiceBackend,
    plan: Plan,
    evidence_bundle: EvidenceBundle,
    restoration: RestorationResult,
    client_registry: ClientRegistry,
    stage_session_client: Callable[[str, str], tinker.ServiceClient],
) -> GateReport:
    """The plan's activation-gate pilot of its treatment arm, run once per session. The pilot's
    client lives in its own session, closed as soon as the pilot ends (before any arm trains)."""
    from dppo_harness.stages.gate import run_activation_gate  # the SDK and torch: see above

    pilot_sc = stage_session_client("gate-pilot", "activation-gate pilot (closed when the pilot ends)")
    try:
        return run_activation_gate(
            pilot_sc,
            plan,
            evidence_bundle,
            restoration.initial_checkpoint,
            backend=service_backend.kind,
            progress=_progress(request),
        )
    finally:
        record_client_releases(request.config, client_registry.release_stage("gate-pilot"))


@pytest.fixture(scope="session")
@stops_stage
def comparison_run(
    request: pytest.FixtureRequest,
    service_client: tinker.ServiceClient,
    service_backend: ServiceBackend,
    plan: Plan,
    harness_options: HarnessOptions,
    evidence_bundle: EvidenceBundle,
    client_registry: ClientRegistry,
    client_base_model: str,
    service_waiter: ServiceWaiter,
) -> ComparisonResult:
    """The paired comparison (or its continuation with --resume RUN_ID), run once per session.

    A new run needs the preflight's restored arms and a passed gate; a resume reruns neither (the
    run reuses their saved evidence once it verifies by hash, see comparison_resume)."""
    from dppo_harness.stages.comparison.run import run_comparison  # the SDK and torch: see above

    if not unit_parity_passed(request.config):
        pytest.fail("unit parity did not run and pass in this session: the comparison does not start", pytrace=False)
    restoration = None
    if harness_options.resume is None:
        restoration = request.getfixturevalue("verified_restoration")
        gate_report = request.getfixturevalue("gate_report")
        if not gate_report.passed:
            pytest.fail(
                "activation gate failed: the comparison does not run\n  " + "\n  ".join(gate_report.failures()),
                pytrace=False,
            )
    schedule, source = comparison_schedule(
        harness_options.comparison_schedule, (evidence_bundle.result.get("backend") or {}).get("kind")
    )
    # On a resume the feasibility block is not in this session's result yet: the guard then starts
    # from the finalize reserve alone and projects from the steps it measures.
    guard = wall_guard_from_feasibility(
        evidence_bundle.remaining_seconds,
        PilotFigures.from_block(evidence_bundle.result.get("feasibility")),
        arms=len(plan.run.arms) if plan.run else 0,
        eval_items=plan.run.eval_items if plan.run else 0,
    )
    service_waiter.budget_left = evidence_bundle.remaining_seconds  # no wait in a step outlasts the budget
    try:
        run = run_comparison(
            service_client,
            plan,
            evidence_bundle,
            restoration,
            backend=service_backend.kind,
            state_root=harness_options.evidence_dir / "comparison-state",
            resume_run_id=harness_options.resume,
            schedule=schedule,
            schedule_source=source,
            guard=guard,
            save_every=harness_options.save_every,
            registry=client_registry,
            capacity_policy=service_waiter.policy,  # the session's windows (scaled down on local)
            progress=_progress(request),
            base_model=client_base_model,
        )
    except ComparisonError as exc:  # a refused resume or configuration: its one line
        line = str(exc)
    else:
        propose_outcome(request.config, **{k: v for k, v in run.final.items() if k != "capacity_block"})
        if (
            run.stopped is not None
        ):  # stopped with evidence (capacity, wall clock, mismatch...): the result says why now
            evidence_bundle.update_result(**run.final)
        return run
    finally:
        service_waiter.budget_left = None
    pytest.fail(line, pytrace=False)  # outside the except: the line without a chained traceback


@pytest.fixture(scope="session")
@stops_stage
def diagnostic_run(
    request: pytest.FixtureRequest,
    service_client: tinker.ServiceClient,
    service_backend: ServiceBackend,
    plan: Plan,
    evidence_bundle: EvidenceBundle,
    restoration: RestorationResult,
) -> DiagnosticResult:
    """The requester's bounded diagnostic, run once; the wall cap counts from the SESSION start
    (the bundle's ledger clock): the 12 minutes include setup and earlier stages. It trains the
    preflight's loaded client of the trained arm (no third client)."""
    from dppo_harness.stages.diagnostic.loop import run_bounded_diagnostic  # the SDK and torch: see above

    start = time.monotonic() - evidence_bundle.elapsed_seconds()
    run = run_bounded_diagnostic(
        service_client,
        plan,
        evidence_bundle,
        restoration.initial_checkpoint,
        backend=service_backend.kind,
        stage_start=start,
        spec=plan.original.experiment,
        progress=_progress(request),
        prior_service_work=restoration.preflight_service_work(),
        init_reference=restoration,
        restored=restoration.loaded.get(plan.diagnostic.fixed_settings.treatment.arm),
    )
    propose_outcome(request.config, **run.result_fields["final"])
    return run

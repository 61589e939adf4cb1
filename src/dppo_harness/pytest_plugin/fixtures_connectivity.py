"""Session fixtures of the connectivity preflight (registered by the harness plugin).

- `connectivity`: connectivity.check_connectivity on the session's backend, once, before any
  training client; a failure fails the requesting test with its one line (later stages skip).
  When the plugin's launch-scope check (before the first test) already read it, that report.
- `client_base_model`: the base model the stages create training clients with (the plan's, or
  the preflight's same-family substitute); `ConnectivityReport.client_base_model` resolves it.
- `training_client_observer`: records every training client's served identity into evidence.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.plans import Plan
from dppo_harness.pytest_plugin.fixtures_session import ServiceBackend
from dppo_harness.pytest_plugin.session import HarnessOptions, early_connectivity

if TYPE_CHECKING:
    from dppo_harness.service.connectivity import ConnectivityReport
    from dppo_harness.service.identity import TrainingClientRecorder

# service.connectivity loads the tinker SDK and torch, service.identity httpx (seconds): each fixture
# imports them when a test first asks for it, so that pytest start-up and unit-only sessions never pay.


@pytest.fixture(scope="session")
def connectivity(
    request: pytest.FixtureRequest, service_backend: ServiceBackend, plan: Plan, harness_options: HarnessOptions
) -> ConnectivityReport:
    from dppo_harness.service.connectivity import ConnectivityError, check_connectivity  # the SDK: see above

    report = early_connectivity(request.config)  # the launch-scope check may have read it already
    if report is not None:
        return report
    try:
        return check_connectivity(
            service_backend.kind,
            service_backend.base_url,
            plan.base_model,
            proxy_tokens=harness_options.proxy_credentials,
            sdk_telemetry=harness_options.sdk_telemetry,
        )
    except ConnectivityError as exc:
        line = f"connectivity preflight ({exc.check}): {exc.line}"
    pytest.fail(line, pytrace=False)  # outside the except: the one line, without a chained traceback


@pytest.fixture(scope="session")
def client_base_model(connectivity: ConnectivityReport, plan: Plan) -> str:
    return connectivity.client_base_model(plan.base_model)


@pytest.fixture(scope="session")
def training_client_observer(evidence_bundle: EvidenceBundle) -> Iterator[TrainingClientRecorder]:
    from dppo_harness.service import identity  # httpx: see above

    recorder = identity.TrainingClientRecorder(evidence_bundle)  # reads through each client's own SDK holder
    yield recorder
    recorder.flush()  # every client's get_info, in one file (keeps the bundle under its file limit)

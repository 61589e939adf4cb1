"""The restoration preflight as a harness session runs it: the update-norm measure its backend
allows (the embedded server's checkpoints on disk, else trained weights read back through the SDK),
client creations retried under the session's capacity windows, and a refused proof as one line."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import tinker

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.plans import Plan
from dppo_harness.service.capacity import call_with_capacity_retry
from dppo_harness.service.release import ClientRegistry
from dppo_harness.service.wait.policy import CapacityPolicy
from dppo_harness.stages.restoration.preflight import run_restoration_preflight
from dppo_harness.stages.restoration.records import RestorationResult
from dppo_harness.stages.restoration.update_norm import LocalCheckpointReader
from dppo_harness.train.clients import RestorationError
from dppo_harness.train.weights_readback import ExternalWeightsUpdateNorm


def run_for_session(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    *,
    probe_service_client: tinker.ServiceClient,
    local_run_dir: Path | None,
    base_model: str,
    capacity: CapacityPolicy,
    registry: ClientRegistry,
    trained_arms: Sequence[str] | None,
    progress: Callable[[str], None],
) -> RestorationResult | str:
    """The preflight's result, or the one line of a response it could not use (a field the proof
    needs, missing). `local_run_dir`: the embedded server's run directory, where its checkpoints are
    read; None on a real service, where weights are read back through `probe_service_client`."""
    reader = LocalCheckpointReader(local_run_dir) if local_run_dir is not None else None
    update_norm = None if reader is not None else ExternalWeightsUpdateNorm(probe_service_client.create_rest_client)
    try:
        return run_restoration_preflight(
            service_client,
            plan,
            bundle,
            checkpoint_reader=reader,
            probe_service_client=probe_service_client,
            base_model=base_model,  # the served substitute
            # 429/503/capacity on client creation; scaled policy + capacity_block on give-up
            call=lambda fn: call_with_capacity_retry(fn, policy=capacity, registry=registry),
            update_norm=update_norm,
            trained_arms=trained_arms,
            progress=progress,
        )
    except RestorationError as exc:
        return f"restoration preflight: {exc}"

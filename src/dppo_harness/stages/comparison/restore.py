"""An arm's training client from its saved state (weights + optimizer), restored through
`train.restore.restore` (the load observed) and counted: every restore is one more `restore_count`
and one more optimizer check on top of the preflight's, and a check that finds the server's
optimizer differs from the request stops the run. `open_arms` gives the run its clients: the preflight's on a new run, restored on a resume."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from dppo_harness.json_types import JsonObject
from dppo_harness.stages.comparison.config import ComparisonError, OptimizerMismatch
from dppo_harness.stages.comparison.state import RunState, state_file_name
from dppo_harness.train.clients import dump_response, server_info
from dppo_harness.train.optimizer_checks import optimizer_check
from dppo_harness.train.restore import restore

if TYPE_CHECKING:
    import tinker

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import RunConfig
    from dppo_harness.stages.restoration import RestorationResult

# A restored arm: its new training client and its provenance entry.
Restored = tuple["tinker.TrainingClient", JsonObject]


def restore_arm(
    service_client: tinker.ServiceClient, state: RunState, run: RunConfig, name: str, path: str, state_file: str
) -> tuple[tinker.TrainingClient, JsonObject]:
    """A new training client for arm `name` from its saved state `path`, weights + optimizer, the
    load observed; one more restore_count and optimizer check, whose get_info is kept in the run
    state registered as `state_file`. Returns (client, provenance entry). A check that finds the
    server's optimizer differs from the request stops the run (OptimizerMismatch, after the check
    is recorded in the state)."""
    arm = state.arms[name]
    restored = restore(service_client, path, name)
    mismatch = restored.mismatch()
    if mismatch is not None:
        raise ComparisonError(f"{name}: {mismatch}")
    client, loaded = restored.client, restored.loaded_path
    arm.restore_count += 1
    prior = state.setup_provenance.get(name)
    if prior is None:
        raise ComparisonError(f"{name}: the run state holds no preflight provenance to count restores on")
    check = optimizer_check(
        after_restore=prior["restore_count"] + arm.restore_count,
        requested_optimizer="adam",
        requested_config=run.arm(name).adam_config_requested(),
        # raw: tinker 0.25's parsed get_info (`restored.info`) drops the server's optimizer_config
        info=server_info(service_client, client),
        info_ref=f"{state_file}#{name}.restore{arm.restore_count}",
        echoed=None,
        echo_ref=None,
        echo_observed_on=None,
    )
    arm.optimizer_checks.append(
        {
            **check,
            "loaded_checkpoint_uri": loaded,
            "at_step": arm.steps_done,
            "load_response": dump_response(restored.response),
        }
    )
    prov: JsonObject = {
        "restore_count": prior["restore_count"] + arm.restore_count,
        # The checkpoint this session's arm actually loaded (the server's own load response).
        "loaded_checkpoint_uri": loaded,
        "loaded_at_step": arm.steps_done,
        "optimizer_checks": list(prior["optimizer_checks"])
        + [{k: v for k, v in c.items() if k != "load_response"} for c in arm.optimizer_checks],
    }
    if check["mismatches"]:  # a restored optimizer that differs from the request stops the run
        raise OptimizerMismatch(
            f"{name}: optimizer mismatch after restore {check['after_restore']} "
            f"({path}): " + "; ".join(check["mismatches"]),
            name,
            prov,
            state_file,
        )
    return client, prov


def open_arms(
    service_client: tinker.ServiceClient,
    state: RunState,
    run: RunConfig,
    restoration: RestorationResult | None,
    bundle: EvidenceBundle,
    call: Callable[[Callable[[], Restored]], Restored],
) -> dict[str, tinker.TrainingClient]:
    """New run: the arms' clients the preflight loaded from the shared initial checkpoint (its
    observed load). Resume: each arm from the state every arm saved last (step 0: the shared
    initial checkpoint), with optimizer; each restore is one more restore_count and optimizer
    check, and the run state holding their get_info is registered before the result names it."""
    if not state.resumed:
        assert restoration is not None
        return {a.name: restoration.clients[a.name] for a in run.arms}
    clients: dict[str, tinker.TrainingClient] = {}
    prov_arms: JsonObject = {}
    ref = state_file_name(state, "open")
    for a in run.arms:
        path = state.arms[a.name].state_path or state.initial_checkpoint
        clients[a.name], prov_arms[a.name] = call(partial(restore_arm, service_client, state, run, a.name, path, ref))
    bundle.register_json(ref, "manifest", state.to_json())
    bundle.update_result(initialization_provenance={"arms": prov_arms})
    return clients

"""Restoration preflight, the six steps in order: one shared immutable initial state for both arms, proved.

Flow (`run_restoration_preflight`):
1. One fresh LoRA client (plan rank + seed) saves its state as the initial checkpoint; a second
   save under the same name must be refused explicitly for the checkpoint to count as immutable.
2. Each trained arm's client is created from that checkpoint with optimizer state; the load
   response's path is the proof of what was loaded.
3. Full per-token logprobs on a fixed tokenized GSM8K batch, on the arms (one arm: against the
   setup client), before any update: bitwise equal or within `LOGPROB_ATOL`.
4. Probe: the setup client (nothing applied since it saved) is the uninterrupted client; a
   create-save-restore client applies the same fixed-gradient update and must agree. The arms'
   clients are never updated here.
5. Optimizer checks at creation and at every restore, from what server responses expose.
6. LR-scaling probe: a fresh state per learning rate (the setup client's update 1 at the planned
   LR, one client from the initial checkpoint per other LR), the same fixed gradient, norm / LR.

Every check records measured numbers and can fail; `RestorationResult.failures` says which did.
The group, the fixed batch, the checkpoints, the probes, the update-norm measures, the checks on the
loaded arms, the provenance checks, the evidence files and the records live in the modules beside
this one; this module runs the steps in order.

Options of `run_restoration_preflight`:

- `trained_arms`: the arms that will train in this session (None: all). Only they get a client
  (loaded from the initial checkpoint) and an `initialization_provenance` entry; an untrained arm
  is never created and is left out of the optimizer-restoration groups: an arm that never trains
  has no restore to check (it is listed under `excluded_arms` with the reason). A single trained arm's initial output is compared with
  the setup client's, taken before that client's first update.
- `checkpoint_reader` (local backend): measures adapter_sha256 of each arm as loaded and the
  LR-scaling update norms from server-written checkpoints. Without it (and without
  `update_norm`) the LR probe is recorded unavailable with the reason.
- `probe_service_client`: where the setup (fresh) client and the probe clients live, so the
  caller can release them (close that ServiceClient) before the arms train; the arms live on
  `service_client`. Defaults to `service_client`.
- `arm_seed_overrides`: give an arm its own fresh client with another seed (a deliberately
  mismatched initial state, for failure-path tests).
- `probe_restore_with_optimizer=False`: the probe restores weights only (failure-path tests:
  the restored-vs-uninterrupted check must then fail).
- `capacity`, `registry`: every client-creating call is retried on a capacity refusal within the
  policy's windows (`service.capacity.call_with_capacity_retry`); without a policy, called once.
- `progress`: one line at every step (which of the six, how far along), so the preflight is never silent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import tinker

from dppo_harness import constants
from dppo_harness.json_types import JsonObject
from dppo_harness.service.capacity import call_with_capacity_retry
from dppo_harness.service.observed import create_from_state_with_response, describe_client
from dppo_harness.stages.restoration.arm_checks import (
    AdapterHashes,
    InitialOutputs,
    adapter_hashes,
    initial_outputs,
    provenance_entries,
)
from dppo_harness.stages.restoration.batch import build_fixed_batch, register_fixed_batch
from dppo_harness.stages.restoration.checkpoint import (
    InitialCheckpoint,
    Recorder,
    fresh_checkpoint,
    load_arm,
)
from dppo_harness.stages.restoration.group import RestorationGroup, resolve_group
from dppo_harness.stages.restoration.lr_probe import DEFAULT_LR_MULTIPLIERS, LR_SCALING_RTOL, lr_scaling_probe
from dppo_harness.stages.restoration.outcome import group_provenance, posted_provenance, record_evidence
from dppo_harness.stages.restoration.probe import CallWrapper, PrefixedResponses, restore_probe
from dppo_harness.stages.restoration.provenance import ArmProvenance, check_provenance
from dppo_harness.stages.restoration.records import (
    LrScalingBlock,
    LrScalingMeasured,
    RestorationResult,
    RestoreProbeResult,
)
from dppo_harness.stages.restoration.update_norm import (
    CheckpointUpdateNorm,
    LocalCheckpointReader,
    UpdateNormMeasure,
    planned_lr_on_setup_client,
)
from dppo_harness.train.clients import RestorationError, full_logprobs
from dppo_harness.train.fingerprints import LOGPROB_ATOL
from dppo_harness.train.restore import Restore
from dppo_harness.train.weights_readback import ExternalWeightsUpdateNorm

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import Plan
    from dppo_harness.service.release import ClientRegistry
    from dppo_harness.service.wait.policy import CapacityPolicy

T = TypeVar("T")


@dataclass(frozen=True)
class _Session:
    """What every step of one preflight run shares: where the setup and probe clients live, the
    group, the fixed batch, the kept responses and how client-creating calls are made."""

    probe_sc: tinker.ServiceClient
    group: RestorationGroup
    fixed_batch: list[tinker.Datum]
    batch_sha256: str
    rec: Recorder
    atol: float
    call: CallWrapper
    restore_with_optimizer: bool  # False only in failure-path tests: the probes restore weights only
    say: Callable[[str], None]


@dataclass(frozen=True)
class _InitialStates:
    """Step 1's outcome: the initial checkpoint per seed and which one each arm loads."""

    by_seed: dict[int, InitialCheckpoint]
    sources: dict[str, InitialCheckpoint]
    source_label: dict[str, str]
    shared: InitialCheckpoint  # the plan seed's checkpoint: the initial checkpoint of the run
    source_logprobs: list[np.ndarray] | None  # the setup client's output a single arm is compared with


@dataclass(frozen=True)
class _ProbeStep:
    """Step 4's outcome, and what step 6 needs of it."""

    result: RestoreProbeResult
    opt_cfg: dict[str, float]
    update_norm: UpdateNormMeasure | None
    lr_in_plan: bool  # the planned LR was measured on the setup client by the probe's update 1


def _progress_line(progress: Callable[[str], None] | None, t0: float) -> Callable[[str], None]:
    def say(msg: str) -> None:
        if progress is not None:
            progress(f"[preflight] restoration {msg} ({time.monotonic() - t0:.0f}s)")

    return say


def _call_directly(fn: Callable[[], T]) -> T:
    return fn()


def backend_update_norm(
    local_run_dir: Path | None, probe_service_client: tinker.ServiceClient
) -> tuple[LocalCheckpointReader | None, UpdateNormMeasure | None]:
    """(checkpoint reader, update-norm measure) a backend allows: the embedded server's checkpoints
    on disk under `local_run_dir`, else the trained weights read back through the SDK."""
    if local_run_dir is not None:
        return LocalCheckpointReader(local_run_dir), None
    return None, ExternalWeightsUpdateNorm(probe_service_client.create_rest_client)


def _prepare_fixed_batch(
    bundle: EvidenceBundle,
    fixed_batch: Sequence[tinker.Datum] | None,
    description: JsonObject | None,
    group: RestorationGroup,
) -> tuple[list[tinker.Datum], str]:
    """The given fixed batch (else the plan dataset's), registered as evidence, and its sha256."""
    if fixed_batch is None:
        fixed_batch, description = build_fixed_batch(seed=group.seed, dataset_name=group.dataset)
    fixed_batch = list(fixed_batch)
    if len(fixed_batch) < 2:
        raise RestorationError("fixed batch needs at least 2 datums (two distinct fixed gradients)")
    return fixed_batch, register_fixed_batch(bundle, fixed_batch, description)


def _initial_states(
    run: _Session, bundle: EvidenceBundle, base_model: str, arm_seed_overrides: Mapping[str, int] | None
) -> _InitialStates:
    """Step 1: fresh LoRA client(s) and the immutable initial checkpoint(s)."""
    group = run.group
    seed = group.seed
    arm_seed = {a: (arm_seed_overrides or {}).get(a, seed) for a in group.arm_names}
    fresh = partial(fresh_checkpoint, run.probe_sc, base_model, group.rank)
    by_seed = {seed: fresh("shared", seed, group.tag, run.rec, run.call)}
    for a, s in arm_seed.items():
        if s not in by_seed:
            by_seed[s] = fresh(a, s, group.tag, run.rec, run.call)
    bundle.add_checkpoint("initial", 0, by_seed[seed].path)
    # The setup client's own output, before its first update: what one loaded arm is compared with.
    source_lp = full_logprobs(by_seed[seed].client, run.fixed_batch) if len(group.arm_names) == 1 else None
    return _InitialStates(
        by_seed,
        {a: by_seed[arm_seed[a]] for a in group.arm_names},
        {a: "shared" if arm_seed[a] == seed else a for a in group.arm_names},
        by_seed[seed],
        source_lp if arm_seed[group.arm_names[0]] == seed else None,
    )


def _load_arms(
    service_client: tinker.ServiceClient, run: _Session, sources: Mapping[str, InitialCheckpoint]
) -> dict[str, Restore]:
    """Step 2: every trained arm from its checkpoint with optimizer; the load responses kept."""
    arm_names = run.group.arm_names
    loaded = {}
    for i, a in enumerate(arm_names, start=1):
        run.say(f"2/6: loading arm {a} ({i}/{len(arm_names)}) from {sources[a].path} with optimizer")
        loaded[a] = load_arm(service_client, a, sources[a].path, run.rec, run.call)
    return loaded


def _probe_step(
    run: _Session,
    init: _InitialStates,
    checkpoint_reader: LocalCheckpointReader | None,
    update_norm: UpdateNormMeasure | None,
    lr_multipliers: Sequence[float],
) -> _ProbeStep:
    """Step 4: the setup client (uninterrupted) vs a create-save-restore client, same two
    fixed-gradient updates; update 1 is also the LR-scaling probe at the planned LR."""
    group = run.group
    opt_cfg = group.optimizer_config(group.arm_names[0])  # the first trained arm's; others: _other_config_probes
    if update_norm is None and checkpoint_reader is not None:
        update_norm = CheckpointUpdateNorm(checkpoint_reader, f"{group.tag}-lr")
    lr_in_plan = planned_lr_on_setup_client(update_norm, lr_multipliers)
    run.say("4/6: create-save-restore probe (uninterrupted setup client vs restored client, 2 fixed-gradient updates)")
    probe = restore_probe(
        run.probe_sc,
        init.shared.client,
        init.shared.path,
        run.fixed_batch,
        opt_cfg,
        group.tag,
        run.rec,
        run.atol,
        run.call,
        restore_optimizer=run.restore_with_optimizer,
        update_norm=update_norm if lr_in_plan else None,
        say=run.say,
    )
    return _ProbeStep(probe, opt_cfg, update_norm, lr_in_plan)


def _other_config_probes(run: _Session, init: _InitialStates, probe: _ProbeStep) -> dict[str, RestoreProbeResult]:
    """Step 4 again for each trained arm whose optimizer config differs from every one probed so
    far: a fresh client from the initial checkpoint stands in for the uninterrupted setup client,
    so each arm's optimizer checks compare with the echo of its OWN config. The probe result of
    every trained arm, by arm; the other configs' probes are also the step-4 probe's
    `own_config_probes`."""
    group, probe_sc = run.group, run.probe_sc
    results = {a: probe.result for a in group.arm_names if group.optimizer_config(a) == probe.opt_cfg}
    for a in group.arm_names:
        cfg = group.optimizer_config(a)
        same = next((b for b in results if group.optimizer_config(b) == cfg), None)
        if same is not None:
            results[a] = results[same]
            continue
        run.say(f"4/6: create-save-restore probe again for arm {a} (its own optimizer config)")
        fresh, _ = run.call(partial(create_from_state_with_response, probe_sc, init.shared.path, f"probe-{a}"))
        describe_client(probe_sc, fresh, f"restore probe of arm {a}'s config: fresh from the initial checkpoint")
        results[a] = restore_probe(
            probe_sc,
            fresh,
            init.shared.path,
            run.fixed_batch,
            cfg,
            f"{group.tag}-{a}",
            PrefixedResponses(run.rec, f"{a}:"),
            run.atol,
            run.call,
            restore_optimizer=run.restore_with_optimizer,
            say=run.say,
        )
        results[a].echo_observed_on = results[a].uninterrupted_client = (
            f"a fresh client from the initial checkpoint, nothing applied before update 1 (arm {a}'s config)"
        )
    others = {a: r for a, r in results.items() if r is not probe.result}
    if others:
        probe.result.own_config_probes = others  # written with the step-4 probe (PROBE_FILE)
    return results


def _all_probe_failures(probe: RestoreProbeResult) -> list[str]:
    """The step-4 probe's failures, then each other config's probe's, prefixed with its arm."""
    others = probe.own_config_probes
    return [*probe.failures, *(f"{a}: {m}" for a, r in others.items() for m in r.failures)]


def _provenance_step(
    run: _Session,
    init: _InitialStates,
    base_model: str,
    loaded: Mapping[str, Restore],
    probes: Mapping[str, RestoreProbeResult],
    outputs: InitialOutputs,
    adapters: AdapterHashes,
) -> dict[str, ArmProvenance]:
    """Step 5: each trained arm's initialization entry, its optimizer checks against its own
    config's probe."""
    run.say("5/6: optimizer checks and initialization provenance")
    return provenance_entries(
        run.group.arms,
        base_model,
        init.sources,
        init.source_label,
        loaded,
        probes,
        run.batch_sha256,
        outputs.output_sha256,
        adapters.by_arm,
    )


def _lr_scaling_step(
    run: _Session,
    initial_checkpoint: str,
    probe: _ProbeStep,
    lr_multipliers: Sequence[float],
    lr_rtol: float,
    unavailable_reason: str,
) -> LrScalingBlock:
    """Step 6: the LR-scaling probe (the planned LR was measured on the setup client in step 4)."""
    in_plan = probe.lr_in_plan and probe.update_norm
    run.say(
        f"6/6: LR-scaling probe ({len(lr_multipliers)} learning rates, a fresh state each"
        + ("; the planned one is the probe's update 1 on the setup client)" if in_plan else ")")
    )
    base_lr = float(probe.opt_cfg["learning_rate"])
    return lr_scaling_probe(
        run.probe_sc,
        initial_checkpoint,
        run.fixed_batch,
        probe.opt_cfg,
        lr_multipliers,
        lr_rtol,
        probe.update_norm,
        unavailable_reason,
        run.call,
        measured={base_lr: probe.result.base_lr_update_norm} if in_plan else None,
        say=run.say,
    )


def _lr_failures(lr_block: LrScalingBlock) -> list[str]:
    return (
        [f"LR scaling: {lr_block.problem}"] if isinstance(lr_block, LrScalingMeasured) and not lr_block.passed else []
    )


def run_restoration_preflight(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    *,
    base_model: str = constants.BASE_MODEL,
    fixed_batch: Sequence[tinker.Datum] | None = None,
    fixed_batch_description: JsonObject | None = None,
    atol: float = LOGPROB_ATOL,
    lr_multipliers: Sequence[float] = DEFAULT_LR_MULTIPLIERS,
    lr_rtol: float = LR_SCALING_RTOL,
    checkpoint_reader: LocalCheckpointReader | None = None,
    update_norm: UpdateNormMeasure | None = None,
    update_norm_unavailable_reason: str = (
        "the Tinker API exposes neither parameters nor an update-norm metric (optim_step reports "
        "the gradient norm only), so update norms cannot be measured on this backend"
    ),
    probe_service_client: tinker.ServiceClient | None = None,
    arm_seed_overrides: Mapping[str, int] | None = None,
    probe_restore_with_optimizer: bool = True,
    capacity: CapacityPolicy | None = None,
    registry: ClientRegistry | None = None,
    run_tag: str | None = None,
    trained_arms: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> RestorationResult:
    """Run the restoration preflight for the initialization group of the plan's spec (a
    diagnostic's: its original plan's); the six steps and every option are in the module docstring."""
    t0 = time.monotonic()
    say = _progress_line(progress, t0)
    group = resolve_group(plan, bundle, trained_arms, run_tag)
    batch, b_sha = _prepare_fixed_batch(bundle, fixed_batch, fixed_batch_description, group)
    probe_sc = probe_service_client or service_client
    call: CallWrapper = (
        _call_directly
        if capacity is None
        else (lambda fn: call_with_capacity_retry(fn, policy=capacity, registry=registry))
    )
    run = _Session(probe_sc, group, batch, b_sha, Recorder(), atol, call, probe_restore_with_optimizer, say)
    say(f"1/6: fresh LoRA rank-{group.rank} client on {base_model} and the shared initial checkpoint")
    init = _initial_states(run, bundle, base_model, arm_seed_overrides)
    loaded = _load_arms(service_client, run, init.sources)
    source_paths = {a: init.sources[a].path for a in group.arm_names}
    adapters = adapter_hashes(checkpoint_reader, loaded, source_paths, group.tag, run.rec)
    say(f"3/6: initial logprobs of {len(group.arm_names)} arms on the fixed batch ({len(batch)} datums)")
    outputs = initial_outputs(bundle, loaded, batch, b_sha, atol, source=init.source_logprobs)
    probe = _probe_step(run, init, checkpoint_reader, update_norm, lr_multipliers)
    probes = _other_config_probes(run, init, probe)
    failures = [*adapters.failures, *outputs.failures, *_all_probe_failures(probe.result)]
    arms = _provenance_step(run, init, base_model, loaded, probes, outputs, adapters)
    failures.extend(check_provenance({"version": 1, "arms": arms}, group.arm_names))
    lr_block = _lr_scaling_step(run, init.shared.path, probe, lr_multipliers, lr_rtol, update_norm_unavailable_reason)
    failures.extend(_lr_failures(lr_block))
    excluded = group.excluded_arms()
    provenance = group_provenance(
        arms,
        excluded,
        trained=group.arm_names,
        initial_checkpoint=init.shared.path,
        initial_output_comparison=outputs.comparison,
        adapter_sha256_method=adapters.method,
        failures=failures,
    )
    say(f"{'passed' if not failures else 'FAILED'}" + (f": {len(failures)} problem(s)" if failures else ""))
    posted = posted_provenance(arms, excluded, trained_arms)
    wall = record_evidence(bundle, run.rec, probe.result, lr_block, provenance, posted, t0)
    return RestorationResult(
        initial_checkpoint=init.shared.path,
        loaded_paths={a: arm.loaded_path for a, arm in loaded.items() if arm.loaded_path},
        clients={a: arm.client for a, arm in loaded.items()},
        loaded=dict(loaded),
        fixed_batch=batch,
        batch_sha256=b_sha,
        output_sha256=outputs.output_sha256,
        provenance=provenance,
        passed=not failures,
        failures=failures,
        lr_scaling=lr_block,
        probe=probe.result,
        wall_seconds=wall,
    )

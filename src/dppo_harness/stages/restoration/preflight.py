"""Restoration preflight: one shared immutable initial state for both arms, proved, not assumed.

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
The fixed batch, the checkpoints, the probes, the update-norm measures, the provenance checks and
the records live in the modules beside this one; this module runs the steps and records the evidence.

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
- `call`: wraps every client-creating call (e.g. `service.capacity.call_with_capacity_retry`).
- `progress`: one line at every step (which of the six, how far along), so the preflight is never silent.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import tinker

from dppo_harness import constants
from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.service.observed import describe_client
from dppo_harness.stages.restoration.batch import build_fixed_batch, register_fixed_batch
from dppo_harness.stages.restoration.checkpoint import (
    RESPONSES_FILE,
    InitialCheckpoint,
    LoadedArm,
    Recorder,
    fresh_checkpoint,
    load_arm,
)
from dppo_harness.stages.restoration.lr_probe import (
    DEFAULT_LR_MULTIPLIERS,
    LR_SCALING_FILE,
    LR_SCALING_RTOL,
    lr_scaling_probe,
)
from dppo_harness.stages.restoration.probe import CallWrapper, PrefixedResponses, restore_probe
from dppo_harness.stages.restoration.provenance import (
    ArmProvenance,
    InitializationProvenance,
    check_provenance,
    initialization_entry,
)
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
from dppo_harness.train.clients import RestorationError, create_from_state_observed, full_logprobs
from dppo_harness.train.fingerprints import LOGPROB_ATOL, compare_logprobs, logprobs_sha256
from dppo_harness.train.optimizer_checks import optimizer_check, own_response_only

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ExperimentSpec, Plan
    from dppo_harness.plans.models import RestorationArm

T = TypeVar("T")

PROVENANCE_FILE = "initialization-provenance.json"
INITIAL_OUTPUT_FILE = "restoration-initial-logprobs.json"
PROBE_FILE = "restoration-probe.json"


def restoration_arms(spec: ExperimentSpec) -> list[RestorationArm]:
    """The (single) initialization group's arms with optimizer and config, from the validated spec."""
    rp = spec.restoration_preflight
    if not rp.applicable:
        raise RestorationError("plan has no applicable restoration_preflight")
    if len(rp.groups) != 1:
        raise RestorationError(f"restoration_preflight needs exactly one group, got {len(rp.groups)}")
    arms = rp.groups[0].arms
    if len(arms) < 2:
        raise RestorationError("restoration_preflight group needs at least two arms")
    return list(arms)


def _adapter_hashes(
    reader: LocalCheckpointReader | None,
    arms: Mapping[str, LoadedArm],
    source_of: Mapping[str, str],
    tag: str,
    rec: Recorder,
) -> tuple[dict[str, str | None], str, list[str]]:
    """Adapter hashes as loaded (local backend: read back from a save of each arm; not an update)."""
    hashes: dict[str, str | None] = dict.fromkeys(arms)
    if reader is None:
        return hashes, "not measurable over the Tinker API on this backend", []
    note = (
        "local_hash: sha256 of the LoRA tensors in a save_state of each arm taken right "
        "after its load, read from the embedded server's run_dir"
    )
    failures = []
    for a, arm in arms.items():
        snap = arm.client.save_state(f"{tag}-{a}-as-loaded").result()
        rec.keep(f"save_{a}_as_loaded", snap)
        hashes[a] = as_loaded = reader.adapter_sha256(snap.path)
        src_sha = reader.adapter_sha256(source_of[a])
        if as_loaded != src_sha:
            failures.append(f"{a}: adapter as loaded ({as_loaded[:12]}) differs from its checkpoint's ({src_sha[:12]})")
    return hashes, note, failures


SOURCE_OUTPUT_KEY = "initial_checkpoint_source"


def _initial_outputs(
    bundle: EvidenceBundle,
    arms: Mapping[str, LoadedArm],
    fixed_batch: Sequence[tinker.Datum],
    b_sha: str,
    atol: float,
    source: Sequence[np.ndarray] | None = None,
) -> tuple[dict[str, str], JsonObject, list[str]]:
    """Step 3: full logprobs of every arm on the fixed batch before any update, compared. With a
    single arm, `source` (the setup client's logprobs, taken before its first update) is what it
    is compared with, so the check can still fail."""
    names = list(arms)
    logprobs = {a: full_logprobs(arms[a].client, fixed_batch) for a in names}
    out_sha = {a: logprobs_sha256(lp) for a, lp in logprobs.items()}
    pairs: list[tuple[str, str, Sequence[np.ndarray]]] = [(names[0], other, logprobs[other]) for other in names[1:]]
    if len(names) == 1 and source is not None:
        pairs = [(names[0], SOURCE_OUTPUT_KEY, source)]
    cmp: JsonObject = {}
    failures: list[str] = []
    for first, other, lp in pairs:
        c = compare_logprobs(logprobs[first], lp, atol)
        cmp[f"{first}_vs_{other}"] = as_object(c)
        if not c["within_tolerance"]:
            failures.append(
                f"initial logprobs differ between {first} and {other}: max |diff| "
                f"{c['max_abs_diff']} > {atol}" + (f" ({c['problem']})" if "problem" in c else "")
            )
    stored = dict(logprobs)
    if len(names) == 1 and source is not None:
        stored[SOURCE_OUTPUT_KEY] = list(source)
    bundle.register_json(
        INITIAL_OUTPUT_FILE,
        "tensors",
        {
            "batch_sha256": b_sha,
            "dtype": {a: str(lp[0].dtype) for a, lp in stored.items()},
            "output_sha256": out_sha,
            "comparison": cmp,
            "hash": "sha256 over every datum's per-token logprobs at the returned precision; see "
            "restoration.logprobs_sha256",
            "logprobs": {a: [x.tolist() for x in lp] for a, lp in stored.items()},
        },
    )
    return out_sha, cmp, failures


def _provenance_entries(
    arms_cfg: Sequence[RestorationArm],
    base_model: str,
    sources: Mapping[str, InitialCheckpoint],
    source_label: Mapping[str, str],
    loaded: Mapping[str, LoadedArm],
    probes: Mapping[str, RestoreProbeResult],
    b_sha: str,
    out_sha: Mapping[str, str],
    adapter_sha: Mapping[str, str | None],
) -> dict[str, ArmProvenance]:
    """Step 5: each arm's initialization entry with optimizer checks at creation (0) and restore (1),
    against the echo of the probe that ran the arm's own optimizer config."""
    entries: dict[str, ArmProvenance] = {}
    for arm in arms_cfg:
        a = arm.name
        if a not in loaded:
            continue
        probe = probes[a]
        echo = probe.echoed_config or None
        check = partial(
            optimizer_check,
            requested_optimizer=arm.optimizer,
            requested_config=arm.optimizer_config.model_dump(exclude_none=True),
            echoed=echo,
            echo_ref=probe.echo_ref,
            echo_observed_on=probe.echo_observed_on,
        )
        checks = [
            check(
                after_restore=0, info=sources[a].info, info_ref=f"{RESPONSES_FILE}#create_{source_label[a]}.get_info"
            ),
            check(after_restore=1, info=loaded[a].info, info_ref=f"{RESPONSES_FILE}#load_{a}.get_info"),
        ]
        entries[a] = initialization_entry(
            base_checkpoint=base_model,
            checkpoint_uri=sources[a].path,
            checkpoint_immutable=sources[a].immutable,
            checkpoint_immutable_reason=sources[a].immutable_reason or None,
            loaded_checkpoint_uri=loaded[a].loaded_path,
            load_succeeded=loaded[a].load_succeeded,
            evidence_ref=loaded[a].load_ref,
            restore_count=1,
            optimizer_checks=checks,
            initial_output={
                "available": True,
                "batch_sha256": b_sha,
                "output_sha256": out_sha[a],
                "evidence_ref": INITIAL_OUTPUT_FILE,
                "before_first_update": True,
            },
            adapter_sha256=adapter_sha[a],
        )
    return entries


@dataclass(frozen=True)
class _Group:
    """The initialization group as this session runs it: the arms, which of them train, one seed."""

    arms: list[RestorationArm]  # every arm of the group with optimizer and config, from the spec
    all_arm_names: list[str]
    arm_names: list[str]  # the trained arms, in the group's order
    rank: int
    seed: int
    tag: str  # names the checkpoints this run saves
    dataset: str


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


def _resolve_group(
    plan: Plan, bundle: EvidenceBundle, trained_arms: Sequence[str] | None, run_tag: str | None
) -> _Group:
    """The group's arms, the trained ones among them, their one seed, and the run's checkpoint tag."""
    spec_plan = plan.spec_plan
    run = spec_plan.run
    assert run is not None  # every experiment spec has its RunConfig from load
    arms = restoration_arms(spec_plan.experiment)
    all_arm_names = [a.name for a in arms]
    if trained_arms is not None:
        unknown = sorted(set(trained_arms) - set(all_arm_names))
        if unknown or not trained_arms:
            raise RestorationError(
                f"trained_arms {list(trained_arms)}: not arms of the initialization group {all_arm_names}"
            )
    arm_names = [a for a in all_arm_names if trained_arms is None or a in set(trained_arms)]
    seeds = {a.name: a.seed for a in run.arms}
    if len({seeds.get(a) for a in arm_names}) > 1:
        raise RestorationError(f"arms in one initialization group have different seeds: {seeds}")
    tag = run_tag or bundle.run_id or uuid.uuid4().hex[:12]
    tag = re.sub(r"[^A-Za-z0-9._-]", "-", str(tag))[:64]
    return _Group(arms, all_arm_names, arm_names, run.lora_rank, seeds.get(arm_names[0], 0), tag, run.dataset)


def _prepare_fixed_batch(
    bundle: EvidenceBundle, fixed_batch: Sequence[tinker.Datum] | None, description: JsonObject | None, group: _Group
) -> tuple[list[tinker.Datum], str]:
    """The given fixed batch (else the plan dataset's), registered as evidence, and its sha256."""
    if fixed_batch is None:
        fixed_batch, description = build_fixed_batch(seed=group.seed, dataset_name=group.dataset)
    fixed_batch = list(fixed_batch)
    if len(fixed_batch) < 2:
        raise RestorationError("fixed batch needs at least 2 datums (two distinct fixed gradients)")
    return fixed_batch, register_fixed_batch(bundle, fixed_batch, description)


def _initial_states(
    probe_sc: tinker.ServiceClient,
    bundle: EvidenceBundle,
    base_model: str,
    group: _Group,
    arm_seed_overrides: Mapping[str, int] | None,
    fixed_batch: Sequence[tinker.Datum],
    rec: Recorder,
    call: CallWrapper,
) -> _InitialStates:
    """Step 1: fresh LoRA client(s) and the immutable initial checkpoint(s)."""
    seed = group.seed
    arm_seed = {a: (arm_seed_overrides or {}).get(a, seed) for a in group.arm_names}
    by_seed = {seed: fresh_checkpoint(probe_sc, base_model, group.rank, "shared", seed, group.tag, rec, call)}
    for a, s in arm_seed.items():
        if s not in by_seed:
            by_seed[s] = fresh_checkpoint(probe_sc, base_model, group.rank, a, s, group.tag, rec, call)
    bundle.add_checkpoint("initial", 0, by_seed[seed].path)
    # The setup client's own output, before its first update: what one loaded arm is compared with.
    source_lp = full_logprobs(by_seed[seed].client, fixed_batch) if len(group.arm_names) == 1 else None
    return _InitialStates(
        by_seed,
        {a: by_seed[arm_seed[a]] for a in group.arm_names},
        {a: "shared" if arm_seed[a] == seed else a for a in group.arm_names},
        by_seed[seed],
        source_lp if arm_seed[group.arm_names[0]] == seed else None,
    )


def _load_arms(
    service_client: tinker.ServiceClient,
    arm_names: Sequence[str],
    sources: Mapping[str, InitialCheckpoint],
    rec: Recorder,
    call: CallWrapper,
    say: Callable[[str], None],
) -> dict[str, LoadedArm]:
    """Step 2: every trained arm from its checkpoint with optimizer; the load responses kept."""
    loaded = {}
    for i, a in enumerate(arm_names, start=1):
        say(f"2/6: loading arm {a} ({i}/{len(arm_names)}) from {sources[a].path} with optimizer")
        loaded[a] = load_arm(service_client, a, sources[a].path, rec, call)
    return loaded


def _probe_step(
    probe_sc: tinker.ServiceClient,
    init: _InitialStates,
    fixed_batch: Sequence[tinker.Datum],
    group: _Group,
    checkpoint_reader: LocalCheckpointReader | None,
    update_norm: UpdateNormMeasure | None,
    lr_multipliers: Sequence[float],
    rec: Recorder,
    atol: float,
    call: CallWrapper,
    restore_with_optimizer: bool,
    say: Callable[[str], None],
) -> _ProbeStep:
    """Step 4: the setup client (uninterrupted) vs a create-save-restore client, same two
    fixed-gradient updates; update 1 is also the LR-scaling probe at the planned LR."""
    opt_cfg = _arm_config(group, group.arm_names[0])  # the first trained arm's own; others: _other_config_probes
    if update_norm is None and checkpoint_reader is not None:
        update_norm = CheckpointUpdateNorm(checkpoint_reader, f"{group.tag}-lr")
    lr_in_plan = planned_lr_on_setup_client(update_norm, lr_multipliers)
    say("4/6: create-save-restore probe (uninterrupted setup client vs restored client, 2 fixed-gradient updates)")
    probe = restore_probe(
        probe_sc,
        init.shared.client,
        init.shared.path,
        fixed_batch,
        opt_cfg,
        group.tag,
        rec,
        atol,
        call,
        restore_optimizer=restore_with_optimizer,
        update_norm=update_norm if lr_in_plan else None,
        say=say,
    )
    return _ProbeStep(probe, opt_cfg, update_norm, lr_in_plan)


def _arm_config(group: _Group, arm: str) -> dict[str, float]:
    return next(a for a in group.arms if a.name == arm).optimizer_config.model_dump(exclude_none=True)


def _other_config_probes(
    probe_sc: tinker.ServiceClient,
    init: _InitialStates,
    fixed_batch: Sequence[tinker.Datum],
    group: _Group,
    probe: _ProbeStep,
    rec: Recorder,
    atol: float,
    call: CallWrapper,
    restore_with_optimizer: bool,
    say: Callable[[str], None],
) -> dict[str, RestoreProbeResult]:
    """Step 4 again for each trained arm whose optimizer config differs from every one probed so
    far: a fresh client from the initial checkpoint stands in for the uninterrupted setup client,
    so each arm's optimizer checks compare with the echo of its OWN config. The probe result of
    every trained arm, by arm."""
    results = {a: probe.result for a in group.arm_names if _arm_config(group, a) == probe.opt_cfg}
    for a in group.arm_names:
        cfg = _arm_config(group, a)
        same = next((b for b in results if _arm_config(group, b) == cfg), None)
        if same is not None:
            results[a] = results[same]
            continue
        say(f"4/6: create-save-restore probe again for arm {a} (its own optimizer config)")
        fresh, _ = call(partial(create_from_state_observed, probe_sc, init.shared.path, f"probe-{a}"))
        describe_client(probe_sc, fresh, f"restore probe of arm {a}'s config: fresh from the initial checkpoint")
        results[a] = restore_probe(
            probe_sc,
            fresh,
            init.shared.path,
            fixed_batch,
            cfg,
            f"{group.tag}-{a}",
            PrefixedResponses(rec, f"{a}:"),
            atol,
            call,
            restore_optimizer=restore_with_optimizer,
            say=say,
        )
        results[a].echo_observed_on = results[a].uninterrupted_client = (
            f"a fresh client from the initial checkpoint, nothing applied before update 1 (arm {a}'s config)"
        )
    return results


def _lr_scaling_step(
    probe_sc: tinker.ServiceClient,
    initial_checkpoint: str,
    fixed_batch: Sequence[tinker.Datum],
    probe: _ProbeStep,
    lr_multipliers: Sequence[float],
    lr_rtol: float,
    unavailable_reason: str,
    call: CallWrapper,
    say: Callable[[str], None],
) -> LrScalingBlock:
    """Step 6: the LR-scaling probe (the planned LR was measured on the setup client in step 4)."""
    in_plan = probe.lr_in_plan and probe.update_norm
    say(
        f"6/6: LR-scaling probe ({len(lr_multipliers)} learning rates, a fresh state each"
        + ("; the planned one is the probe's update 1 on the setup client)" if in_plan else ")")
    )
    base_lr = float(probe.opt_cfg["learning_rate"])
    return lr_scaling_probe(
        probe_sc,
        initial_checkpoint,
        fixed_batch,
        probe.opt_cfg,
        lr_multipliers,
        lr_rtol,
        probe.update_norm,
        unavailable_reason,
        call,
        measured={base_lr: probe.result.base_lr_update_norm} if in_plan else None,
        say=say,
    )


def _excluded_arms(group: _Group) -> dict[str, str]:
    return {
        a: ("never trains in this session: no client created for it, excluded from the optimizer-restoration groups")
        for a in group.all_arm_names
        if a not in group.arm_names
    }


def _posted_provenance(
    prov_body: InitializationProvenance, excluded: dict[str, str], trained_arms: Sequence[str] | None
) -> InitializationProvenance:
    """The result's initialization_provenance: with `trained_arms`, each posted check keeps only
    what the arm's OWN responses exposed."""
    if trained_arms is None:
        return prov_body
    return {
        "version": 1,
        "arms": {
            a: ArmProvenance(
                initialization=e["initialization"],
                restore_count=e["restore_count"],
                optimizer_checks=[as_object(own_response_only(c)) for c in e["optimizer_checks"]],
                initial_output=e["initial_output"],
            )
            for a, e in prov_body["arms"].items()
        },
        "excluded_arms": excluded,
    }


def _record_evidence(
    bundle: EvidenceBundle,
    rec: Recorder,
    probe: RestoreProbeResult,
    lr_block: LrScalingBlock,
    provenance: InitializationProvenance,
    posted: InitializationProvenance,
    t0: float,
) -> float:
    """The preflight's evidence files and result fields; returns the preflight's wall seconds."""
    bundle.register_json(RESPONSES_FILE, "log", rec.responses)
    bundle.register_json(PROBE_FILE, "metrics", probe.to_json())
    bundle.register_json(LR_SCALING_FILE, "metrics", lr_block.to_json())
    bundle.register_json(PROVENANCE_FILE, "manifest", provenance)
    wall = time.monotonic() - t0
    bundle.update_result(
        initialization_provenance=posted,
        metrics={
            "preflight/restoration_wall_seconds": wall,
            "preflight/restoration_passed": 1.0 if provenance["passed"] else 0.0,
        },
    )
    return wall


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
    call: CallWrapper | None = None,
    run_tag: str | None = None,
    trained_arms: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> RestorationResult:
    """Run the restoration preflight for the initialization group of the plan's spec (a
    diagnostic's: its original plan's); the six steps and every option are in the module docstring."""
    t0 = time.monotonic()
    say = _progress_line(progress, t0)
    call = call or _call_directly
    probe_sc = probe_service_client or service_client
    group = _resolve_group(plan, bundle, trained_arms, run_tag)
    rec, failures = Recorder(), []
    fixed_batch, b_sha = _prepare_fixed_batch(bundle, fixed_batch, fixed_batch_description, group)
    say(f"1/6: fresh LoRA rank-{group.rank} client on {base_model} and the shared initial checkpoint")
    init = _initial_states(probe_sc, bundle, base_model, group, arm_seed_overrides, fixed_batch, rec, call)
    loaded = _load_arms(service_client, group.arm_names, init.sources, rec, call, say)
    adapter_sha, adapter_note, adapter_failures = _adapter_hashes(
        checkpoint_reader, loaded, {a: init.sources[a].path for a in group.arm_names}, group.tag, rec
    )
    failures += adapter_failures
    say(f"3/6: initial logprobs of {len(group.arm_names)} arms on the fixed batch ({len(fixed_batch)} datums)")
    out_sha, cmp, output_failures = _initial_outputs(
        bundle, loaded, fixed_batch, b_sha, atol, source=init.source_logprobs
    )
    failures += output_failures
    probe = _probe_step(
        probe_sc,
        init,
        fixed_batch,
        group,
        checkpoint_reader,
        update_norm,
        lr_multipliers,
        rec,
        atol,
        call,
        probe_restore_with_optimizer,
        say,
    )
    failures.extend(probe.result.failures)
    probes = _other_config_probes(
        probe_sc, init, fixed_batch, group, probe, rec, atol, call, probe_restore_with_optimizer, say
    )
    others = {a: r for a, r in probes.items() if r is not probe.result}
    failures.extend(f"{a}: {m}" for a, r in others.items() for m in r.failures)
    if others:
        probe.result.own_config_probes = others  # written with the step-4 probe (PROBE_FILE)
    say("5/6: optimizer checks and initialization provenance")
    prov_body: InitializationProvenance = {
        "version": 1,
        "arms": _provenance_entries(
            group.arms, base_model, init.sources, init.source_label, loaded, probes, b_sha, out_sha, adapter_sha
        ),
    }
    failures.extend(check_provenance(prov_body, group.arm_names))
    excluded = _excluded_arms(group)
    lr_block = _lr_scaling_step(
        probe_sc,
        init.shared.path,
        fixed_batch,
        probe,
        lr_multipliers,
        lr_rtol,
        update_norm_unavailable_reason,
        call,
        say,
    )
    if isinstance(lr_block, LrScalingMeasured) and not lr_block.passed:
        failures.append(f"LR scaling: {lr_block.problem}")
    passed = not failures
    provenance: InitializationProvenance = {"version": 1, "arms": prov_body["arms"]}
    if excluded:
        provenance["excluded_arms"] = excluded
    provenance["group"] = {
        "arms": list(group.arm_names),
        "initial_checkpoint": init.shared.path,
        "initial_output_comparison": cmp,
        "adapter_sha256_method": adapter_note,
        "restore_probe": PROBE_FILE,
        "server_responses": RESPONSES_FILE,
    }
    provenance["passed"], provenance["failures"] = passed, list(failures)
    say(f"{'passed' if passed else 'FAILED'}" + (f": {len(failures)} problem(s)" if failures else ""))
    wall = _record_evidence(
        bundle, rec, probe.result, lr_block, provenance, _posted_provenance(prov_body, excluded, trained_arms), t0
    )
    return RestorationResult(
        initial_checkpoint=init.shared.path,
        loaded_paths={a: arm.loaded_path for a, arm in loaded.items() if arm.loaded_path},
        clients={a: arm.client for a, arm in loaded.items()},
        loaded=dict(loaded),
        fixed_batch=fixed_batch,
        batch_sha256=b_sha,
        output_sha256=out_sha,
        provenance=provenance,
        passed=passed,
        failures=failures,
        lr_scaling=lr_block,
        probe=probe.result,
        wall_seconds=wall,
    )

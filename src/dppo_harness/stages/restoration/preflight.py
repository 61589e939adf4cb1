"""Restoration preflight, the six steps in order: one shared immutable initial state for both arms, proved.

Flow (`run_restoration_preflight`):
1. One fresh LoRA client (plan rank) saves its state as the initial checkpoint; a second save
   under the same name must be refused explicitly for the checkpoint to count as immutable.
2. Each trained arm's client is restored from that checkpoint with optimizer state
   (`train.restore`); the load response's path is the proof of what was loaded.
3. Full per-token logprobs on a fixed tokenized GSM8K batch, on the arms (one arm: against the
   setup client), before any update: bitwise equal or within `LOGPROB_ATOL`.
4. Probe: the setup client (nothing applied since it saved) is the uninterrupted client; a
   create-save-restore client applies the same fixed-gradient update and must agree. An arm whose
   optimizer config differs gets its own probe. The arms' clients are never updated here.
5. Optimizer checks at creation and at every restore, from what server responses expose.
6. LR-scaling probe: a fresh state per learning rate (the setup client's update 1 at the planned
   LR, one client from the initial checkpoint per other LR), the same fixed gradient, norm / LR.

Every check records measured numbers and can fail; `RestorationResult.failures` says which did.
The probes are in `probe`, the records in `records`.

Options of `run_restoration_preflight`: `trained_arms` (None: all) get a client and a provenance
entry, the others are listed under `excluded_arms` (a single trained arm is compared with the
setup client); `checkpoint_reader` (local backend) measures adapter_sha256 and the LR-scaling norms,
without it or `update_norm` the LR probe is recorded unavailable; `probe_service_client` holds the
setup and probe clients, so the caller can release them; `arm_seed_overrides` and
`probe_restore_with_optimizer=False` are for failure-path tests; `capacity`/`registry` retry every
client-creating call on a capacity refusal; `progress` gets a line at every step.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tinker
from pydantic import JsonValue

from dppo_harness import constants
from dppo_harness.data import dataset, tokenizer
from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.service.observed import create_from_state_with_response, describe_client
from dppo_harness.service.wait.policy import call_with_capacity_retry, error_text, is_capacity_error
from dppo_harness.service.wait.waiter import name_client
from dppo_harness.stages.restoration.probe import (
    DEFAULT_LR_MULTIPLIERS,
    CallWrapper,
    CheckpointUpdateNorm,
    LocalCheckpointReader,
    ProbeRun,
    UpdateNormMeasure,
    lr_scaling_probe,
    planned_lr_on_setup_client,
    restore_probe,
)
from dppo_harness.stages.restoration.records import (
    FIXED_BATCH_FILE,
    INITIAL_OUTPUT_FILE,
    LR_SCALING_FILE,
    PROBE_FILE,
    PROVENANCE_FILE,
    RESPONSES_FILE,
    ArmProvenance,
    InitializationProvenance,
    LrScalingMeasured,
    Recorder,
    RestorationResult,
    check_provenance,
    initialization_entry,
    load_ref,
)
from dppo_harness.train.clients import RestorationError, datum_arrays, full_logprobs
from dppo_harness.train.fingerprints import LOGPROB_ATOL, batch_sha256, compare_logprobs, logprobs_sha256
from dppo_harness.train.optimizer_checks import optimizer_check, own_response_only
from dppo_harness.train.restore import Restore, restore
from dppo_harness.train.weights_readback import ExternalWeightsUpdateNorm

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ExperimentSpec, Plan
    from dppo_harness.plans.models import RestorationArm
    from dppo_harness.service.observed import ClientRegistry
    from dppo_harness.service.wait.policy import WaitPolicy

EXCLUDED_REASON = (
    "never trains in this session: no client created for it, excluded from the optimizer-restoration groups"
)
SOURCE_OUTPUT_KEY = "initial_checkpoint_source"
ADAPTERS_UNMEASURED = "not measurable over the Tinker API on this backend"
ADAPTERS_MEASURED = (
    "local_hash: sha256 of the LoRA tensors in a save_state of each arm taken right "
    "after its load, read from the embedded server's run_dir"
)
FIXED_BATCH_ITEMS = 4


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


@dataclass(frozen=True)
class RestorationGroup:
    """The initialization group as this session runs it: its arms, the trained ones, one seed."""

    all_arm_names: list[str]
    arms: list[RestorationArm]  # the trained arms, in the group's order
    rank: int
    seed: int
    tag: str  # names the checkpoints this run saves
    dataset: str

    @property
    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]

    def optimizer_config(self, arm: str) -> dict[str, float]:
        """The arm's optimizer_config as the spec gives it (unset keys left out)."""
        return next(a for a in self.arms if a.name == arm).optimizer_config.model_dump(exclude_none=True)


def resolve_group(plan: Plan, bundle: EvidenceBundle, trained_arms: Sequence[str] | None) -> RestorationGroup:
    """The group's arms, the trained ones among them, their one seed, and the run's checkpoint tag."""
    run = plan.spec_plan.run
    assert run is not None  # every experiment spec has its RunConfig from load
    arms = restoration_arms(plan.spec_plan.experiment)
    names = [a.name for a in arms]
    if trained_arms is not None and (not trained_arms or set(trained_arms) - set(names)):
        raise RestorationError(f"trained_arms {list(trained_arms)}: not arms of the initialization group {names}")
    trained = [a for a in arms if trained_arms is None or a.name in set(trained_arms)]
    seeds = {a.name: a.seed for a in run.arms}
    if len({seeds.get(a.name) for a in trained}) > 1:
        raise RestorationError(f"arms in one initialization group have different seeds: {seeds}")
    tag = re.sub(r"[^A-Za-z0-9._-]", "-", str(bundle.run_id or uuid.uuid4().hex[:12]))[:64]
    return RestorationGroup(names, trained, run.lora_rank, seeds.get(trained[0].name, 0), tag, run.dataset)


def reference_completion(solution: str, reference: str) -> str:
    """A GSM8K worked solution as an assistant answer: calculator annotations dropped, the
    '#### N' line replaced by the boxed answer the cookbook's grader reads."""
    body = solution.split("####")[0]
    body = re.sub(r"<<[^>]*>>", "", body).strip()
    return f"{body} \\boxed{{{reference}}}"


def build_fixed_batch(
    n_items: int = FIXED_BATCH_ITEMS, seed: int = 0, dataset_name: str = "gsm8k"
) -> tuple[list[tinker.Datum], JsonObject]:
    """The first `n_items` train items of the plan's dataset (GSM8K: cookbook order, `seed`), rendered
    with the qwen3_5 renderer (one-shot prefix, cookbook prompt), reference solutions as the
    assistant targets; weights 1 on the answer's tokens, 0 on the prompt. Returns the datums and a
    description (item ids, lengths) for evidence."""
    data = dataset.get(dataset_name)
    bundle = tokenizer.make_renderer()
    items = data.load_split("train", seed=seed).items[:n_items]
    if len(items) < n_items:
        raise RestorationError(f"fixed batch needs {n_items} GSM8K train items, got {len(items)}")
    batch: list[tinker.Datum] = []
    described: list[JsonValue] = []
    for item in items:
        messages = data.prompt_messages(item) + [
            {"role": "assistant", "content": reference_completion(item.solution, item.reference)}
        ]
        model_input, weights = bundle.renderer.build_supervised_example(messages)
        tokens = model_input.to_ints()
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if len(w) != len(tokens) or w.sum() == 0:
            raise RestorationError(f"{item.item_id}: renderer gave {len(w)} weights for {len(tokens)} tokens")
        batch.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
                    "weights": tinker.TensorData.from_numpy(w[1:].copy()),
                },
            )
        )
        described.append({"item_id": item.item_id, "tokens": len(tokens), "weighted_targets": int(w[1:].sum())})
    return batch, {"items": described, "renderer": bundle.provenance, "seed": seed}


def register_fixed_batch(
    bundle: EvidenceBundle, fixed_batch: Sequence[tinker.Datum], description: JsonObject | None
) -> str:
    """The fixed batch as evidence; returns its sha256."""
    b_sha = batch_sha256(fixed_batch)
    rows: list[JsonValue] = []
    for d in fixed_batch:
        tokens_T, targets_T, mask_T = datum_arrays(d)
        rows.append({"input_tokens": tokens_T.tolist(), "target_tokens": targets_T.tolist(), "mask": mask_T.tolist()})
    bundle.register_json(
        FIXED_BATCH_FILE,
        "tensors",
        {
            "batch_sha256": b_sha,
            "hash": "sha256 over each datum's int64 input ids, int64 target ids and float32 mask (weights), "
            "length-prefixed; see restoration.batch_sha256",
            "description": description,
            "datums": rows,
        },
    )
    return b_sha


# A refusal to overwrite names the existing checkpoint; other failures of the duplicate save
# (timeouts, 5xx, capacity, connection errors) say nothing about immutability.
OVERWRITE_REFUSAL_RE = re.compile(r"already exists|exists already|overwrit|immutable", re.IGNORECASE)


def duplicate_save_outcome(exc: BaseException | None, name: str = "") -> tuple[bool | None, str]:
    """(checkpoint_immutable, reason) from the second save_state of `name` under the same name.

    True only on the service's explicit refusal to overwrite: HTTP 409, or a failed request / 400
    whose text says the checkpoint exists or may not be overwritten. A failed request of category
    server counts only when its text also names the checkpoint: Spindle refuses a duplicate name as
    a server-category `checkpoint already exists: /checkpoints/<name>/<model_id>` (a plain
    FileExistsError), while a server failure that merely mentions a file proves nothing. A second
    save that succeeded is False (the name is not immutable). Anything else (timeout, 5xx,
    capacity, connection, other errors) is None: unverified, with the reason. The reason keeps the
    category and text as sent.
    """
    if exc is None:
        return False, "the service accepted a second save_state under the same name without overwrite"
    text = error_text(exc)
    what = f"{type(exc).__name__}: {text}"[:300]
    says_refused = bool(OVERWRITE_REFUSAL_RE.search(text))
    if isinstance(exc, tinker.ConflictError):
        refused = True
    elif is_capacity_error(exc):
        refused = False
    elif isinstance(exc, tinker.RequestFailedError) and exc.category == tinker.types.RequestErrorCategory.Server:
        refused, what = says_refused and bool(name) and name in text, f"{what} (category server)"
    else:
        failed = (tinker.RequestFailedError, tinker.BadRequestError, tinker.UnprocessableEntityError)
        refused = says_refused and isinstance(exc, failed)
    if refused:
        return True, f"the service refused to overwrite the saved name ({what})"
    return None, (
        f"the duplicate save_state ended in {what}, not an explicit refusal to overwrite: immutability unverified"
    )


@dataclass(frozen=True)
class InitialCheckpoint:
    client: tinker.TrainingClient  # the fresh setup client that saved it (released with its ServiceClient)
    path: str
    immutable: bool | None  # None: the duplicate save proved nothing either way
    immutable_reason: str = ""
    info: tinker.types.GetInfoResponse | None = None  # the setup client's get_info at creation, before any update


def fresh_checkpoint(
    probe_sc: tinker.ServiceClient,
    base_model: str,
    rank: int,
    label: str,
    seed: int,
    tag: str,
    rec: Recorder,
    call: CallWrapper,
) -> InitialCheckpoint:
    """Step 1: a fresh LoRA client saves the immutable initial checkpoint.

    No per-model seed is sent: Spindle's multi-LoRA backend refuses one (the creation future fails,
    "Miles multi-LoRA does not support per-model seeds"), and a seed would prove nothing anyway;
    every arm is proved to start from this one saved state by its observed load. `seed` is the
    plan's initialization group (arms with their own group get their own setup client)."""
    # Setup client on the probe ServiceClient: released with it; its checkpoint stays.
    client = call(lambda: probe_sc.create_lora_training_client(base_model=base_model, rank=rank))
    name_client(client, f"setup client ({label})")
    describe_client(
        probe_sc,
        client,
        f"setup ({label}, initialization group of seed {seed}): saves the initial checkpoint"
        + ("; then the uninterrupted restore probe and the base-LR scaling probe" if label == "shared" else ""),
    )
    info = client.get_info()
    rec.keep(f"create_{label}.get_info", info)
    name = f"{tag}-initial-{label}"
    saved = client.save_state(name).result()
    rec.keep(f"save_{label}", saved)
    # Immutability: the server must explicitly refuse to replace the name without overwrite=True.
    try:
        again = client.save_state(name).result()
    except Exception as exc:
        immutable, reason = duplicate_save_outcome(exc, name)
        rec.keep(
            f"save_{label}_again_refused" if immutable else f"save_{label}_again_failed",
            {"error": f"{type(exc).__name__}: {exc}", "checkpoint_immutable": immutable, "reason": reason},
        )
    else:
        immutable, reason = duplicate_save_outcome(None, name)
        rec.keep(f"save_{label}_again", again)
    return InitialCheckpoint(client, saved.path, immutable, reason, info)


def adapter_hashes(
    reader: LocalCheckpointReader | None, arms: Mapping[str, Restore], tag: str, rec: Recorder
) -> tuple[dict[str, str | None], str, list[str]]:
    """Each arm's adapter sha256 as loaded (local backend: read back from a save of each arm; not an
    update; None where unmeasurable), how it was measured, and every arm whose adapter differs from
    its checkpoint's."""
    hashes: dict[str, str | None] = dict.fromkeys(arms)
    if reader is None:
        return hashes, ADAPTERS_UNMEASURED, []
    failures = []
    for a, arm in arms.items():
        snap = arm.client.save_state(f"{tag}-{a}-as-loaded").result()
        rec.keep(f"save_{a}_as_loaded", snap)
        hashes[a] = as_loaded = reader.adapter_sha256(snap.path)
        src_sha = reader.adapter_sha256(arm.source_path)
        if as_loaded != src_sha:
            failures.append(f"{a}: adapter as loaded ({as_loaded[:12]}) differs from its checkpoint's ({src_sha[:12]})")
    return hashes, ADAPTERS_MEASURED, failures


def initial_outputs(
    bundle: EvidenceBundle,
    arms: Mapping[str, Restore],
    fixed_batch: Sequence[tinker.Datum],
    b_sha: str,
    source: Sequence[np.ndarray] | None = None,
) -> tuple[dict[str, str], JsonObject, list[str]]:
    """Step 3: full logprobs of every arm on the fixed batch before any update, compared: each arm's
    output sha256, the comparisons (by `first_vs_other`) and every pair outside the tolerance. With
    a single arm, `source` (the setup client's logprobs, taken before its first update) is what it
    is compared with, so the check can still fail."""
    names = list(arms)
    logprobs = {a: full_logprobs(arms[a].client, fixed_batch) for a in names}
    out_sha = {a: logprobs_sha256(lp) for a, lp in logprobs.items()}
    stored = dict(logprobs)
    pairs: list[tuple[str, str, Sequence[np.ndarray]]] = [(names[0], other, logprobs[other]) for other in names[1:]]
    if len(names) == 1 and source is not None:
        pairs = [(names[0], SOURCE_OUTPUT_KEY, source)]
        stored[SOURCE_OUTPUT_KEY] = list(source)
    cmp: JsonObject = {}
    failures: list[str] = []
    for first, other, lp in pairs:
        c = compare_logprobs(logprobs[first], lp, LOGPROB_ATOL)
        cmp[f"{first}_vs_{other}"] = as_object(c)
        if not c["within_tolerance"]:
            failures.append(
                f"initial logprobs differ between {first} and {other}: max |diff| "
                f"{c['max_abs_diff']} > {LOGPROB_ATOL}" + (f" ({c['problem']})" if "problem" in c else "")
            )
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


def backend_update_norm(
    local_run_dir: Path | None, probe_service_client: tinker.ServiceClient
) -> tuple[LocalCheckpointReader | None, UpdateNormMeasure | None]:
    """(checkpoint reader, update-norm measure) a backend allows: the embedded server's checkpoints
    on disk under `local_run_dir`, else the trained weights read back through the SDK."""
    if local_run_dir is not None:
        return LocalCheckpointReader(local_run_dir), None
    return None, ExternalWeightsUpdateNorm(probe_service_client.create_rest_client)


def run_restoration_preflight(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    *,
    base_model: str = constants.BASE_MODEL,
    fixed_batch: Sequence[tinker.Datum] | None = None,
    fixed_batch_description: JsonObject | None = None,
    lr_multipliers: Sequence[float] = DEFAULT_LR_MULTIPLIERS,
    checkpoint_reader: LocalCheckpointReader | None = None,
    update_norm: UpdateNormMeasure | None = None,
    probe_service_client: tinker.ServiceClient | None = None,
    arm_seed_overrides: Mapping[str, int] | None = None,
    probe_restore_with_optimizer: bool = True,
    capacity: WaitPolicy | None = None,
    registry: ClientRegistry | None = None,
    trained_arms: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> RestorationResult:
    """Run the restoration preflight for the initialization group of the plan's spec (a
    diagnostic's: its original plan's); the six steps and every option are in the module docstring."""
    t0 = time.monotonic()

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"[preflight] restoration {msg} ({time.monotonic() - t0:.0f}s)")

    group = resolve_group(plan, bundle, trained_arms)
    names = group.arm_names
    if fixed_batch is None:
        fixed_batch, fixed_batch_description = build_fixed_batch(seed=group.seed, dataset_name=group.dataset)
    batch = list(fixed_batch)
    if len(batch) < 2:
        raise RestorationError("fixed batch needs at least 2 datums (two distinct fixed gradients)")
    b_sha = register_fixed_batch(bundle, batch, fixed_batch_description)
    call: CallWrapper = (
        (lambda fn: fn())
        if capacity is None
        else (lambda fn: call_with_capacity_retry(fn, policy=capacity, registry=registry))
    )
    rec = Recorder()
    probe_sc = probe_service_client or service_client
    prun = ProbeRun(probe_sc, batch, rec, call, say, probe_restore_with_optimizer)

    say(f"1/6: fresh LoRA rank-{group.rank} client on {base_model} and the shared initial checkpoint")
    arm_seed = {a: (arm_seed_overrides or {}).get(a, group.seed) for a in names}
    fresh = partial(fresh_checkpoint, probe_sc, base_model, group.rank)
    by_seed = {group.seed: fresh("shared", group.seed, group.tag, rec, call)}
    for a, s in arm_seed.items():
        if s not in by_seed:
            by_seed[s] = fresh(a, s, group.tag, rec, call)
    shared = by_seed[group.seed]
    bundle.add_checkpoint("initial", 0, shared.path)
    # The setup client's own output, before its first update: what one loaded arm is compared with.
    source_lp = full_logprobs(shared.client, batch) if len(names) == 1 and arm_seed[names[0]] == group.seed else None

    loaded: dict[str, Restore] = {}
    for i, a in enumerate(names, start=1):
        path = by_seed[arm_seed[a]].path
        say(f"2/6: loading arm {a} ({i}/{len(names)}) from {path} with optimizer")
        loaded[a] = call(partial(restore, service_client, path, a))
        describe_client(service_client, loaded[a].client, f"arm {a}: loaded from the initial checkpoint with optimizer")
        rec.keep(f"load_{a}", loaded[a].response)
        rec.keep(f"load_{a}.get_info", loaded[a].info)
    adapters, adapter_method, failures = adapter_hashes(checkpoint_reader, loaded, group.tag, rec)
    say(f"3/6: initial logprobs of {len(names)} arms on the fixed batch ({len(batch)} datums)")
    out_sha, comparison, output_failures = initial_outputs(bundle, loaded, batch, b_sha, source=source_lp)
    failures += output_failures

    # Step 4: the setup client (uninterrupted) vs a create-save-restore client on the first trained
    # arm's config; update 1 is also the LR probe at the planned LR. Each other optimizer config
    # gets its own probe from a fresh client, so every arm's checks compare with its OWN echo.
    opt_cfg = group.optimizer_config(names[0])
    if update_norm is None and checkpoint_reader is not None:
        update_norm = CheckpointUpdateNorm(checkpoint_reader, f"{group.tag}-lr")
    in_plan = update_norm if planned_lr_on_setup_client(update_norm, lr_multipliers) else None
    say("4/6: create-save-restore probe (uninterrupted setup client vs restored client, 2 fixed-gradient updates)")
    probe = restore_probe(prun, shared.client, shared.path, opt_cfg, group.tag, update_norm=in_plan)
    probes = {names[0]: probe}
    for a in names[1:]:
        cfg = group.optimizer_config(a)
        same = next((p for b, p in probes.items() if group.optimizer_config(b) == cfg), None)
        if same is not None:
            probes[a] = same
            continue
        say(f"4/6: create-save-restore probe again for arm {a} (its own optimizer config)")
        client, _ = call(partial(create_from_state_with_response, probe_sc, shared.path, f"probe-{a}"))
        describe_client(probe_sc, client, f"restore probe of arm {a}'s config: fresh from the initial checkpoint")
        own = ProbeRun(probe_sc, batch, rec.prefixed(f"{a}:"), call, say, probe_restore_with_optimizer)
        probes[a] = restore_probe(own, client, shared.path, cfg, f"{group.tag}-{a}")
        probes[a].echo_observed_on = probes[a].uninterrupted_client = (
            f"a fresh client from the initial checkpoint, nothing applied before update 1 (arm {a}'s config)"
        )
        probe.own_config_probes[a] = probes[a]  # written with the step-4 probe (PROBE_FILE)
    failures += probe.failures + [f"{a}: {m}" for a, r in probe.own_config_probes.items() for m in r.failures]

    say("5/6: optimizer checks and initialization provenance")
    arms: dict[str, ArmProvenance] = {}
    for arm in group.arms:  # optimizer checks at creation (0) and restore (1), against its own config's echo
        a, source, label = (
            arm.name,
            by_seed[arm_seed[arm.name]],
            "shared" if arm_seed[arm.name] == group.seed else arm.name,
        )
        check = partial(
            optimizer_check,
            requested_optimizer=arm.optimizer,
            requested_config=arm.optimizer_config.model_dump(exclude_none=True),
            echoed=probes[a].echoed_config or None,
            echo_ref=probes[a].echo_ref,
            echo_observed_on=probes[a].echo_observed_on,
        )
        arms[a] = initialization_entry(
            base_checkpoint=base_model,
            checkpoint_uri=source.path,
            checkpoint_immutable=source.immutable,
            checkpoint_immutable_reason=source.immutable_reason or None,
            loaded_checkpoint_uri=loaded[a].loaded_path,
            load_succeeded=True,  # the service answered the load (what it loaded is checked by its path)
            evidence_ref=load_ref(a),
            restore_count=1,
            optimizer_checks=[
                check(after_restore=0, info=source.info, info_ref=f"{RESPONSES_FILE}#create_{label}.get_info"),
                check(after_restore=1, info=loaded[a].info, info_ref=f"{load_ref(a)}.get_info"),
            ],
            initial_output={
                "available": True,
                "batch_sha256": b_sha,
                "output_sha256": out_sha[a],
                "evidence_ref": INITIAL_OUTPUT_FILE,
                "before_first_update": True,
            },
            adapter_sha256=adapters[a],
        )
    failures += check_provenance({"version": 1, "arms": arms}, names)

    say(
        f"6/6: LR-scaling probe ({len(lr_multipliers)} learning rates, a fresh state each"
        + ("; the planned one is the probe's update 1 on the setup client)" if in_plan else ")")
    )
    measured = {float(opt_cfg["learning_rate"]): probe.base_lr_update_norm} if in_plan else None
    lr_block = lr_scaling_probe(prun, shared.path, opt_cfg, lr_multipliers, update_norm, measured)
    if isinstance(lr_block, LrScalingMeasured) and not lr_block.passed:
        failures.append(f"LR scaling: {lr_block.problem}")
    say(f"{'passed' if not failures else 'FAILED'}" + (f": {len(failures)} problem(s)" if failures else ""))
    # The evidence files; the result's initialization_provenance has `version` and `arms`, and when
    # some arm does not train also `excluded_arms`, each posted check keeping only what the arm's
    # OWN responses exposed.
    provenance: InitializationProvenance = {"version": 1, "arms": arms}
    posted: InitializationProvenance = {"version": 1, "arms": arms}
    excluded = {a: EXCLUDED_REASON for a in group.all_arm_names if a not in names}
    if excluded:
        provenance["excluded_arms"] = dict(excluded)
    provenance["group"] = {
        "arms": list(names),
        "initial_checkpoint": shared.path,
        "initial_output_comparison": comparison,
        "adapter_sha256_method": adapter_method,
        "restore_probe": PROBE_FILE,
        "server_responses": RESPONSES_FILE,
    }
    provenance["passed"], provenance["failures"] = not failures, list(failures)
    if trained_arms is not None:
        mine = {a: [as_object(own_response_only(c)) for c in e["optimizer_checks"]] for a, e in arms.items()}
        posted = {"version": 1, "arms": {a: {**e, "optimizer_checks": mine[a]} for a, e in arms.items()}}
        posted["excluded_arms"] = dict(excluded)
    bundle.register_json(RESPONSES_FILE, "log", rec.responses)
    bundle.register_json(PROBE_FILE, "metrics", probe.to_json())
    bundle.register_json(LR_SCALING_FILE, "metrics", lr_block.to_json())
    bundle.register_json(PROVENANCE_FILE, "manifest", provenance)
    wall = time.monotonic() - t0
    passed = 1.0 if not failures else 0.0
    metrics = {"preflight/restoration_wall_seconds": wall, "preflight/restoration_passed": passed}
    bundle.update_result(initialization_provenance=posted, metrics=metrics)
    return RestorationResult(
        initial_checkpoint=shared.path,
        loaded_paths={a: arm.loaded_path for a, arm in loaded.items() if arm.loaded_path},
        clients={a: arm.client for a, arm in loaded.items()},
        loaded=loaded,
        fixed_batch=batch,
        batch_sha256=b_sha,
        output_sha256=out_sha,
        provenance=provenance,
        passed=not failures,
        failures=failures,
        lr_scaling=lr_block,
        probe=probe,
        wall_seconds=wall,
    )

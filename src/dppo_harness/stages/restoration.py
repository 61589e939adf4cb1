"""The restoration preflight: one shared immutable initial state for both arms, proved in six steps
(`run_restoration_preflight` says each as it runs): the initial checkpoint saved by a fresh setup
client (a duplicate save must be refused explicitly), each trained arm restored from it with
optimizer (`train.restore`), their initial logprobs on a fixed GSM8K batch compared, the
create-save-restore probe (`restore_probe`), optimizer checks from what the server's responses
expose, and the LR-scaling probe (`lr_scaling_probe`; update norms need an `UpdateNormMeasure`: the
Tinker API exposes no parameters). Every check records measured numbers and can fail;
`RestorationResult.failures` says which did.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NotRequired, Protocol, TypedDict

import numpy as np
import tinker
from pydantic import JsonValue

from dppo_harness import constants
from dppo_harness.data import dataset, tokenizer
from dppo_harness.json_types import JsonObject, as_object, items
from dppo_harness.loss.correctness import lr_scaling_error
from dppo_harness.service.observed import create_from_state_with_response, describe_client
from dppo_harness.service.wait.policy import call_with_capacity_retry, error_text, is_capacity_error
from dppo_harness.service.wait.waiter import name_client
from dppo_harness.stages.write import INITIAL_OUTPUT_FILE, LR_SCALING_FILE, PROBE_FILE, RESPONSES_FILE
from dppo_harness.train.clients import RestorationError, datum_arrays, dump_response, full_logprobs
from dppo_harness.train.fingerprints import LOGPROB_ATOL, batch_sha256, compare_logprobs, logprobs_sha256
from dppo_harness.train.optimizer_checks import echoed_config, optimizer_check
from dppo_harness.train.restore import Restore, restore
from dppo_harness.train.weights_readback import ExternalWeightsUpdateNorm, update_norm_from_tensors

if TYPE_CHECKING:
    import torch

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ExperimentSpec, Plan
    from dppo_harness.plans.models import RestorationArm
    from dppo_harness.service.observed import ClientRegistry
    from dppo_harness.service.wait.policy import WaitPolicy


@dataclass
class Recorder:
    """Server responses kept for evidence, each under a reference id (`prefixed`: another probe's)."""

    responses: dict[str, JsonValue] = field(default_factory=dict)
    prefix: str = ""

    def keep(self, ref: str, obj: object) -> str:
        self.responses[f"{self.prefix}{ref}"] = dump_response(obj)
        return f"{RESPONSES_FILE}#{self.prefix}{ref}"

    def prefixed(self, prefix: str) -> Recorder:
        return Recorder(self.responses, self.prefix + prefix)


def load_ref(arm: str) -> str:
    """Where the evidence keeps an arm's load response."""
    return f"{RESPONSES_FILE}#load_{arm}"


PROBE_UPDATES = ["cross_entropy on even datums + optim_step", "cross_entropy on odd datums + optim_step"]


@dataclass(kw_only=True)
class RestoreProbeResult:
    """One create-save-restore probe, its fields in the order restoration-probe.json writes them."""

    initial_checkpoint: str
    mid_checkpoint: str
    loaded_checkpoint_uri: str | None
    adam_params: JsonObject
    restored_vs_uninterrupted: JsonObject  # compare_logprobs of the two clients after update 2
    second_update_effect: JsonObject  # compare_logprobs of the uninterrupted client before / after update 2
    optim_metrics: dict[str, dict[str, float]]  # update1, update2_uninterrupted, update2_restored
    echoed_config: dict[str, float]
    echo_ref: str
    echo_observed_on: str = (
        "probe client (the setup client that saved the initial checkpoint, nothing applied since) "
        "(optim_step response metrics)"
    )
    uninterrupted_client: str = "the setup client that saved the initial checkpoint (no update before update 1)"
    base_lr_update_norm: float | None
    failures: list[str]
    own_config_probes: dict[str, RestoreProbeResult] = field(default_factory=dict)  # other trained arms' configs

    def to_json(self) -> JsonObject:
        """restoration-probe.json (`own_config_probes` only when another arm's config was probed)."""
        out = as_object(asdict(self))
        if not self.own_config_probes:
            del out["own_config_probes"]
        return {**{k: out.pop(k) for k in list(out)[:3]}, "updates": list(PROBE_UPDATES), **out}


@dataclass(frozen=True)
class LrScalingUnavailable:
    """The LR-scaling probe could not measure update norms on this backend, and why."""

    reason: str
    learning_rates: list[float]
    available: Literal[False] = False

    def to_json(self) -> JsonObject:  # lr-scaling-probe.json when unmeasured
        rates: list[JsonValue] = [*self.learning_rates]
        return {"available": False, "reason": self.reason, "learning_rates": rates, "lr_scaling": [], "passed": None}


@dataclass(frozen=True, kw_only=True)
class LrScalingMeasured:
    """Update norms from a fresh state per LR, in the order lr-scaling-probe.json writes them."""

    available: Literal[True] = True
    measure: str | None = None
    reset: str | None = None
    gradient: str | None = None
    lr_scaling: list[dict[str, float]]  # {"learning_rate", "update_norm"} per probe, in LR order
    relative_error: list[float | None] | None = None
    rtol: float | None = None
    passed: bool | None = None
    problem: str | None = None

    def to_json(self) -> JsonObject:  # lr-scaling-probe.json when measured
        return as_object(asdict(self))


LrScalingBlock = LrScalingUnavailable | LrScalingMeasured


@dataclass
class RestorationResult:
    initial_checkpoint: str
    fixed_batch: list[tinker.Datum]
    batch_sha256: str
    output_sha256: dict[str, str]
    provenance: InitializationProvenance  # initialization-provenance.json
    failures: list[str]
    lr_scaling: LrScalingBlock
    probe: RestoreProbeResult
    wall_seconds: float
    loaded: dict[str, Restore]  # each loaded arm: client, load response, get_info
    batch_description: JsonObject | None
    initial_logprobs: dict[str, list[np.ndarray]]  # per arm (and the setup client's), before any update
    responses: dict[str, JsonValue]  # the server's responses the provenance cites, by reference id

    @property
    def clients(self) -> dict[str, tinker.TrainingClient]:
        return {a: r.client for a, r in self.loaded.items()}

    @property
    def passed(self) -> bool:
        return not self.failures

    def failure_message(self) -> str:
        return "restoration preflight failed:\n  - " + "\n  - ".join(self.failures)

    def preflight_service_work(self) -> dict[str, dict[str, int]]:
        """Optimizer updates the preflight issued on its throwaway probe clients: the continuity probe's
        three, and one per measured LR probe less the planned LR's (the continuity probe's update 1)."""
        lr, shared = self.lr_scaling, int(self.probe.base_lr_update_norm is not None)
        lr_updates = max(0, len(lr.lr_scaling) - shared) if isinstance(lr, LrScalingMeasured) else 0
        return {
            "restore_continuity_probe": {"optimizer_updates": 3, "sampling_batches": 0},
            "lr_scaling_probe": {"optimizer_updates": lr_updates, "sampling_batches": 0},
            "feasibility_pilot": {"optimizer_updates": 0, "sampling_batches": 0},
        }


class ArmProvenance(TypedDict):
    """One arm's `initialization_provenance` entry (version 1)."""

    initialization: JsonObject
    restore_count: int
    optimizer_checks: list[JsonObject]  # train.optimizer_checks.OptimizerCheck entries, as JSON
    initial_output: JsonObject


class InitializationProvenance(TypedDict):
    """initialization-provenance.json (the result's has `version`, `arms`, `excluded_arms`)."""

    version: int
    arms: dict[str, ArmProvenance]
    excluded_arms: NotRequired[dict[str, str]]
    group: NotRequired[JsonObject]
    passed: NotRequired[bool]
    failures: NotRequired[list[str]]


def check_provenance(entries: Mapping[str, ArmProvenance]) -> list[str]:
    """Every failure of the group's initialization proof the service's answers can cause (every
    entry has one checkpoint, one batch and restore_count 1 by construction)."""
    failures: list[str] = []
    for arm, e in entries.items():
        init = e["initialization"]
        immutable, why = init["checkpoint_immutable"], init.get("checkpoint_immutable_reason")
        if immutable is None:
            failures.append(f"{arm}: checkpoint_immutable unverified: {why or 'no explicit refusal to overwrite'}")
        elif not immutable:
            failures.append(f"{arm}: initial checkpoint not shown immutable" + (f": {why}" if why else ""))
        if init["loaded_checkpoint_uri"] is None:
            failures.append(f"{arm}: no loaded checkpoint URI in the server's load response")
        elif init["loaded_checkpoint_uri"] != init["checkpoint_uri"]:
            failures.append(
                f"{arm}: server loaded {init['loaded_checkpoint_uri']!r}, expected {init['checkpoint_uri']!r}"
            )
        failures += [
            f"{arm}: optimizer mismatch after restore {c['after_restore']}: "
            + "; ".join(str(m) for m in items(c["mismatches"]))
            for c in e["optimizer_checks"]
            if c["mismatches"]
        ]
    loaded = {str(e["initialization"]["loaded_checkpoint_uri"]) for e in entries.values()}
    if len(loaded) > 1:
        failures.append(f"arms do not share one loaded checkpoint: {sorted(loaded)}")
    hashes = {str(h) for e in entries.values() if (h := e["initialization"].get("adapter_sha256")) is not None}
    if len(hashes) > 1:
        failures.append(f"arms' adapter_sha256 differ: {sorted(hashes)}")
    return failures


CallWrapper = Callable[[Callable[[], Any]], Any]  # wraps every client-creating call (e.g. a capacity retry)
LR_SCALING_RTOL = 0.05  # |(norm/lr) / (norm0/lr0) - 1| allowed; Adam's first step is ~lr * sign(g)
DEFAULT_LR_MULTIPLIERS = (0.5, 1.0, 2.0)


class UpdateNormMeasure(Protocol):
    """Measures ||theta_after - theta_before|| around `apply_update()` on `client`, or None.

    A measure whose own requests can be refused (e.g. a service without external weights) must
    not run on a client that has more work to do: the SDK numbers each client's requests, and one
    refused at submit leaves a gap the server waits on before running that client's next request.
    `safe_on_a_working_client` says the measure's requests cannot be refused that way."""

    description: str

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], object]) -> float | None: ...


class LocalCheckpointReader:
    """Adapter tensors of the checkpoints the embedded server wrote under its run_dir (the Tinker API
    exposes no parameters); torch and the server's model module load on the first read only."""

    description = (
        "local backend only: ||theta_after - theta_before|| over all LoRA parameters, read from "
        "save_state checkpoints the embedded server wrote under its run_dir"
    )

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)

    def adapter(self, path: str) -> dict[str, torch.Tensor]:
        """The checkpoint's LoRA tensors by name (`checkpoint_files.adapter_file` says where they are)."""
        import torch  # local backend only: loaded on the first read (see the class docstring)

        from dppo_harness.local_server.checkpoint_files import adapter_file  # local backend only

        f = adapter_file(self.run_dir, path)
        if f is None or not f.is_file():
            raise RestorationError(f"checkpoint {path!r} has no adapter file under {self.run_dir} ({f})")
        return torch.load(f, map_location="cpu", weights_only=True)

    def adapter_sha256(self, path: str) -> str:
        """sha256 over names, dtypes, shapes and raw bytes of the adapter, sorted by name."""
        from dppo_harness.local_server.engine.model import state_sha256  # local backend only

        return state_sha256(self.adapter(path))


class CheckpointUpdateNorm:
    """UpdateNormMeasure via save_state before and after the update (local backend)."""

    safe_on_a_working_client = True  # save_state only: a request every backend serves

    def __init__(self, reader: LocalCheckpointReader, tag: str):
        self.reader, self.tag, self.description, self._n = reader, tag, reader.description, 0

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], object]) -> float | None:
        self._n += 1
        before = client.save_state(f"{self.tag}-norm{self._n}-before").result().path
        apply_update()
        after = client.save_state(f"{self.tag}-norm{self._n}-after").result().path
        return update_norm_from_tensors(self.reader.adapter(before), self.reader.adapter(after))


def planned_lr_on_setup_client(update_norm: UpdateNormMeasure, multipliers: Sequence[float]) -> bool:
    """Whether the planned LR's scaling probe is the setup client's update 1 (no client of its own):
    only with a measure that cannot leave that client waiting on a refused request (it still has
    the restore probe to run); otherwise every LR gets its own client."""
    return any(float(m) == 1.0 for m in multipliers) and bool(getattr(update_norm, "safe_on_a_working_client", False))


@dataclass(frozen=True)
class ProbeRun:
    """What every probe of one preflight shares."""

    sc: tinker.ServiceClient
    checkpoint: str
    batch: list[tinker.Datum]
    rec: Recorder
    call: CallWrapper
    say: Callable[[str], None]


def adam_params(cfg: Mapping[str, float], lr: float | None = None) -> tinker.AdamParams:
    """AdamParams from an arm's optimizer_config (keys AdamParams has), at `lr` if given."""
    kw = {k: float(v) for k, v in cfg.items() if k in tinker.AdamParams.model_fields}
    if lr is not None:
        kw["learning_rate"] = float(lr)
    return tinker.AdamParams(**kw)


def fixed_gradient_step(
    client: tinker.TrainingClient, batch: Sequence[tinker.Datum], adam: tinker.AdamParams
) -> tinker.OptimStepResponse:
    """One fixed-gradient update: cross-entropy on fixed weights, then optim_step."""
    fb = client.forward_backward(list(batch), "cross_entropy")
    opt = client.optim_step(adam)
    fb.result()
    return opt.result()


def reweighted(batch: Sequence[tinker.Datum], scale: float, keep: Callable[[int], bool]) -> list[tinker.Datum]:
    """The batch with weights scaled on kept datums and zeroed elsewhere (a fixed gradient)."""
    out = []
    for i, d in enumerate(batch):
        _, targets_T, mask_T = datum_arrays(d)
        w_T = (mask_T * np.float32(scale)) if keep(i) else np.zeros_like(mask_T)
        inputs = {"target_tokens": targets_T, "weights": w_T.astype(np.float32)}
        out.append(
            tinker.Datum(
                model_input=d.model_input,
                loss_fn_inputs={k: tinker.TensorData.from_numpy(v) for k, v in inputs.items()},
            )
        )
    return out


def probe_gradient(batch: Sequence[tinker.Datum]) -> list[tinker.Datum]:
    """The fixed gradient of the restore probe's update 1 and of every LR-scaling probe."""
    return reweighted(batch, 1.0, lambda i: i % 2 == 0)


def restore_probe(
    run: ProbeRun,
    uninterrupted: tinker.TrainingClient,
    opt_cfg: Mapping[str, float],
    tag: str,
    update_norm: UpdateNormMeasure | None = None,
) -> RestoreProbeResult:
    """Uninterrupted vs create-save-restore probe clients must agree after the same update.

    `uninterrupted` is a client in the initial state with nothing applied (the setup client that
    saved the initial checkpoint, or a fresh client from it). Two different fixed gradients (even /
    odd datums) are used so that a restore that dropped the Adam moments would give a different
    second update (with one repeated gradient a fresh Adam and a continued one take the same
    bias-corrected step, and the check could not fail). With `update_norm`, update 1 is also the
    LR-scaling probe at the planned LR (`base_lr_update_norm`).
    """
    adam, batch, rec, atol = adam_params(opt_cfg), run.batch, run.rec, LOGPROB_ATOL
    run.say("4/6: probe update 1 on the uninterrupted client")
    done: list[tinker.OptimStepResponse] = []
    update1 = partial(fixed_gradient_step, uninterrupted, probe_gradient(batch), adam)
    norm1 = None if update_norm is None else update_norm(uninterrupted, lambda: done.append(update1()))
    # without a measure, or one that never applied the update, it is applied here, unmeasured
    opt1 = done[0] if done else update1()
    echo_ref = rec.keep("probe_optim_step_1", opt1)
    mid = uninterrupted.save_state(f"{tag}-probe-after-update1").result()
    rec.keep("probe_save_mid", mid)
    r = run.call(lambda: restore(run.sc, mid.path, f"restore probe ({tag})"))
    describe_client(run.sc, r.client, "restore probe: created from the uninterrupted probe's mid save")
    rec.keep("probe_load_mid", r.response)
    rec.keep("probe_load_mid.get_info", r.info)
    run.say("4/6: probe update 2 on both clients, then logprobs compared")
    g2 = reweighted(batch, 1.0, lambda i: i % 2 == 1)
    before = full_logprobs(uninterrupted, batch)
    opts = {"update2_uninterrupted": fixed_gradient_step(uninterrupted, g2, adam)}
    opts["update2_restored"] = fixed_gradient_step(r.client, g2, adam)
    for k, v in opts.items():
        rec.keep(f"probe_optim_step_2_{k.removeprefix('update2_')}", v)
    after_u = full_logprobs(uninterrupted, batch)
    cmp = compare_logprobs(after_u, full_logprobs(r.client, batch), atol)
    effect = compare_logprobs(before, after_u, atol)
    failures: list[str] = []
    if r.loaded_path != mid.path:
        failures.append(f"probe restore: server load response path {r.loaded_path!r} != saved {mid.path!r}")
    if not cmp["within_tolerance"]:
        failures.append(f"restored probe update differs from uninterrupted: max |diff| {cmp['max_abs_diff']} > {atol}")
    if effect["within_tolerance"]:  # too small to tell a lost update from a matching one
        failures.append(
            f"probe update changed logprobs by only {effect['max_abs_diff']} <= {atol}: "
            "the restore comparison cannot tell a lost update from a matching one"
        )
    return RestoreProbeResult(
        initial_checkpoint=run.checkpoint,
        mid_checkpoint=mid.path,
        loaded_checkpoint_uri=r.loaded_path,
        adam_params=adam.model_dump(),
        restored_vs_uninterrupted=as_object(cmp),
        second_update_effect=as_object(effect),
        optim_metrics={k: dict(v.metrics or {}) for k, v in {"update1": opt1, **opts}.items()},
        echoed_config=echoed_config(opt1.metrics, list(opt_cfg)),
        echo_ref=echo_ref,
        base_lr_update_norm=norm1,
        failures=failures,
    )


def lr_scaling_probe(
    run: ProbeRun,
    opt_cfg: Mapping[str, float],
    multipliers: Sequence[float],
    update_norm: UpdateNormMeasure,
    measured: Mapping[float, float | None] | None = None,
) -> LrScalingBlock:
    """A fresh state from the initial checkpoint per LR, the same fixed gradient, update norms.

    `measured`: LRs already probed (the restore probe's update 1, at the planned LR; None: that
    measure failed, and no client is created). Adam's first step is ~ lr * sign(g), so
    update_norm / lr should be the same at every LR, checked against the first probe."""
    lrs = [float(opt_cfg["learning_rate"]) * float(m) for m in multipliers]

    def unavailable() -> LrScalingUnavailable:  # why: the measure's last error, read when it failed
        return LrScalingUnavailable(
            f"{update_norm.description}: {getattr(update_norm, 'last_error', None) or 'no measurement'}", lrs
        )

    norms = dict(measured or {})
    if None in norms.values():
        return unavailable()
    g = probe_gradient(run.batch)
    for i, lr in enumerate(lrs, start=1):
        if lr in norms:
            run.say(f"6/6: LR probe {i}/{len(lrs)} at lr {lr:g}: measured by the restore probe's update 1")
            continue
        run.say(f"6/6: LR probe {i}/{len(lrs)} at lr {lr:g}")
        client, _ = run.call(lambda: create_from_state_with_response(run.sc, run.checkpoint))
        describe_client(run.sc, client, f"LR-scaling probe at lr {lr:g} (fresh from the initial checkpoint)")
        norms[lr] = update_norm(client, partial(fixed_gradient_step, client, g, adam_params(opt_cfg, lr)))
        if norms[lr] is None:
            return unavailable()
    probes = [{"learning_rate": lr, "update_norm": float(n)} for lr in lrs if (n := norms[lr]) is not None]
    errors = lr_scaling_error(probes)
    worst = max(errors)
    passed = bool(all(p["update_norm"] > 0 for p in probes) and worst <= LR_SCALING_RTOL)
    problem = None if passed else "an update norm is zero: the update did not move parameters"
    if worst > LR_SCALING_RTOL:
        problem = f"update_norm/LR changes by {worst:.3g} relative to the first probe (> {LR_SCALING_RTOL})"
    reset = (
        "a fresh state from the initial checkpoint per probe: the setup client that saved it (nothing applied "
        "before; the restore probe's update 1) at the planned LR, a client created from it with optimizer at "
        "every other LR"
        if measured
        else "a client created from the initial checkpoint with optimizer per probe"
    )
    return LrScalingMeasured(
        measure=update_norm.description,
        reset=reset,
        gradient="cross_entropy on the even fixed-batch datums (the restore probe's update 1)",
        lr_scaling=probes,
        relative_error=[e if math.isfinite(e) else None for e in errors],
        rtol=LR_SCALING_RTOL,
        passed=passed,
        problem=problem,
    )


def attach_lr_scaling(correctness_block: JsonObject, lr_block: LrScalingBlock) -> JsonObject:
    """The correctness_preflight block with every path's `lr_scaling` filled from the LR probe
    (unmeasured: an entry per planned LR with `update_norm: null` and the reason, never [])."""
    out, written = json.loads(json.dumps(correctness_block)), lr_block.to_json()
    keys: tuple[str, ...] = ("reason",)
    if isinstance(lr_block, LrScalingMeasured):
        keys, entries = ("passed", "rtol", "relative_error", "measure", "reset"), written["lr_scaling"]
    else:  # one entry per planned LR: unmeasured, with the exact reason (never [])
        unmeasured: JsonObject = {"update_norm": None, "available": False, "reason": lr_block.reason}
        entries = [{"learning_rate": lr, **unmeasured} for lr in lr_block.learning_rates]
    status = {"available": lr_block.available, "evidence_ref": LR_SCALING_FILE, **{k: written[k] for k in keys}}
    for path in out.get("paths", []):
        path["lr_scaling"] = json.loads(json.dumps(entries))
        path["lr_scaling_status"] = status
    return out


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
    """The (single) initialization group's arms."""
    rp = spec.restoration_preflight
    if not rp.applicable:
        raise RestorationError("plan has no applicable restoration_preflight")
    if len(rp.groups) != 1:
        raise RestorationError(f"restoration_preflight needs exactly one group, got {len(rp.groups)}")
    arms = rp.groups[0].arms
    if len(arms) < 2:
        raise RestorationError("restoration_preflight group needs at least two arms")
    return list(arms)


def reference_completion(solution: str, reference: str) -> str:
    """A GSM8K worked solution as an assistant answer: calculator annotations dropped, the
    '#### N' line replaced by the boxed answer the cookbook's grader reads."""
    body = solution.split("####")[0]
    body = re.sub(r"<<[^>]*>>", "", body).strip()
    return f"{body} \\boxed{{{reference}}}"


def build_fixed_batch(
    n_items: int = FIXED_BATCH_ITEMS, seed: int = 0, dataset_name: str = "gsm8k"
) -> tuple[list[tinker.Datum], JsonObject]:
    """The first `n_items` train items of the plan's dataset (cookbook order, `seed`) rendered with
    their reference solutions as the assistant targets (weight 1 on the answer's tokens, 0 on the
    prompt), and a description (item ids, lengths) for evidence."""
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
    seed: int,
    tag: str,
    rec: Recorder,
    call: CallWrapper,
) -> InitialCheckpoint:
    """Step 1: a fresh LoRA client saves the immutable initial checkpoint.

    No per-model seed is sent: Spindle's multi-LoRA backend refuses one ("Miles multi-LoRA does not
    support per-model seeds"); every arm is proved to start from this one saved state by its
    observed load. The setup client lives on the probe ServiceClient, released with it."""
    client = call(lambda: probe_sc.create_lora_training_client(base_model=base_model, rank=rank))
    name_client(client, "setup client (shared)")
    describe_client(
        probe_sc,
        client,
        f"setup (shared, initialization group of seed {seed}): saves the initial checkpoint; then the "
        "uninterrupted restore probe and the base-LR scaling probe",
    )
    rec.keep("create_shared.get_info", info := client.get_info())
    name = f"{tag}-initial-shared"
    rec.keep("save_shared", saved := client.save_state(name).result())
    # Immutability: the server must explicitly refuse to replace the name without overwrite=True.
    try:
        again = client.save_state(name).result()
    except Exception as exc:
        immutable, reason = duplicate_save_outcome(exc, name)
        rec.keep(
            "save_shared_again_refused" if immutable else "save_shared_again_failed",
            {"error": f"{type(exc).__name__}: {exc}", "checkpoint_immutable": immutable, "reason": reason},
        )
    else:
        immutable, reason = duplicate_save_outcome(None, name)
        rec.keep("save_shared_again", again)
    return InitialCheckpoint(client, saved.path, immutable, reason, info)


def adapter_hashes(
    reader: LocalCheckpointReader | None, arms: Mapping[str, Restore], tag: str, rec: Recorder
) -> tuple[dict[str, str | None], str, list[str]]:
    """Each arm's adapter sha256 as loaded (local backend: a save of each arm read back; else None),
    how it was measured, and every arm whose adapter differs from its checkpoint's."""
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
    arms: Mapping[str, Restore], fixed_batch: Sequence[tinker.Datum], source: Sequence[np.ndarray] | None = None
) -> tuple[dict[str, list[np.ndarray]], dict[str, str], JsonObject, list[str]]:
    """Step 3: each arm's logprobs on the fixed batch before any update (a single arm's with
    `source`, the setup client's, so the check can still fail), their sha256, the comparisons with
    the first and every pair outside the tolerance."""
    stored = {a: full_logprobs(r.client, fixed_batch) for a, r in arms.items()}
    out_sha = {a: logprobs_sha256(lp) for a, lp in stored.items()}
    if source is not None:
        stored[SOURCE_OUTPUT_KEY] = list(source)
    first, *others = stored
    cmp: JsonObject = {}
    failures: list[str] = []
    for other in others:
        c = compare_logprobs(stored[first], stored[other], LOGPROB_ATOL)
        cmp[f"{first}_vs_{other}"] = as_object(c)
        if not c["within_tolerance"]:
            failures.append(
                f"initial logprobs differ between {first} and {other}: max |diff| "
                f"{c['max_abs_diff']} > {LOGPROB_ATOL}" + (f" ({c['problem']})" if "problem" in c else "")
            )
    return stored, out_sha, cmp, failures


def run_restoration_preflight(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    *,
    base_model: str = constants.BASE_MODEL,
    fixed_batch: Sequence[tinker.Datum] | None = None,
    fixed_batch_description: JsonObject | None = None,
    lr_multipliers: Sequence[float] = DEFAULT_LR_MULTIPLIERS,
    local_run_dir: Path | None = None,
    probe_service_client: tinker.ServiceClient | None = None,
    capacity: WaitPolicy | None = None,
    registry: ClientRegistry | None = None,
    progress: Callable[[str], None] | None = None,
) -> RestorationResult:
    """Run the restoration preflight for the initialization group of the plan's spec (a diagnostic's:
    its original plan's). The arms that train (a diagnostic's treatment arm, else all) get a client
    and a provenance entry, the others are listed under `excluded_arms` (one trained arm is compared
    with the setup client);
    `local_run_dir` (the embedded server's) is where adapter_sha256 and the LR-scaling norms are read,
    elsewhere the norms are read back through the SDK; `probe_service_client` holds the setup and
    probe clients, so the caller can release them; `capacity`/`registry` retry every client-creating
    call on a capacity refusal; `progress` gets a line at every step."""
    t0 = time.monotonic()

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"[preflight] restoration {msg} ({time.monotonic() - t0:.0f}s)")

    run = plan.spec_plan.spec_run
    group = [a.name for a in restoration_arms(plan.spec_plan.experiment)]
    diagnostic = plan.kind == "bounded_diagnostic"  # it trains its treatment arm only, an arm of the group
    trained = [run.arm(a) for a in group if not diagnostic or a == plan.diagnostic.fixed_settings.treatment.arm]
    names, cfgs = [a.name for a in trained], {a.name: a.adam_config_requested() for a in trained}
    if len({a.seed for a in trained}) > 1:
        seeds = {a.name: a.seed for a in run.arms}
        raise RestorationError(f"arms in one initialization group have different seeds: {seeds}")
    seed = trained[0].seed
    tag = re.sub(r"[^A-Za-z0-9._-]", "-", str(bundle.run_id or uuid.uuid4().hex[:12]))[:64]  # names its saves
    if fixed_batch is None:
        fixed_batch, fixed_batch_description = build_fixed_batch(seed=seed, dataset_name=run.dataset)
    batch = list(fixed_batch)
    if len(batch) < 2:
        raise RestorationError("fixed batch needs at least 2 datums (two distinct fixed gradients)")
    b_sha = batch_sha256(batch)
    retry = partial(call_with_capacity_retry, policy=capacity, registry=registry)
    call: CallWrapper = retry if capacity is not None else (lambda fn: fn())
    rec, probe_sc = Recorder(), probe_service_client or service_client

    say(f"1/6: fresh LoRA rank-{run.lora_rank} client on {base_model} and the shared initial checkpoint")
    shared = fresh_checkpoint(probe_sc, base_model, run.lora_rank, seed, tag, rec, call)
    prun = ProbeRun(probe_sc, shared.path, batch, rec, call, say)
    bundle.add_checkpoint("initial", 0, shared.path)
    # before its first update, the setup client's output is what one loaded arm is compared with
    source_lp = full_logprobs(shared.client, batch) if len(names) == 1 else None

    loaded: dict[str, Restore] = {}
    for i, a in enumerate(names, start=1):
        say(f"2/6: loading arm {a} ({i}/{len(names)}) from {shared.path} with optimizer")
        loaded[a] = call(partial(restore, service_client, shared.path, a))
        describe_client(service_client, loaded[a].client, f"arm {a}: loaded from the initial checkpoint with optimizer")
        rec.keep(f"load_{a}", loaded[a].response)
        rec.keep(f"load_{a}.get_info", loaded[a].info)
    reader = None if local_run_dir is None else LocalCheckpointReader(local_run_dir)
    adapters, adapter_method, failures = adapter_hashes(reader, loaded, tag, rec)
    say(f"3/6: initial logprobs of {len(names)} arms on the fixed batch ({len(batch)} datums)")
    stored, out_sha, comparison, output_failures = initial_outputs(loaded, batch, source=source_lp)
    failures += output_failures

    # Step 4: the setup client (uninterrupted) vs a create-save-restore client on the first trained
    # arm's config; update 1 is also the LR probe at the planned LR. Each other optimizer config
    # gets its own probe from a fresh client, so every arm's checks compare with its OWN echo.
    opt_cfg = cfgs[names[0]]
    update_norm: UpdateNormMeasure = (
        ExternalWeightsUpdateNorm(probe_sc.create_rest_client)
        if reader is None
        else CheckpointUpdateNorm(reader, f"{tag}-lr")
    )
    in_plan = update_norm if planned_lr_on_setup_client(update_norm, lr_multipliers) else None
    say("4/6: create-save-restore probe (uninterrupted setup client vs restored client, 2 fixed-gradient updates)")
    probe = restore_probe(prun, shared.client, opt_cfg, tag, update_norm=in_plan)
    probes = {names[0]: probe}
    for a in names[1:]:
        same = next((p for b, p in probes.items() if cfgs[b] == cfgs[a]), None)
        if same is None:
            say(f"4/6: create-save-restore probe again for arm {a} (its own optimizer config)")
            client, _ = call(partial(create_from_state_with_response, probe_sc, shared.path, f"probe-{a}"))
            describe_client(probe_sc, client, f"restore probe of arm {a}'s config: fresh from the initial checkpoint")
            same = restore_probe(replace(prun, rec=rec.prefixed(f"{a}:")), client, cfgs[a], f"{tag}-{a}")
            same.echo_observed_on = same.uninterrupted_client = (
                f"a fresh client from the initial checkpoint, nothing applied before update 1 (arm {a}'s config)"
            )
            probe.own_config_probes[a] = same  # written with the step-4 probe
        probes[a] = same
    failures += probe.failures + [f"{a}: {m}" for a, r in probe.own_config_probes.items() for m in r.failures]

    say("5/6: optimizer checks and initialization provenance")
    arms: dict[str, ArmProvenance] = {}
    for arm in trained:  # optimizer checks at creation (0) and restore (1), against its own config's echo
        a, p = arm.name, probes[arm.name]
        check = partial(
            optimizer_check,
            requested_optimizer=arm.optimizer,
            requested_config=cfgs[a],
            echoed=p.echoed_config or None,
            echo_ref=p.echo_ref,
            echo_observed_on=p.echo_observed_on,
        )
        init: JsonObject = {
            "base_checkpoint": base_model,
            "checkpoint_uri": shared.path,
            "checkpoint_immutable": shared.immutable,  # None: the duplicate save proved nothing
            "checkpoint_scope": "full_initialization",
            "loaded_checkpoint_uri": loaded[a].loaded_path,
            "load_succeeded": True,  # the service answered the load (what it loaded is checked by its path)
            "source": "server_response",
            "evidence_ref": load_ref(a),
            "before_first_update": True,
            "checkpoint_immutable_reason": shared.immutable_reason,
        }
        if adapters[a] is not None:
            init["adapter_sha256"] = adapters[a]
        arms[a] = {
            "initialization": init,
            "restore_count": 1,
            "optimizer_checks": [
                as_object(
                    check(after_restore=0, info=shared.info, info_ref=f"{RESPONSES_FILE}#create_shared.get_info")
                ),
                as_object(check(after_restore=1, info=loaded[a].info, info_ref=f"{load_ref(a)}.get_info")),
            ],
            "initial_output": {
                "available": True,
                "batch_sha256": b_sha,
                "output_sha256": out_sha[a],
                "evidence_ref": INITIAL_OUTPUT_FILE,
                "before_first_update": True,
            },
        }
    failures += check_provenance(arms)

    say(
        f"6/6: LR-scaling probe ({len(lr_multipliers)} learning rates, a fresh state each"
        + ("; the planned one is the probe's update 1 on the setup client)" if in_plan else ")")
    )
    measured = {float(opt_cfg["learning_rate"]): probe.base_lr_update_norm} if in_plan else None
    lr_block = lr_scaling_probe(prun, opt_cfg, lr_multipliers, update_norm, measured)
    if isinstance(lr_block, LrScalingMeasured) and not lr_block.passed:
        failures.append(f"LR scaling: {lr_block.problem}")
    say(f"{'passed' if not failures else 'FAILED'}" + (f": {len(failures)} problem(s)" if failures else ""))
    excluded = {a: EXCLUDED_REASON for a in group if a not in names}  # a diagnostic's other arms
    provenance: InitializationProvenance = {"version": 1, "arms": arms}
    if excluded:
        provenance["excluded_arms"] = excluded
    provenance["group"] = {
        "arms": list(names),
        "initial_checkpoint": shared.path,
        "initial_output_comparison": comparison,
        "adapter_sha256_method": adapter_method,
        "restore_probe": PROBE_FILE,
        "server_responses": RESPONSES_FILE,
    }
    provenance["passed"], provenance["failures"] = not failures, list(failures)
    return RestorationResult(
        initial_checkpoint=shared.path,
        loaded=loaded,
        fixed_batch=batch,
        batch_sha256=b_sha,
        output_sha256=out_sha,
        provenance=provenance,
        failures=failures,
        lr_scaling=lr_block,
        probe=probe,
        wall_seconds=time.monotonic() - t0,
        batch_description=fixed_batch_description,
        initial_logprobs=stored,
        responses=rec.responses,
    )

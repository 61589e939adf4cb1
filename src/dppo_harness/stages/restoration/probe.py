"""The restoration probes (`restore_probe`, `lr_scaling_probe`), the one fixed-gradient update they
all apply, and the update-norm measures the LR probe reads (`UpdateNormMeasure`; on the local
backend `CheckpointUpdateNorm` through `LocalCheckpointReader`; the Tinker API exposes no
parameters, so other backends bring their own measure or none). `attach_lr_scaling` fills every
correctness path's `lr_scaling` from the LR probe's block.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import tinker

from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.loss.correctness import lr_scaling_error
from dppo_harness.service.observed import create_from_state_with_response, describe_client
from dppo_harness.stages.restoration.records import (
    LR_SCALING_FILE,
    LrScalingBlock,
    LrScalingMeasured,
    LrScalingUnavailable,
    Recorder,
    RestoreProbeResult,
)
from dppo_harness.train.clients import RestorationError, datum_arrays, full_logprobs
from dppo_harness.train.fingerprints import LOGPROB_ATOL, compare_logprobs
from dppo_harness.train.optimizer_checks import echoed_config
from dppo_harness.train.restore import restore

if TYPE_CHECKING:
    import torch

CallWrapper = Callable[[Callable[[], Any]], Any]  # wraps every client-creating call (e.g. a capacity retry)
LR_SCALING_RTOL = 0.05  # |(norm/lr) / (norm0/lr0) - 1| allowed; Adam's first step is ~lr * sign(g)
DEFAULT_LR_MULTIPLIERS = (0.5, 1.0, 2.0)
NO_UPDATE_NORM = (
    "the Tinker API exposes neither parameters nor an update-norm metric (optim_step reports "
    "the gradient norm only), so update norms cannot be measured on this backend"
)


class UpdateNormMeasure(Protocol):
    """Measures ||theta_after - theta_before|| around `apply_update()` on `client`, or None.

    A measure whose own requests can be refused (e.g. a service without external weights) must
    not run on a client that has more work to do: the SDK numbers each client's requests, and one
    refused at submit leaves a gap the server waits on before running that client's next request.
    `safe_on_a_working_client` says the measure's requests cannot be refused that way."""

    description: str

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], object]) -> float | None: ...


class LocalCheckpointReader:
    """Adapter tensors of the checkpoints the embedded server wrote under its run_dir: their hash and
    the distance between two. Local backend only (the Tinker API exposes no parameters); torch and
    the embedded server's model module load on the first read, so another backend loads neither."""

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
        if f is None:
            raise RestorationError(f"not a checkpoint path: {path!r}")
        if not f.is_file():
            raise RestorationError(f"checkpoint {path!r} has no adapter file at {f}")
        return torch.load(f, map_location="cpu", weights_only=True)

    def adapter_sha256(self, path: str) -> str:
        """sha256 over names, dtypes, shapes and raw bytes of the adapter, sorted by name."""
        from dppo_harness.local_server.engine.model import state_sha256  # local backend only

        return state_sha256(self.adapter(path))

    def update_norm(self, before: str, after: str) -> float:
        """||theta_after - theta_before|| over all LoRA parameters, in float64."""
        a, b = self.adapter(before), self.adapter(after)
        if sorted(a) != sorted(b):
            raise RestorationError("checkpoints have different parameter names")
        return math.sqrt(sum(float(((b[k].double() - a[k].double()) ** 2).sum()) for k in a))


class CheckpointUpdateNorm:
    """UpdateNormMeasure via save_state before and after the update (local backend)."""

    safe_on_a_working_client = True  # save_state only: a request every backend serves

    def __init__(self, reader: LocalCheckpointReader, tag: str):
        self.reader, self.tag, self.description = reader, tag, reader.description
        self._n = 0

    def __call__(self, client: tinker.TrainingClient, apply_update: Callable[[], object]) -> float | None:
        self._n += 1
        before = client.save_state(f"{self.tag}-norm{self._n}-before").result().path
        apply_update()
        after = client.save_state(f"{self.tag}-norm{self._n}-after").result().path
        return self.reader.update_norm(before, after)


def planned_lr_on_setup_client(update_norm: UpdateNormMeasure | None, multipliers: Sequence[float]) -> bool:
    """Whether the planned LR's scaling probe is the setup client's update 1 (no client of its own):
    only with a measure that cannot leave that client waiting on a refused request (it still has
    the restore probe to run); otherwise every LR gets its own client."""
    return (
        update_norm is not None
        and any(float(m) == 1.0 for m in multipliers)
        and bool(getattr(update_norm, "safe_on_a_working_client", False))
    )


@dataclass(frozen=True)
class ProbeRun:
    """What every probe of one preflight shares: the ServiceClient its clients live on, the fixed
    batch, the kept responses, the tolerance, how client-creating calls are made, the progress line."""

    sc: tinker.ServiceClient
    batch: list[tinker.Datum]
    rec: Recorder
    call: CallWrapper
    say: Callable[[str], None] = lambda _m: None
    restore_with_optimizer: bool = True  # False only in failure-path tests: the probes restore weights only


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
        out.append(
            tinker.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_numpy(targets_T),
                    "weights": tinker.TensorData.from_numpy(w_T.astype(np.float32)),
                },
            )
        )
    return out


def probe_gradient(batch: Sequence[tinker.Datum]) -> list[tinker.Datum]:
    """The fixed gradient of the restore probe's update 1 and of every LR-scaling probe."""
    return reweighted(batch, 1.0, lambda i: i % 2 == 0)


def restore_probe(
    run: ProbeRun,
    uninterrupted: tinker.TrainingClient,
    initial_checkpoint: str,
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
    g1, g2 = probe_gradient(batch), reweighted(batch, 1.0, lambda i: i % 2 == 1)
    run.say("4/6: probe update 1 on the uninterrupted client")
    norm1 = None
    if update_norm is None:
        opt1 = fixed_gradient_step(uninterrupted, g1, adam)
    else:
        done: dict[str, tinker.OptimStepResponse] = {}
        norm1 = update_norm(uninterrupted, lambda: done.setdefault("opt", fixed_gradient_step(uninterrupted, g1, adam)))
        # a measure that never applied the update leaves it to be applied here, unmeasured
        opt1 = done["opt"] if "opt" in done else fixed_gradient_step(uninterrupted, g1, adam)
    echo_ref = rec.keep("probe_optim_step_1", opt1)
    mid = uninterrupted.save_state(f"{tag}-probe-after-update1").result()
    rec.keep("probe_save_mid", mid)
    if run.restore_with_optimizer:
        r = run.call(lambda: restore(run.sc, mid.path, f"restore probe ({tag})"))
        restored, resp, info = r.client, r.response, r.info
    else:  # failure-path tests only: a restore that drops the Adam moments must be caught
        restored = run.call(lambda: run.sc.create_training_client_from_state(mid.path))
        resp, info = tinker.types.LoadWeightsResponse(path=mid.path), restored.get_info()
    describe_client(run.sc, restored, "restore probe: created from the uninterrupted probe's mid save")
    rec.keep("probe_load_mid", resp)
    rec.keep("probe_load_mid.get_info", info)
    run.say("4/6: probe update 2 on both clients, then logprobs compared")
    before = full_logprobs(uninterrupted, batch)
    opt2_u = fixed_gradient_step(uninterrupted, g2, adam)
    opt2_r = fixed_gradient_step(restored, g2, adam)
    rec.keep("probe_optim_step_2_uninterrupted", opt2_u)
    rec.keep("probe_optim_step_2_restored", opt2_r)
    after_u = full_logprobs(uninterrupted, batch)
    cmp = compare_logprobs(after_u, full_logprobs(restored, batch), atol)
    effect = compare_logprobs(before, after_u, atol)
    failures: list[str] = []
    if resp.path != mid.path:
        failures.append(f"probe restore: server load response path {resp.path!r} != saved {mid.path!r}")
    if not cmp["within_tolerance"]:
        failures.append(f"restored probe update differs from uninterrupted: max |diff| {cmp['max_abs_diff']} > {atol}")
    if effect["within_tolerance"]:  # too small to tell a lost update from a matching one
        failures.append(
            f"probe update changed logprobs by only {effect['max_abs_diff']} <= {atol}: "
            "the restore comparison cannot tell a lost update from a matching one"
        )
    return RestoreProbeResult(
        initial_checkpoint=initial_checkpoint,
        mid_checkpoint=mid.path,
        loaded_checkpoint_uri=resp.path,
        adam_params=adam.model_dump(),
        restored_vs_uninterrupted=as_object(cmp),
        second_update_effect=as_object(effect),
        optim_metrics={
            "update1": dict(opt1.metrics or {}),
            "update2_uninterrupted": dict(opt2_u.metrics or {}),
            "update2_restored": dict(opt2_r.metrics or {}),
        },
        echoed_config=echoed_config(opt1.metrics, list(opt_cfg)),
        echo_ref=echo_ref,
        base_lr_update_norm=norm1,
        failures=failures,
    )


def lr_scaling_probe(
    run: ProbeRun,
    initial_checkpoint: str,
    opt_cfg: Mapping[str, float],
    multipliers: Sequence[float],
    update_norm: UpdateNormMeasure | None,
    measured: Mapping[float, float | None] | None = None,
) -> LrScalingBlock:
    """A fresh state from the initial checkpoint per LR, the same fixed gradient, update norms.

    `measured`: LRs already probed from a fresh state (the restore probe's update 1 on the setup
    client, at the planned LR); None there means that measure failed, and no further client is
    created. Every other LR gets its own client created from the initial checkpoint with optimizer.
    Adam's first step is lr * m_hat / (sqrt(v_hat) + eps) ~ lr * sign(g), so update_norm / lr
    should be the same at every LR; the relative change against the first probe is checked.
    """
    base_lr = float(opt_cfg["learning_rate"])
    lrs = [base_lr * float(m) for m in multipliers]
    if update_norm is None:
        return LrScalingUnavailable(NO_UPDATE_NORM, lrs)

    def unavailable() -> LrScalingUnavailable:  # why: the measure's last error, read when it failed
        return LrScalingUnavailable(
            f"{update_norm.description}: {getattr(update_norm, 'last_error', None) or 'no measurement'}", lrs
        )

    if any(v is None for v in (measured or {}).values()):
        return unavailable()
    g = probe_gradient(run.batch)
    norms: dict[float, float] = {lr: float(v) for lr, v in (measured or {}).items() if v is not None}
    for i, lr in enumerate(lrs, start=1):
        if lr in norms:
            run.say(f"6/6: LR probe {i}/{len(lrs)} at lr {lr:g}: measured by the restore probe's update 1")
            continue
        run.say(f"6/6: LR probe {i}/{len(lrs)} at lr {lr:g}")
        client, _ = run.call(lambda: create_from_state_with_response(run.sc, initial_checkpoint))
        describe_client(run.sc, client, f"LR-scaling probe at lr {lr:g} (fresh from the initial checkpoint)")
        norm = update_norm(client, partial(fixed_gradient_step, client, g, adam_params(opt_cfg, lr)))
        if norm is None:
            return unavailable()
        norms[lr] = float(norm)
    probes: list[dict[str, float]] = [{"learning_rate": lr, "update_norm": norms[lr]} for lr in lrs]
    errors = lr_scaling_error(probes)
    worst = max(errors)
    passed = bool(all(p["update_norm"] > 0 for p in probes) and worst <= LR_SCALING_RTOL)
    problem = (
        None
        if passed
        else f"update_norm/LR changes by {worst:.3g} relative to the first probe (> {LR_SCALING_RTOL})"
        if worst > LR_SCALING_RTOL
        else "an update norm is zero: the update did not move parameters"
    )
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
    """The correctness_preflight block with every path's `lr_scaling` filled from the LR probe.

    Where the backend could not measure update norms, each planned LR gets an entry with
    `update_norm: null`, `available: false` and the reason (never invented, never an empty list),
    and `lr_scaling_status` says why.
    """
    out = json.loads(json.dumps(correctness_block))
    status: JsonObject = {"available": lr_block.available, "evidence_ref": LR_SCALING_FILE}
    if isinstance(lr_block, LrScalingMeasured):
        status.update(
            passed=lr_block.passed,
            rtol=lr_block.rtol,
            relative_error=None if lr_block.relative_error is None else list(lr_block.relative_error),
            measure=lr_block.measure,
            reset=lr_block.reset,
        )
        entries: list[JsonObject] = [dict(p) for p in lr_block.lr_scaling]
    else:  # one entry per planned LR: unmeasured, with the exact reason (never [])
        reason = lr_block.reason or "not measured"
        entries = [
            {"learning_rate": float(lr), "update_norm": None, "available": False, "reason": reason}
            for lr in lr_block.learning_rates
        ] or [{"learning_rate": None, "update_norm": None, "available": False, "reason": reason}]
        status["reason"] = lr_block.reason
    for path in out.get("paths", []):
        path["lr_scaling"] = json.loads(json.dumps(entries))
        path["lr_scaling_status"] = status
    return out

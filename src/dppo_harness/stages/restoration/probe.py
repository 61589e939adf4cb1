"""The create-save-restore probe: a restored client must update exactly as the uninterrupted one.

The contract: `restore_probe` applies two different fixed-gradient updates (even, then odd
datums) to the uninterrupted setup client, restores a second client from its save after update 1
and applies update 2 to both; their logprobs must agree within the tolerance, and update 2 must
move the logprobs at all (else the check could not fail). `fixed_gradient_step` is the one
cross-entropy + optim_step update every restoration probe applies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import tinker

from dppo_harness.json_types import as_object
from dppo_harness.service.observed import create_from_state_with_response, describe_client
from dppo_harness.stages.restoration.records import RestoreProbeResult
from dppo_harness.stages.restoration.update_norm import UpdateNormMeasure
from dppo_harness.train.clients import datum_arrays, full_logprobs
from dppo_harness.train.fingerprints import LogprobComparison, compare_logprobs
from dppo_harness.train.optimizer_checks import echoed_config

CallWrapper = Callable[[Callable[[], Any]], Any]  # wraps every client-creating call (e.g. a capacity retry)


class KeepsResponses(Protocol):
    """Keeps a server response for evidence and returns its reference id."""

    def keep(self, ref: str, obj: object) -> str: ...


@dataclass
class PrefixedResponses:
    """Keeps responses in `rec` under `prefix` (one more probe's, without clashing with the first's)."""

    rec: KeepsResponses
    prefix: str

    def keep(self, ref: str, obj: object) -> str:
        return self.rec.keep(f"{self.prefix}{ref}", obj)


def adam_params(cfg: Mapping[str, float], lr: float | None = None) -> tinker.AdamParams:
    """AdamParams from an arm's optimizer_config (keys AdamParams has), at `lr` if given."""
    kw = {k: float(v) for k, v in cfg.items() if k in tinker.AdamParams.model_fields}
    if lr is not None:
        kw["learning_rate"] = float(lr)
    return tinker.AdamParams(**kw)


def fixed_gradient_step(
    client: tinker.TrainingClient,
    batch: Sequence[tinker.Datum],
    adam: tinker.AdamParams,
) -> tuple[tinker.ForwardBackwardOutput, tinker.OptimStepResponse]:
    """One fixed-gradient update: cross-entropy on fixed weights, then optim_step."""
    fb = client.forward_backward(list(batch), "cross_entropy")
    opt = client.optim_step(adam)
    return fb.result(), opt.result()


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


def _measured_first_update(
    client: tinker.TrainingClient,
    gradient: Sequence[tinker.Datum],
    adam: tinker.AdamParams,
    update_norm: UpdateNormMeasure | None,
) -> tuple[tinker.OptimStepResponse, float | None]:
    """Update 1 on the uninterrupted client, with its update norm when `update_norm` is given
    (the LR-scaling probe at the planned LR); a measure that never applied the update leaves it
    to be applied here, unmeasured."""
    if update_norm is None:
        return fixed_gradient_step(client, gradient, adam)[1], None
    done: dict[str, tuple[tinker.ForwardBackwardOutput, tinker.OptimStepResponse]] = {}
    norm = update_norm(client, lambda: done.setdefault("step", fixed_gradient_step(client, gradient, adam)))
    _, opt = done["step"] if "step" in done else fixed_gradient_step(client, gradient, adam)  # weights unread: no norm
    return opt, norm


def _restored_client(
    service_client: tinker.ServiceClient, mid_path: str, call: CallWrapper, restore_optimizer: bool
) -> tuple[tinker.TrainingClient, tinker.types.LoadWeightsResponse]:
    """A client created from the uninterrupted client's mid save, with the server's load response."""
    if restore_optimizer:
        restored, resp = call(lambda: create_from_state_with_response(service_client, mid_path))
    else:  # failure-path tests only: a restore that drops the Adam moments must be caught
        restored = call(lambda: service_client.create_training_client_from_state(mid_path))
        resp = tinker.types.LoadWeightsResponse(path=mid_path)
    describe_client(service_client, restored, "restore probe: created from the uninterrupted probe's mid save")
    return restored, resp


def _probe_failures(
    resp: tinker.types.LoadWeightsResponse,
    mid_path: str,
    restored_vs_uninterrupted: LogprobComparison,
    second_update_effect: LogprobComparison,
    atol: float,
) -> list[str]:
    """What the probe proves wrong: the load, a restored update that differs, or an update 2 too
    small for the comparison to tell a lost update from a matching one."""
    failures: list[str] = []
    if resp.path != mid_path:
        failures.append(f"probe restore: server load response path {resp.path!r} != saved {mid_path!r}")
    cmp, effect = restored_vs_uninterrupted, second_update_effect
    if not cmp["within_tolerance"]:
        failures.append(f"restored probe update differs from uninterrupted: max |diff| {cmp['max_abs_diff']} > {atol}")
    if effect["within_tolerance"]:
        failures.append(
            f"probe update changed logprobs by only {effect['max_abs_diff']} <= {atol}: "
            "the restore comparison cannot tell a lost update from a matching one"
        )
    return failures


def restore_probe(
    service_client: tinker.ServiceClient,
    uninterrupted: tinker.TrainingClient,
    initial_checkpoint: str,
    batch: Sequence[tinker.Datum],
    opt_cfg: Mapping[str, float],
    tag: str,
    rec: KeepsResponses,
    atol: float,
    call: CallWrapper,
    restore_optimizer: bool = True,
    update_norm: UpdateNormMeasure | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> RestoreProbeResult:
    """Uninterrupted vs create-save-restore probe clients must agree after the same update.

    `uninterrupted` is the setup client that saved the initial checkpoint and has applied nothing
    since (the same state a fresh client from that checkpoint has). Two different fixed gradients
    (even / odd datums) are used so that a restore that dropped the Adam moments would give a
    different second update (with one repeated gradient a fresh Adam and a continued one take the
    same bias-corrected step, and the check could not fail). With `update_norm`, update 1 is also
    the LR-scaling probe at the planned LR (`base_lr_update_norm`).
    """
    adam = adam_params(opt_cfg)
    g1 = probe_gradient(batch)
    g2 = reweighted(batch, 1.0, lambda i: i % 2 == 1)
    say("4/6: probe update 1 on the uninterrupted client")
    opt1, norm1 = _measured_first_update(uninterrupted, g1, adam, update_norm)
    echo_ref = rec.keep("probe_optim_step_1", opt1)
    mid = uninterrupted.save_state(f"{tag}-probe-after-update1").result()
    rec.keep("probe_save_mid", mid)
    restored, resp = _restored_client(service_client, mid.path, call, restore_optimizer)
    rec.keep("probe_load_mid", resp)
    rec.keep("probe_load_mid.get_info", restored.get_info())
    say("4/6: probe update 2 on both clients, then logprobs compared")
    before = full_logprobs(uninterrupted, batch)
    _, opt2_u = fixed_gradient_step(uninterrupted, g2, adam)
    _, opt2_r = fixed_gradient_step(restored, g2, adam)
    rec.keep("probe_optim_step_2_uninterrupted", opt2_u)
    rec.keep("probe_optim_step_2_restored", opt2_r)
    after_u = full_logprobs(uninterrupted, batch)
    after_r = full_logprobs(restored, batch)
    cmp = compare_logprobs(after_u, after_r, atol)
    effect = compare_logprobs(before, after_u, atol)
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
        failures=_probe_failures(resp, mid.path, cmp, effect, atol),
    )

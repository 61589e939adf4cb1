"""The LR-scaling probe: the same fixed gradient from a fresh state per learning rate, update norm / LR.

The contract: Adam's first step is ~lr * sign(g), so update_norm / lr must be the same at every
learning rate within `LR_SCALING_RTOL`; where no update-norm measure exists on the backend the
block says `available: false` with the reason. `attach_lr_scaling` fills every correctness path's
`lr_scaling` from that block, unmeasured entries included (never invented, never an empty list).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import tinker

from dppo_harness.json_types import JsonObject
from dppo_harness.loss.correctness import lr_scaling_error
from dppo_harness.service.observed import create_from_state_with_response, describe_client
from dppo_harness.stages.restoration.probe import CallWrapper, adam_params, fixed_gradient_step, probe_gradient
from dppo_harness.stages.restoration.records import LrScalingBlock, LrScalingMeasured, LrScalingUnavailable
from dppo_harness.stages.restoration.update_norm import UpdateNormMeasure

LR_SCALING_RTOL = 0.05  # |(norm/lr) / (norm0/lr0) - 1| allowed; Adam's first step is ~lr * sign(g)
DEFAULT_LR_MULTIPLIERS = (0.5, 1.0, 2.0)
LR_SCALING_FILE = "lr-scaling-probe.json"


def lr_scaling_probe(
    service_client: tinker.ServiceClient,
    initial_checkpoint: str,
    batch: Sequence[tinker.Datum],
    opt_cfg: Mapping[str, float],
    multipliers: Sequence[float],
    rtol: float,
    update_norm: UpdateNormMeasure | None,
    unavailable_reason: str,
    call: CallWrapper | None = None,
    measured: Mapping[float, float | None] | None = None,
    say: Callable[[str], None] = lambda _m: None,
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
        return LrScalingUnavailable(unavailable_reason, lrs)
    measured = dict(measured or {})

    def unavailable() -> LrScalingUnavailable:
        why = getattr(update_norm, "last_error", None) or "no measurement"
        return LrScalingUnavailable(f"{update_norm.description}: {why}", lrs)

    if any(v is None for v in measured.values()):
        return unavailable()
    g = probe_gradient(batch)
    norms: dict[float, float] = {lr: float(v) for lr, v in measured.items() if v is not None}
    for i, lr in enumerate(lrs, start=1):
        if lr in norms:
            say(f"6/6: LR probe {i}/{len(lrs)} at lr {lr:g}: measured by the restore probe's update 1")
            continue
        say(f"6/6: LR probe {i}/{len(lrs)} at lr {lr:g}")
        client, _ = (call or (lambda fn: fn()))(
            lambda: create_from_state_with_response(service_client, initial_checkpoint)
        )
        describe_client(service_client, client, f"LR-scaling probe at lr {lr:g} (fresh from the initial checkpoint)")
        adam = adam_params(opt_cfg, lr)
        norm = update_norm(client, partial(fixed_gradient_step, client, g, adam))
        if norm is None:
            return unavailable()
        norms[lr] = float(norm)
    probes: list[dict[str, float]] = [{"learning_rate": lr, "update_norm": norms[lr]} for lr in lrs]
    errors = lr_scaling_error(probes)
    worst = max(errors)
    passed = bool(all(p["update_norm"] > 0 for p in probes) and worst <= rtol)
    problem = None
    if not passed:
        problem = (
            f"update_norm/LR changes by {worst:.3g} relative to the first probe (> {rtol})"
            if worst > rtol
            else "an update norm is zero: the update did not move parameters"
        )
    reset = (
        (
            "a fresh state from the initial checkpoint per probe: the setup client that saved it (nothing applied "
            "before; the restore probe's update 1) at the planned LR, a client created from it with optimizer at "
            "every other LR"
        )
        if measured
        else "a client created from the initial checkpoint with optimizer per probe"
    )
    return LrScalingMeasured(
        measure=update_norm.description,
        reset=reset,
        gradient="cross_entropy on the even fixed-batch datums (the restore probe's update 1)",
        lr_scaling=probes,
        relative_error=[e if math.isfinite(e) else None for e in errors],
        rtol=rtol,
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
    else:
        status["reason"] = lr_block.reason
    for path in out.get("paths", []):
        if isinstance(lr_block, LrScalingMeasured):
            path["lr_scaling"] = [dict(p) for p in lr_block.lr_scaling]
        else:  # one entry per planned LR: unmeasured, with the exact reason (never [])
            reason = lr_block.reason or "not measured"
            path["lr_scaling"] = [
                {"learning_rate": float(lr), "update_norm": None, "available": False, "reason": reason}
                for lr in lr_block.learning_rates
            ] or [{"learning_rate": None, "update_norm": None, "available": False, "reason": reason}]
        path["lr_scaling_status"] = status
    return out

"""The diagnostic's epochs over its one frozen batch: one recorded update per minibatch until the
update cap, the wall cap, the schedule's end or a named stop.

No sampling and no anchor refresh between updates; each loss call is persisted before the
optimizer step it feeds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import tinker

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonObject
from dppo_harness.loss import losses
from dppo_harness.rollout.frozen_batch import FrozenBatch, Minibatch
from dppo_harness.stages.diagnostic.config import FINALIZE_RESERVE_S, DiagnosticConfig
from dppo_harness.stages.diagnostic.run_state import RunState
from dppo_harness.stages.diagnostic.sentinels import SentinelTracker
from dppo_harness.stages.diagnostic.write import post_progress
from dppo_harness.train import train_step

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle

# What a due sentinel's forward, submitted behind an optimizer step, hands back.
SentinelForward = tinker.APIFuture[tinker.ForwardBackwardOutput]


@dataclass(frozen=True)
class UpdateRule:
    """What every update of the run reuses: the pinned loss, the recorder wrapped around it and
    the optimizer's Adam settings."""

    loss_fn: losses.PackedLoss
    recorder: ins.LossCallRecorder
    adam: tinker.AdamParams

    @classmethod
    def of(cls, cfg: DiagnosticConfig) -> UpdateRule:
        loss_cfg = cfg.loss_config()
        return cls(losses.make_loss_fn(loss_cfg), ins.LossCallRecorder(loss_cfg), tinker.AdamParams(**cfg.adam))


def train_epochs(
    tc: tinker.TrainingClient,
    cfg: DiagnosticConfig,
    frozen: FrozenBatch,
    mbs: Sequence[Minibatch],
    sampler_path: str,
    bundle: EvidenceBundle,
    state: RunState,
    *,
    elapsed: Callable[[], float],
    clock: Callable[[], float],
    cap_s: float,
    say: Callable[[str], None],
    tag: str,
    after_update: Callable[[int], str | None] = lambda _n: None,
) -> str:
    """Epochs over the same frozen batch (no sampling, no anchor refresh) until the update cap,
    the wall cap, the schedule's end or `after_update(n)` naming a stop; returns the stop reason."""
    rule = UpdateRule.of(cfg)
    last_update_s = 0.0
    tokens_seen = 0
    stop = None
    for epoch, mb in [(e, mb) for e in range(1, cfg.epochs + 1) for mb in mbs]:
        stop = _stop_before_update(cfg, state, elapsed=elapsed, last_update_s=last_update_s, cap_s=cap_s)
        if stop is not None:
            break
        u0 = clock()
        update_index = state.updates_done + 1
        sentinels = _due_sentinels(state, update_index)
        context = _loss_call_context(frozen, mb, epoch, update_index, sampler_path)
        rec, upd = _recorded_update(tc, rule, frozen, mb, state, context, sentinels)
        phases = _settle_update(state, upd, sentinels, update_index, elapsed=elapsed, clock=clock)
        halt = after_update(update_index)
        tokens_seen += rec.stats["tokens/loss"]
        last_update_s = clock() - u0
        state.update_seconds.append(last_update_s)
        t_snapshot = clock()
        post_progress(bundle, cfg, state, update_index, elapsed=elapsed, tag=tag)
        state.update_phases.append(phases | {"total": last_update_s, "snapshot_after": clock() - t_snapshot})
        s = rec.stats
        say(
            f"[{tag}] update {update_index}/{cfg.max_updates} (epoch {epoch}, minibatch {mb.index}): "
            f"{s['tokens/loss']} loss tokens (total {tokens_seen}), removed {s['dppo/removed']} "
            f"(+{s['dppo/removed_pos_adv']}/-{s['dppo/removed_neg_adv']}), |p-q| q90 {s['drift/abs_p90']:.4g} "
            f"max {s['drift/abs_max']:.4g}, clip {s['ppo/clipped']}; {last_update_s:.1f}s/update, "
            f"elapsed {elapsed():.0f}s / {cap_s:.0f}s"
        )
        if halt is not None:
            stop = halt
            break
    if state.sentinels is not None:
        state.sentinels.collect()
    if stop is not None:
        return stop
    return "schedule complete" if state.updates_done < cfg.max_updates else "update cap reached"


def _stop_before_update(
    cfg: DiagnosticConfig, state: RunState, *, elapsed: Callable[[], float], last_update_s: float, cap_s: float
) -> str | None:
    """Why the next update must not start: the update cap, or the wall cap when one more update
    (as long as the last one) and writing the analysis would pass it; None when it may."""
    if state.updates_done >= cfg.max_updates:
        return "update cap reached"
    if elapsed() + last_update_s + FINALIZE_RESERVE_S > cap_s:
        return (
            f"wall cap: {elapsed():.0f}s elapsed + {last_update_s:.0f}s per update + "
            f"{FINALIZE_RESERVE_S:.0f}s to write the analysis would exceed {cap_s:.0f}s"
        )
    return None


def _due_sentinels(state: RunState, update_index: int) -> SentinelTracker | None:
    """The sentinel tracker when a measurement is due after `update_index`, else None."""
    return state.sentinels if state.sentinels is not None and state.sentinels.due(update_index) else None


def _loss_call_context(
    frozen: FrozenBatch, mb: Minibatch, epoch: int, update_index: int, sampler_path: str
) -> JsonObject:
    """What the recorder keeps with the update's loss call: where in the schedule and the frozen
    batch it stands."""
    return {
        "update_index": update_index,
        "epoch": epoch,
        "minibatch": mb.index,
        "group_ids": list(mb.group_ids),
        "sequence_indices": list(mb.sequence_indices),
        "sampler_checkpoint": sampler_path,
        "frozen_batch_sha256": frozen.sha256,
    }


def _recorded_update(
    tc: tinker.TrainingClient,
    rule: UpdateRule,
    frozen: FrozenBatch,
    mb: Minibatch,
    state: RunState,
    context: JsonObject,
    sentinels: SentinelTracker | None,
) -> tuple[ins.LossCallRecord, train_step.UpdateResult[SentinelForward]]:
    """One update on the minibatch's frozen sequences, its loss call persisted (with the frozen
    anchor logprobs it used) before the optimizer step it feeds."""
    frozen.assert_intact()  # before every reuse (to_datums checks again)
    datums = frozen.to_datums(mb.sequence_indices)
    anchor = np.concatenate([frozen.sequence(s)["logprobs"] for s in mb.sequence_indices])

    def persist(rec: ins.LossCallRecord) -> None:
        # Persisted before the optimizer step it feeds (staged, then registered in its archive).
        state.update_archive().add(rec)
        state.records.append(rec)
        state.frozen_by_call.append(anchor)

    # A due sentinel forward is submitted right behind the optimizer step (it reads the
    # updated weights) and awaited after the next update's submission (one round trip less per update).
    return train_step.train_step(
        tc,
        datums,
        rule.loss_fn,
        rule.adam,
        rule.recorder,
        context,
        persist=persist,
        submit_behind=None if sentinels is None else partial(sentinels.submit, tc),
    )


def _settle_update(
    state: RunState,
    upd: train_step.UpdateResult[SentinelForward],
    sentinels: SentinelTracker | None,
    update_index: int,
    *,
    elapsed: Callable[[], float],
    clock: Callable[[], float],
) -> dict[str, float]:
    """After the update: the previous update's sentinel collected, this one's deferred, the first
    optimizer response kept and the update counted; returns where its seconds went so far."""
    t_collect = clock()
    if state.sentinels is not None:
        state.sentinels.collect()  # the previous update's sentinel: long done by now
    phases = dict(upd.phases, sentinel_wait=clock() - t_collect)
    if sentinels is not None and upd.behind is not None:
        sentinels.defer(upd.behind, update_index, elapsed())
    if state.first_optim is None:
        state.first_optim = upd.optim
    state.updates_done = update_index
    return phases

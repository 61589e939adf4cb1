"""The diagnostic run: declare -> restore (or take the preflight's loaded client) -> sample and
freeze ONE batch -> sentinels -> epochs over that frozen batch (no sampling, no anchor refresh)
until the update cap or the wall cap (counted from the stage's start) -> analyse -> write
evidence. Every loss call is persisted before the optimizer step it feeds. What the run measured
so far is its `RunState` (kept when it stops early, read once into the result), with the sentinel
tokens it measures (`SentinelTracker`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import numpy as np
import tinker
from pydantic import JsonValue

from dppo_harness.data import dataset, tokenizer
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument.instrumentation import ANALYSIS_FILE
from dppo_harness.json_types import JsonObject
from dppo_harness.loss import losses
from dppo_harness.rollout import rollouts
from dppo_harness.rollout.frozen_batch import FrozenBatch, Minibatch
from dppo_harness.stages.diagnostic.config import (
    FINALIZE_RESERVE_S,
    SENTINELS_PER_SIGN,
    DiagnosticError,
    adam,
    loss_config,
    max_wall_seconds,
)
from dppo_harness.stages.diagnostic.write import (
    DiagnosticResult,
    declare,
    journal_frozen_batch,
    journal_record,
    own_optimizer_check,
    post_progress,
    write_evidence,
)
from dppo_harness.stages.restoration import load_ref
from dppo_harness.train import train_step
from dppo_harness.train.clients import full_logprobs, make_datum
from dppo_harness.train.fingerprints import logprobs_sha256
from dppo_harness.train.restore import Restore, restore

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ExperimentSpec, Plan
    from dppo_harness.plans.models import BoundedDiagnostic
    from dppo_harness.stages.restoration import RestorationResult
    from dppo_harness.train.optimizer_checks import OptimizerCheck


class SentinelPoint(TypedDict):
    """The sentinels measured once: after which update, when, and the drift summary."""

    after_update: int
    elapsed_s: float
    summary: dict[str, Any]  # instrumentation.sentinel_summary
    logprobs: NotRequired[list[float]]  # in the evidence file only


class SentinelSummary(TypedDict):
    """The sentinels as the analysis reads them (no raw logprobs); `at_init` is the first point's
    summary, `last` the last point when there are two or more. A run that never chose sentinels
    has only `points`, `at_init` and `last`."""

    sequence_indices: NotRequired[list[int]]
    selection_rule: NotRequired[str]
    tokens: NotRequired[int]
    after_updates: NotRequired[list[int]]
    points: list[SentinelPoint]
    at_init: dict[str, Any] | None
    last: SentinelPoint | None


class SentinelTracker:
    """Fixed sentinel sequences of the frozen batch, chosen before training: the trainer's
    logprobs on them at initialization and after the planned updates (forward only)."""

    def __init__(self, frozen: FrozenBatch, per_sign: int, after_updates: Sequence[int]):
        adv_S = [
            float(frozen.sequence(s)["advantages"][frozen.sequence(s)["mask"] > 0][:1].sum())
            for s in range(frozen.n_sequences)
        ]
        chosen = ins.choose_sentinel_sequences(adv_S, per_sign)
        seqs = [frozen.sequence(s) for s in chosen.sequence_indices]
        # Forward-only cross-entropy datums: the whole sequence, weight 0 everywhere.
        self.datums = [
            make_datum(q["tokens"][:1].tolist(), q["tokens"][1:].tolist(), completion_weight=0.0) for q in seqs
        ]
        self.sampler_logprobs = np.concatenate([q["logprobs"] for q in seqs])
        self.mask = np.concatenate([q["mask"] for q in seqs])
        self.advantages = np.concatenate([q["advantages"] for q in seqs])
        self.after_updates = tuple(after_updates)
        self.sequence_indices = list(chosen.sequence_indices)
        self.selection_rule: str = chosen.selection_rule
        self.points: list[SentinelPoint] = []
        self._init: np.ndarray | None = None
        # Submitted sentinel forwards `collect()` awaits (one wait less per update): (future, after_update, elapsed_s).
        self.pending: list[tuple[tinker.APIFuture[tinker.ForwardBackwardOutput], int, float]] = []

    def collect(self) -> None:
        """Await the submitted sentinel forwards, in submission order, and record their points."""
        while self.pending:
            future, after_update, elapsed_s = self.pending.pop(0)
            out = future.result()
            if len(out.loss_fn_outputs) != len(self.datums):
                raise RuntimeError(
                    f"sentinel forward returned {len(out.loss_fn_outputs)} outputs for {len(self.datums)} datums"
                )
            lp = np.concatenate([o["logprobs"].to_numpy().astype(np.float32).reshape(-1) for o in out.loss_fn_outputs])
            if self._init is None:
                self._init = lp
            self.points.append(
                {
                    "after_update": after_update,
                    "elapsed_s": elapsed_s,
                    "summary": ins.sentinel_summary(lp, self.sampler_logprobs, self._init, self.mask, self.advantages),
                    "logprobs": lp.tolist(),
                }
            )

    def summary(self) -> SentinelSummary:
        """Points without the raw logprobs, plus the first and last (for the analysis). A deferred
        forward still pending after a training error is dropped, not waited on twice."""
        if self.pending:
            try:
                self.collect()
            except Exception:  # the run's error is already recorded; the point is missing evidence
                self.pending.clear()
        return {
            "sequence_indices": list(self.sequence_indices),
            "selection_rule": self.selection_rule,
            "tokens": int(self.mask.sum()),
            "after_updates": list(self.after_updates),
            "points": [
                {"after_update": p["after_update"], "elapsed_s": p["elapsed_s"], "summary": p["summary"]}
                for p in self.points
            ],
            "at_init": self.points[0]["summary"] if self.points else None,
            "last": self.points[-1] if len(self.points) > 1 else None,
        }

    def evidence(self) -> dict[str, object]:
        """diagnostic-sentinels.json: the summary with every point's raw logprobs, the sampler's and the mask."""
        return {
            **self.summary(),
            "points": self.points,
            "sampler_logprobs": self.sampler_logprobs.tolist(),
            "mask": self.mask.tolist(),
        }


@dataclass
class RunState:
    """What the run measured so far; kept when it stops early, read once into the result."""

    t0: float = 0.0  # time.monotonic() when the stage began: the wall cap counts from it
    cap_seconds: float = math.inf  # the wall cap in effect (the plan's, or the run budget's end when earlier)
    wall_seconds: float = 0.0  # when the service work stopped, from t0
    records: list[ins.LossCallRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    restore: JsonObject = field(default_factory=dict)
    frozen: FrozenBatch | None = None
    minibatches: list[JsonObject] = field(default_factory=list)
    sentinels: SentinelTracker | None = None
    updates_done: int = 0
    stop_reason: str = "update cap reached"
    setup_seconds: float = 0.0
    restore_seconds: float = 0.0
    sampling_seconds: float = 0.0
    sampled_sequences: int = 0
    update_seconds: list[float] = field(default_factory=list)
    update_phases: list[dict[str, float]] = field(default_factory=list)  # where each update's seconds went
    final_checkpoint: str | None = None
    info: tinker.types.GetInfoResponse | None = None  # the trained client's get_info response
    first_optim: tinker.OptimStepResponse | None = None  # the trained client's own first optim_step response
    own_check: OptimizerCheck | None = None  # the optimizer check from that response
    initial_output: JsonObject | None = None
    preloaded: bool = False  # trains the restoration preflight's loaded client (no restore of its own)
    rollout_yield: dict[str, Any] | None = None  # the frozen batch's truncation and answer yield

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _initial_output(tc: tinker.TrainingClient, ref: RestorationResult) -> JsonObject:
    """Full logprobs of the trained client on the restoration preflight's fixed batch, before its
    first update, compared bitwise with the group's (same initial checkpoint)."""
    out_sha = logprobs_sha256(full_logprobs(tc, ref.fixed_batch))
    group: dict[str, JsonValue] = dict(ref.output_sha256)
    return {
        "available": True,
        "batch_sha256": ref.batch_sha256,
        "output_sha256": out_sha,
        "evidence_ref": f"{ANALYSIS_FILE}#trained_client_initial_output",
        "before_first_update": True,
        "group_output_sha256": group,
        "bitwise_equal_to_group": {a: out_sha == h for a, h in group.items()},
    }


class _Stop(Exception):
    """Planned stop (wall cap) before training could start."""


def _restore_record(restored: Restore, initial_checkpoint: str, *, preloaded: bool) -> JsonObject:
    """The trained client's restore as the evidence records it; a load the service does not show
    to be of the initial checkpoint stops the run (the plan requires an observed load of it)."""
    which = "the preflight's load of the trained arm" if preloaded else "the initial-state load"
    problem = restored.mismatch()
    if problem is None and restored.source_path != initial_checkpoint:
        problem = f"it loaded {restored.source_path!r}, not the initial checkpoint {initial_checkpoint!r}"
    if problem is not None:
        raise DiagnosticError(f"{which}: {problem}; the plan requires an observed load of the initial checkpoint")
    if not preloaded:
        return restored.record()
    return {
        **restored.record(),
        "evidence_ref": load_ref(restored.name),
        "source": "the restoration preflight's client for this arm, loaded from the initial checkpoint "
        "with optimizer and never updated before this stage (no second restore)",
    }


def _freeze_and_split(
    tc: tinker.TrainingClient,
    d: BoundedDiagnostic,
    bundle: EvidenceBundle,
    state: RunState,
    say: Callable[[str], None],
) -> tuple[str, FrozenBatch, list[Minibatch], SentinelTracker]:
    """Sample ONE batch from the restored weights, freeze and persist it, split it into
    complete-group minibatches, choose the sentinels and measure them at initialization."""
    tok = tokenizer.make_renderer()
    samp, sch, seed = d.fixed_settings.sampling, d.schedule, d.fixed_settings.seed
    train = dataset.get(samp.dataset).load_split("train", seed=seed)
    rcfg = rollouts.RolloutConfig(
        sch.groups_per_batch, sch.group_size, float(samp.temperature), samp.max_tokens, seed=seed
    )
    sampled = rollouts.sample_rollout_batch(
        tc,
        train.batch(0, sch.groups_per_batch),  # the first train batch of the cookbook order
        tok.renderer,
        rcfg,
        sampler_name="diagnostic-sampler-initial",
    )
    load = {k: state.restore[k] for k in ("initial_checkpoint", "loaded_checkpoint_uri")}
    frozen = state.frozen = rollouts.freeze(
        sampled.batch, sampler_version=sampled.sampler_path, extra_metadata={"load": load, "tokenizer": tok.provenance}
    )
    journal_frozen_batch(bundle, frozen)
    bundle.add_checkpoint(d.fixed_settings.treatment.arm, 0, sampled.sampler_path)
    state.rollout_yield = sampled.batch.response_yield().as_dict()
    summary: dict[str, Any] = sampled.batch.summary()
    state.sampling_seconds = float(summary["sampling_seconds"])
    state.sampled_sequences = int(frozen.n_sequences)
    say(
        f"[diagnostic] sampled and froze {frozen.n_sequences} sequences ({summary['response_tokens']} response "
        f"tokens, {summary['nonconstant_reward_groups']} groups with signal, {summary['frac_truncated']:.1%} "
        f"truncated at max_tokens {samp.max_tokens}, {summary['frac_no_answer']:.1%} without an answer) in "
        f"{summary['sampling_seconds']:.0f}s; elapsed {state.elapsed():.0f}s / {state.cap_seconds:.0f}s"
    )
    mbs = list(frozen.split_minibatches(sch.minibatches_per_epoch))
    state.minibatches = [mb.record() for mb in mbs]
    sentinels = state.sentinels = SentinelTracker(frozen, SENTINELS_PER_SIGN, d.recording.sentinels.after_updates)
    if 0 in sentinels.after_updates:
        sentinels.pending.append((tc.forward(list(sentinels.datums), "cross_entropy"), 0, state.elapsed()))
        sentinels.collect()
    state.setup_seconds = state.elapsed()
    say(
        f"[diagnostic] setup done in {state.setup_seconds:.0f}s; training {sch.epochs} epochs x {len(mbs)} minibatches "
        f"(cap {sch.max_optimizer_updates} updates / {state.cap_seconds:.0f}s)"
    )
    return sampled.sampler_path, frozen, mbs, sentinels


def run_bounded_diagnostic(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    initial_checkpoint: str,
    *,
    backend: str,
    stage_start: float | None = None,
    spec: ExperimentSpec | None = None,
    progress: Callable[[str], None] | None = None,
    prior_service_work: Mapping[str, Mapping[str, int]] | None = None,
    init_reference: RestorationResult | None = None,
    restored: Restore | None = None,
) -> DiagnosticResult:
    """Run the plan's bounded diagnostic and write its evidence; see the module docstring.

    `stage_start` (a `time.monotonic()` reading) is when the stage began: the wall cap counts from it.
    `restored`: the preflight's loaded client of the trained arm, trained here instead of
    restoring a new one. A planned stop or an error ends the service work early and is recorded in
    the run state (stop reason, errors), so the evidence keeps what was measured."""
    t0 = time.monotonic() if stage_start is None else stage_start
    d, arm = plan.diagnostic, plan.diagnostic.fixed_settings.treatment.arm
    say = progress or (lambda _m: None)
    state = RunState(t0, max_wall_seconds(d))
    elapsed = state.elapsed
    selftest = declare(bundle, plan)
    try:
        # Remaining run budget first (the ledger's, when one is set): never start what cannot fit. The
        # plan's wall cap is shortened to the run budget's end when that comes first.
        remaining = bundle.remaining_seconds()
        if remaining is not None and elapsed() + remaining < state.cap_seconds:
            plan_cap, cap_s = state.cap_seconds, max(0.0, elapsed() + float(remaining))
            state.cap_seconds = cap_s
            if plan_cap - cap_s > 1.0:  # the same clock within rounding says nothing new
                say(
                    f"[diagnostic] the run budget ends {cap_s:.0f}s after the session start, before the "
                    f"{plan_cap:.0f}s cap: stopping there"
                )
        if elapsed() >= state.cap_seconds:
            raise _Stop("wall cap exhausted before service work")
        # The trained client: the preflight's loaded one when given, else a fresh restore.
        r0 = time.monotonic()
        state.preloaded = restored is not None
        if restored is None:
            restored = restore(service_client, initial_checkpoint, "diagnostic DPPO client")
        state.restore = _restore_record(restored, initial_checkpoint, preloaded=state.preloaded)
        tc, state.info = restored.client, restored.info
        if init_reference is not None:  # the trained client's own initial output, before any update
            state.initial_output = _initial_output(tc, init_reference)
        state.restore_seconds = (restored.seconds if state.preloaded else 0.0) + (time.monotonic() - r0)
        say(
            f"[diagnostic] {'training the preflight client loaded from' if state.preloaded else 'restored'} "
            f"{initial_checkpoint} ({elapsed():.0f}s / {state.cap_seconds:.0f}s)"
        )
        if elapsed() >= state.cap_seconds:
            raise _Stop("wall cap exhausted during setup (after restore)")
        sampler_path, frozen, mbs, sentinels = _freeze_and_split(tc, d, bundle, state, say)
        state.stop_reason = _train_epochs(tc, plan, frozen, mbs, sentinels, sampler_path, bundle, state, say)
        if state.updates_done:  # the final state saved and its URI recorded (a claim cites the checkpoint)
            try:
                uri = tc.save_state(f"diagnostic-final-u{state.updates_done:02d}").result().path
            except Exception as exc:  # recorded: no claim without the checkpoint
                state.errors.append(f"final checkpoint not saved: {type(exc).__name__}: {exc}")
            else:
                state.final_checkpoint = uri
                bundle.add_checkpoint(arm, state.updates_done, uri)
                say(f"[diagnostic] final checkpoint after update {state.updates_done}: {uri}")
    except _Stop as stop:
        state.stop_reason = str(stop)
        state.setup_seconds = state.setup_seconds or elapsed()
    except Exception as exc:  # persist what was measured; the classification says evidence is missing
        state.errors.append(f"{type(exc).__name__}: {exc}")
        state.stop_reason = f"error: {type(exc).__name__}"
        state.setup_seconds = state.setup_seconds or elapsed()
    state.wall_seconds = elapsed()
    say(f"[diagnostic] stopped: {state.stop_reason}; {state.updates_done} updates in {state.wall_seconds:.0f}s")
    return write_evidence(bundle, plan, state, selftest, backend, spec, prior_service_work)


def _train_epochs(
    tc: tinker.TrainingClient,
    plan: Plan,
    frozen: FrozenBatch,
    mbs: Sequence[Minibatch],
    sentinels: SentinelTracker,
    sampler_path: str,
    bundle: EvidenceBundle,
    state: RunState,
    say: Callable[[str], None],
) -> str:
    """Epochs over the same frozen batch (no sampling, no anchor refresh), one recorded update per
    minibatch, until the update cap, the wall cap, the schedule's end or an optimizer mismatch;
    returns the stop reason."""
    d = plan.diagnostic
    loss_cfg, epochs, max_updates = loss_config(d), d.schedule.epochs, d.schedule.max_optimizer_updates
    loss_fn, recorder, adam_params = (
        losses.make_loss_fn(loss_cfg),
        ins.LossCallRecorder(loss_cfg),
        tinker.AdamParams(**adam(d)),
    )
    elapsed, cap_s, clock = state.elapsed, state.cap_seconds, time.monotonic
    last_update_s = 0.0
    tokens_seen = 0
    stop = None

    def persist(rec: ins.LossCallRecord) -> None:
        journal_record(bundle, rec)
        state.records.append(rec)

    for epoch, mb in [(e, mb) for e in range(1, epochs + 1) for mb in mbs]:
        # The update cap, or the wall cap when one more update (as long as the last) and writing
        # the analysis would pass it.
        if state.updates_done >= max_updates:
            stop = "update cap reached"
            break
        if elapsed() + last_update_s + FINALIZE_RESERVE_S > cap_s:
            stop = (
                f"wall cap: {elapsed():.0f}s elapsed + {last_update_s:.0f}s per update + "
                f"{FINALIZE_RESERVE_S:.0f}s to write the analysis would exceed {cap_s:.0f}s"
            )
            break
        u0 = clock()
        update_index = state.updates_done + 1
        frozen.assert_intact()  # before every reuse (to_datums checks again)
        datums = frozen.to_datums(mb.sequence_indices)
        due = update_index in sentinels.after_updates
        context: JsonObject = {
            "update_index": update_index,
            "epoch": epoch,
            "minibatch": mb.index,
            "group_ids": list(mb.group_ids),
            "sequence_indices": list(mb.sequence_indices),
            "sampler_checkpoint": sampler_path,
            "frozen_batch_sha256": frozen.sha256,
        }
        # A due sentinel forward is submitted right behind the optimizer step (it reads the updated
        # weights) and awaited after the next update's submission (one round trip less per update).
        rec, upd = train_step.train_step(
            tc, datums, loss_fn, adam_params, recorder, context, persist=persist,
            submit_behind=partial(tc.forward, list(sentinels.datums), "cross_entropy") if due else None,
        )  # fmt: skip
        t_collect = clock()
        sentinels.collect()  # the previous update's sentinel: long done by now
        phases = dict(upd.phases, sentinel_wait=clock() - t_collect)
        if due and upd.behind is not None:
            sentinels.pending.append((upd.behind, update_index, elapsed()))
        state.updates_done = update_index
        if update_index == 1:  # the trained client's own optimizer echo, checked before update 2
            state.first_optim = upd.optim
            state.own_check = own_optimizer_check(plan, upd.optim, state.info)
            if state.own_check["mismatches"]:  # a mismatch stops the run
                stop = "optimizer mismatch after update 1: " + "; ".join(state.own_check["mismatches"])
                state.errors.append(stop)
        tokens_seen += rec.stats.tokens_loss
        last_update_s = clock() - u0
        state.update_seconds.append(last_update_s)
        t_snapshot = clock()
        post_progress(bundle, state)
        state.update_phases.append(phases | {"total": last_update_s, "snapshot_after": clock() - t_snapshot})
        s = rec.stats
        say(
            f"[diagnostic] update {update_index}/{max_updates} (epoch {epoch}, minibatch {mb.index}): "
            f"{s.tokens_loss} loss tokens (total {tokens_seen}), removed {s.dppo_removed} "
            f"(+{s.dppo_removed_pos_adv}/-{s.dppo_removed_neg_adv}), |p-q| q90 {s.drift_abs_p90:.4g} "
            f"max {s.drift_abs_max:.4g}, clip {s.ppo_clipped}; {last_update_s:.1f}s/update, "
            f"elapsed {elapsed():.0f}s / {cap_s:.0f}s"
        )
        if stop is not None:
            break
    sentinels.collect()
    if stop is not None:
        return stop
    return "schedule complete" if state.updates_done < max_updates else "update cap reached"

"""What a diagnostic run measured so far, kept when it stops early and read once into the result
(`RunState`); the sentinel tokens it measures (`SentinelTracker`); and the JSON blocks the steps
hand each other and write as evidence, typed (they stay dicts: the evidence files are these dicts,
key for key)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import numpy as np
import tinker

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonObject
from dppo_harness.rollout.frozen_batch import FrozenBatch
from dppo_harness.train.clients import full_logprobs, make_datum

if TYPE_CHECKING:
    from dppo_harness.stages.diagnostic.write import UpdateArchive


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


class SentinelEvidence(SentinelSummary):
    """diagnostic-sentinels.json: the summary with every point's raw logprobs, the sampler's and the mask."""

    sampler_logprobs: list[float]
    mask: list[float]


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
        self._pending: list[
            tuple[tinker.APIFuture[tinker.ForwardBackwardOutput], int, float]
        ] = []  # (forward future, after_update, elapsed_s)

    def due(self, after_update: int) -> bool:
        return after_update in self.after_updates

    def submit(self, tc: tinker.TrainingClient) -> tinker.APIFuture[tinker.ForwardBackwardOutput]:
        """The sentinel forward, submitted (not awaited): queued behind whatever the client has in
        flight, so it reads the weights after those requests."""
        return tc.forward(list(self.datums), "cross_entropy")

    def defer(
        self, future: tinker.APIFuture[tinker.ForwardBackwardOutput], after_update: int, elapsed_s: float
    ) -> None:
        """Keep a submitted sentinel forward; `collect()` awaits it (one wait less per update)."""
        self._pending.append((future, after_update, elapsed_s))

    def collect(self) -> None:
        """Await the deferred sentinel forwards, in submission order, and record their points."""
        while self._pending:
            future, after_update, elapsed_s = self._pending.pop(0)
            out = future.result()
            if len(out.loss_fn_outputs) != len(self.datums):
                raise RuntimeError(
                    f"sentinel forward returned {len(out.loss_fn_outputs)} outputs for {len(self.datums)} datums"
                )
            self._add(
                after_update, elapsed_s, [np.asarray(o["logprobs"].to_numpy()).reshape(-1) for o in out.loss_fn_outputs]
            )

    def measure(self, tc: tinker.TrainingClient, after_update: int, elapsed_s: float) -> None:
        self.collect()
        self._add(after_update, elapsed_s, full_logprobs(tc, self.datums))

    def _add(self, after_update: int, elapsed_s: float, logprobs: Sequence[np.ndarray]) -> None:
        lp = np.concatenate([x.astype(np.float32).reshape(-1) for x in logprobs])
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
        if self._pending:
            try:
                self.collect()
            except Exception:  # the run's error is already recorded; the point is missing evidence
                self._pending.clear()
        return {
            "sequence_indices": list(self.sequence_indices),
            "selection_rule": self.selection_rule,
            "tokens": int(self.mask.sum()),
            "after_updates": list(self.after_updates),
            "points": [_without_logprobs(p) for p in self.points],
            "at_init": self.points[0]["summary"] if self.points else None,
            "last": self.points[-1] if len(self.points) > 1 else None,
        }

    def evidence(self) -> SentinelEvidence:
        """diagnostic-sentinels.json: the summary with every point's raw logprobs, the sampler's and the mask."""
        return {
            **self.summary(),
            "points": self.points,
            "sampler_logprobs": self.sampler_logprobs.tolist(),
            "mask": self.mask.tolist(),
        }


def _without_logprobs(p: SentinelPoint) -> SentinelPoint:
    return {"after_update": p["after_update"], "elapsed_s": p["elapsed_s"], "summary": p["summary"]}


@dataclass
class RunState:
    """What the run measured so far; kept when it stops early, read once into the result."""

    archive: UpdateArchive  # the update records' archive files, open before the first update
    records: list[ins.LossCallRecord] = field(default_factory=list)
    frozen_by_call: list[np.ndarray] = field(default_factory=list)
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
    snapshots: list[str] = field(default_factory=list)
    info: tinker.types.GetInfoResponse | None = None  # the trained client's get_info response
    first_optim: tinker.OptimStepResponse | None = None  # the trained client's own first optim_step response
    initial_output: JsonObject | None = None
    preloaded: bool = False  # trains the restoration preflight's loaded client (no restore of its own)
    rollout_yield: dict[str, Any] | None = None  # the frozen batch's truncation and answer yield

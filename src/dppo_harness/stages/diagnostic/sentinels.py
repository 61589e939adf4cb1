"""Sentinel tokens of the frozen batch: the trainer's logprobs on fixed sequences at
initialization and after the planned updates (forward only), for the drift the analysis reads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tinker

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.rollout.frozen_batch import FrozenBatch
from dppo_harness.stages.diagnostic.records import SentinelEvidence, SentinelPoint, SentinelSummary
from dppo_harness.train.clients import full_logprobs, make_datum


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

    def maybe_measure(self, tc: tinker.TrainingClient, after_update: int, elapsed_s: float) -> None:
        if after_update in self.after_updates:
            self.measure(tc, after_update, elapsed_s)

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

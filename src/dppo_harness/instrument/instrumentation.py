"""Per-loss-call records: the exact tensors each loss saw, its decisions and its statistics.

A `LossCallRecorder` wraps the loss handed to `forward_backward_custom`, so a record holds what
the loss received (the current logprobs of that very call: no extra server pass) and the inputs,
terms and statistics of its own evaluation (`PackedLoss.evaluate`, computed once per call). One
record = one loss call = one optimizer update; records are saved as compressed npz files with a
JSON meta entry (`records_to_npz` / `records_from_npz`), so a file is self-describing and
`replay.py` needs nothing else to recompute the decisions independently. Pooled statistics
(`pool_calls`) and the diagnostic file names replay and the session read live here too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import torch

from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.loss import losses
from dppo_harness.loss.losses import CustomLossFn, PackedInputs
from dppo_harness.loss.terms import DECISION_FIELDS, LossStats, TokenTerms, stats

RECORD_FORMAT = "dppo-harness/loss-call-record/v1"
META_KEY = "__record_meta__"
# Tensors persisted per call: the current logprobs as the loss received them, the packed inputs, the decisions.
TENSOR_FIELDS = ("logprobs_N", *(f.name for f in dataclasses.fields(PackedInputs)), *DECISION_FIELDS)


@dataclass
class LossCallRecord:
    """One loss call: its context, the tensors it saw, its decisions and statistics."""

    call_index: int  # 0-based over the recorder's lifetime
    # Free-form per caller and read back by key (update_index (1-based), epoch, minibatch, group ids, ...).
    context: dict[str, Any]
    dtype: str  # actual dtype of the current logprobs the loss received
    tensors: dict[str, np.ndarray]
    stats: LossStats
    loss_metrics: dict[str, float] = field(default_factory=dict)  # what the loss returned to the SDK
    started_unix: float = 0.0
    loss_seconds: float = 0.0
    terms: TokenTerms | None = None  # in memory only: the terms the packed path decided on

    def meta(self) -> JsonObject:
        return {
            "format": RECORD_FORMAT,
            "call_index": self.call_index,
            "context": self.context,
            "dtype": self.dtype,
            "stats": self.stats.recorded(),
            "loss_metrics": {**self.loss_metrics},
            "started_unix": self.started_unix,
            "loss_seconds": self.loss_seconds,
            "hist_bins": [*self.stats.hist.labels()],
            "magnitude_edges": list(self.stats.hist.edges),
        }


class LossCallRecorder:
    """Wraps the packed loss so every call is recorded from the loss's own evaluation (persisting a
    record is the caller's: `train_step`'s `persist`, before the optimizer step)."""

    def __init__(self, loss_cfg: losses.LossConfig):
        self.loss_cfg = loss_cfg
        self.records: list[LossCallRecord] = []

    def wrap(self, loss_fn: CustomLossFn, **context: JsonValue) -> CustomLossFn:
        # Only the packed path exposes the terms it decided on; the record is built from them.
        if not isinstance(loss_fn, losses.PackedLoss):
            raise TypeError(f"the recorder records the packed loss path, got {type(loss_fn).__name__}")
        packed = loss_fn

        def recorded_loss_fn(data: list, logprobs_list: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
            started, t0 = time.time(), time.perf_counter()
            inputs, call = packed.evaluate(data, logprobs_list)
            seconds = time.perf_counter() - t0
            lp_N = torch.cat([lp.detach().reshape(-1) for lp in logprobs_list]) if logprobs_list else torch.zeros(0)
            decisions = {name: getattr(call.terms, name).cpu().numpy().astype(bool) for name in DECISION_FIELDS}
            record = LossCallRecord(
                call_index=len(self.records),
                context=dict(context),
                dtype=str(lp_N.dtype).replace("torch.", ""),  # as the loss received them
                tensors={"logprobs_N": lp_N.clone().cpu().numpy(), **vars(inputs), **decisions},
                stats=call.stats,
                loss_metrics=packed.metrics(call.stats),
                started_unix=started,
                loss_seconds=seconds,
                terms=call.terms,
            )
            self.records.append(record)
            return call.loss, record.loss_metrics

        return recorded_loss_fn


# ---- persistence -------------------------------------------------------------------------------


def records_to_npz(records: Sequence[LossCallRecord]) -> bytes:
    """One compressed npz holding several calls: keys `c{i}.{field}` plus a JSON meta entry."""
    arrays: dict[str, np.ndarray] = {}
    metas = []
    for i, rec in enumerate(records):
        for name in TENSOR_FIELDS:
            arrays[f"c{i}.{name}"] = rec.tensors[name]
        metas.append(rec.meta())
    meta = json.dumps({"format": RECORD_FORMAT, "calls": metas}, allow_nan=False)
    arrays[META_KEY] = np.frombuffer(meta.encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, allow_pickle=True, **arrays)  # numpy's default, spelled out
    return buf.getvalue()


def records_from_npz(data: bytes) -> list[LossCallRecord]:
    """Inverse of `records_to_npz`; raises ValueError when the bytes are not a record file."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        if META_KEY not in z.files:
            raise ValueError("not a loss-call record file (no meta entry)")
        meta = json.loads(bytes(z[META_KEY]).decode())
        if meta.get("format") != RECORD_FORMAT:
            raise ValueError(f"unknown record format {meta.get('format')!r}")
        return [
            LossCallRecord(
                call_index=m["call_index"],
                context=m["context"],
                dtype=m["dtype"],
                tensors={name: z[f"c{i}.{name}"] for name in TENSOR_FIELDS},
                stats=LossStats.from_recorded(m["stats"], tuple(m["magnitude_edges"])),
                loss_metrics=m["loss_metrics"],
                started_unix=m["started_unix"],
                loss_seconds=m["loss_seconds"],
            )
            for i, m in enumerate(meta["calls"])
        ]


def is_record_file(data: bytes) -> bool:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return META_KEY in z.files
    except Exception:  # not an npz at all
        return False


def summary_row(record: LossCallRecord) -> JsonObject:
    """The scalar statistics of one call (no histograms), for result.json and reports."""
    row: JsonObject = {k: record.stats[k] for k in LossStats.scalar_names()}
    row.update({"call_index": record.call_index, **record.context, "dtype": record.dtype})
    return row


# ---- sentinels ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SentinelSet:
    """A fixed set of loss tokens from one batch: which sequences, which positions."""

    sequence_indices: tuple[int, ...]  # into the frozen batch's sequences
    selection_rule: str


def choose_sentinel_sequences(
    advantages_S: Sequence[float], n_per_sign: int = 4, salt: str = "sentinel-v1"
) -> SentinelSet:
    """Deterministic choice: the first sequences by sha256(salt, index) order in each advantage
    sign class (positive, negative, zero), so both signs are covered whenever they occur."""

    def key(i: int) -> str:
        return hashlib.sha256(f"{salt}:{i}".encode()).hexdigest()

    order = sorted(range(len(advantages_S)), key=key)
    chosen: list[int] = []
    for cls in (lambda a: a > 0, lambda a: a < 0, lambda a: a == 0):
        chosen += [i for i in order if cls(advantages_S[i])][:n_per_sign]
    rule = (
        f"per advantage sign (>0, <0, ==0) the first {n_per_sign} sequences ordered by "
        f"sha256('{salt}:<sequence index>'); all their loss tokens are sentinels"
    )
    return SentinelSet(tuple(sorted(chosen)), rule)


def sentinel_summary(
    trainer_logprobs_N: np.ndarray,
    sampler_logprobs_N: np.ndarray,
    init_logprobs_N: np.ndarray,
    mask_N: np.ndarray,
    advantages_N: np.ndarray,
) -> JsonObject:
    """Trainer vs sampler (total mismatch) and trainer vs initial trainer (optimizer drift)."""
    m = mask_N > 0
    p = np.exp(trainer_logprobs_N[m].astype(np.float64))
    q = np.exp(sampler_logprobs_N[m].astype(np.float64))
    p0 = np.exp(init_logprobs_N[m].astype(np.float64))
    adv = advantages_N[m]
    vs_sampler, vs_init = p - q, p - p0

    def tails(x: np.ndarray) -> JsonObject:
        if x.size == 0:
            return {"mean": 0.0, "abs_p90": 0.0, "abs_max": 0.0}
        return {
            "mean": float(x.mean()),
            "abs_p90": float(np.quantile(np.abs(x), 0.9)),
            "abs_max": float(np.abs(x).max()),
        }

    by_sign: JsonObject = {
        name: {"tokens": int(sel.sum()), "mean_p_minus_p_init": float(vs_init[sel].mean()) if sel.any() else None}
        for name, sel in (("pos", adv > 0), ("neg", adv < 0))
    }
    return {
        "tokens": int(m.sum()),
        "p_minus_q": tails(vs_sampler),
        "p_minus_p_init": tails(vs_init),
        "logprob_minus_sampler_mean": float((trainer_logprobs_N[m] - sampler_logprobs_N[m]).mean()) if m.any() else 0.0,
        "by_advantage_sign": by_sign,
    }


@overload
def nan_free(obj: Mapping[str, object]) -> JsonObject: ...
@overload
def nan_free(obj: object) -> JsonValue: ...
def nan_free(obj: object) -> JsonValue:
    """JSON-safe copy: non-finite floats become None (evidence JSON forbids NaN), numpy scalars
    become Python numbers, tuples become lists. Anything else is returned as it is."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: nan_free(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nan_free(v) for v in obj]
    if isinstance(obj, np.generic):
        return nan_free(obj.item())
    return obj  # type: ignore[return-value]  # str, int, bool, None; json.dumps refuses anything else later


def record_terms(record: LossCallRecord) -> TokenTerms:
    """The terms a record's call decided on (a record read back from disk has none: replay
    recomputes them independently)."""
    if record.terms is None:
        raise ValueError(f"loss call {record.call_index} was read back from disk: its terms are replay's to recompute")
    return record.terms


# ---- pooled statistics and the diagnostic's shared file names (its others: `stages.diagnostic.write`) ----

ANALYSIS_FILE = "diagnostic-analysis.json"
REVISED_SPEC_FILE = "revised-diagnostic-spec.json"
FROZEN_BATCH_STEM = "diagnostic-frozen-batch"

RATIO_PARTS = LossStats.names("float")  # token-weighted: pooled count over pooled tokens
POOLED_QUANTILES = tuple(n for n in LossStats.names("drift") if n.endswith(("_p90", "_p99")))


def pool_calls(terms: Sequence[TokenTerms]) -> JsonObject:
    """Pooled statistics of several loss calls: `terms.stats` of all their tokens together, so
    counts add up, fractions are weighted by loss tokens and quantiles run over every pooled token."""
    if len({tuple(v for k, v in vars(t).items() if not k.endswith("_N")) for t in terms}) != 1:
        raise ValueError("pooled loss calls must be decided at one set of thresholds")
    tensors: dict[str, Any] = {
        f.name: torch.cat([getattr(t, f.name) for t in terms])
        for f in dataclasses.fields(TokenTerms)
        if f.name.endswith("_N")
    }
    pooled = stats(dataclasses.replace(terms[0], **tensors))
    out: JsonObject = {"calls": len(terms), **{k: pooled[k] for k in LossStats.scalar_names()}, "hist": pooled["hist"]}
    if not pooled.tokens_loss:  # no pooled loss token: no drift measured
        out.update(dict.fromkeys(LossStats.names("drift")))
    return out

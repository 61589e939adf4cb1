"""Per-loss-call records: the exact tensors each loss saw, its decisions and its statistics.

A `LossCallRecorder` wraps the loss function handed to `forward_backward_custom`, so what it
records is what the loss actually received (the current logprobs of that very call: no extra
server pass). Decisions come from `losses.token_terms`, the packed path the loss trains with;
`replay.py` later recomputes them with the independent padded implementation.

One record = one loss call = one optimizer update. Records are saved as compressed npz files
(`records_to_npz`, read back by `records_from_npz`) holding the tensors plus a JSON `meta` entry
with the logged statistics, so a file is self-describing and replay needs nothing else.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import torch

from dppo_harness.constants import DPPO_DELTA
from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.loss import losses
from dppo_harness.loss.losses import CustomLossFn

if TYPE_CHECKING:  # only the Datum type: the recorder itself never calls the SDK
    import tinker

RECORD_FORMAT = "dppo-harness/loss-call-record/v1"
META_KEY = "__record_meta__"

# |p - q| bin edges, right-closed (a, b]; the first bin is [0, 0.001]. Signed bins mirror them,
# so the bins beyond +-delta hold exactly the strict exceedances (a token at +-delta is kept).
MAGNITUDE_EDGES: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
N_HIST_BINS = 2 * len(MAGNITUDE_EDGES) - 1
HIST_SIGNS: tuple[str, ...] = ("pos", "neg", "zero")  # advantage sign of the loss token

# Tensor fields persisted per call (packed over the call's N target positions, S sequences).
TENSOR_FIELDS: tuple[str, ...] = (
    "logprobs_N",  # current trainer logprobs as the loss received them
    "sampler_logprobs_N",
    "advantages_N",
    "mask_N",
    "target_tokens_N",
    "first_token_S",  # model_input[0]: with target_tokens it rebuilds every full sequence
    "lengths_S",
    "dppo_keep_N",
    "ppo_clipped_N",
    "ratio_cap_hit_N",
)
DECISION_FIELDS: tuple[str, ...] = ("dppo_keep_N", "ppo_clipped_N", "ratio_cap_hit_N")


def hist_bin_labels() -> list[str]:
    """Human-readable labels of the signed p - q bins, most negative first."""
    mags = (0.0,) + MAGNITUDE_EDGES
    neg = [f"[-{mags[i + 1]:g},-{mags[i]:g})" for i in range(len(MAGNITUDE_EDGES) - 1, 0, -1)]
    pos = [f"({mags[i]:g},{mags[i + 1]:g}]" for i in range(1, len(MAGNITUDE_EDGES))]
    return neg + [f"[-{MAGNITUDE_EDGES[0]:g},{MAGNITUDE_EDGES[0]:g}]"] + pos


def hist_bin_index(prob_diff: np.ndarray) -> np.ndarray:
    """Signed bin of each p - q value, comparing in the values' own dtype (like the loss does)."""
    edges = np.asarray(MAGNITUDE_EDGES, dtype=prob_diff.dtype)
    mag_idx = np.searchsorted(edges, np.abs(prob_diff), side="left")
    mag_idx = np.minimum(mag_idx, len(MAGNITUDE_EDGES) - 1)
    center = len(MAGNITUDE_EDGES) - 1
    return np.where(prob_diff > 0, center + mag_idx, center - mag_idx)


def delta_bins(delta: float = DPPO_DELTA) -> tuple[int, int]:
    """(first bin above +delta, last bin below -delta) — only valid for delta on an edge."""
    k = MAGNITUDE_EDGES.index(delta) + 1
    center = len(MAGNITUDE_EDGES) - 1
    return center + k, center - k


def signed_histograms(
    prob_diff_N: np.ndarray, advantages_N: np.ndarray, loss_token_N: np.ndarray
) -> dict[str, list[int]]:
    """Counts of loss tokens per signed p - q bin, split by advantage sign."""
    idx = hist_bin_index(prob_diff_N)
    sel = {
        "pos": loss_token_N & (advantages_N > 0),
        "neg": loss_token_N & (advantages_N < 0),
        "zero": loss_token_N & (advantages_N == 0),
    }
    return {s: np.bincount(idx[m], minlength=N_HIST_BINS).astype(int).tolist() for s, m in sel.items()}


def _quantiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"p90": 0.0, "p99": 0.0, "max": 0.0, "min": 0.0}
    v = values.astype(np.float64)
    return {
        "p90": float(np.quantile(v, 0.9)),
        "p99": float(np.quantile(v, 0.99)),
        "max": float(v.max()),
        "min": float(v.min()),
    }


def decision_stats(
    prob_diff_N: np.ndarray,
    advantages_N: np.ndarray,
    loss_token_N: np.ndarray,
    dppo_keep_N: np.ndarray,
    ppo_clipped_N: np.ndarray,
    ratio_cap_hit_N: np.ndarray,
    delta: float = DPPO_DELTA,
) -> JsonObject:
    """Every logged statistic of one loss call, from its decisions and p - q (numpy, no torch).

    Shared by the recorder (on the packed path's decisions) and by replay (on the independent
    path's decisions), so a disagreement can only come from the decisions or tensors themselves.
    """
    loss = loss_token_N.astype(bool)
    adv = advantages_N
    pos, neg, zero = loss & (adv > 0), loss & (adv < 0), loss & (adv == 0)
    nonzero = pos | neg
    dropped = loss & ~dppo_keep_N.astype(bool)
    removed = dropped & nonzero
    n_loss, n_nonzero = int(loss.sum()), int(nonzero.sum())
    d = prob_diff_N
    delta_d = np.asarray(delta, dtype=d.dtype)
    exceed_pos, exceed_neg = loss & (d > delta_d), loss & (d < -delta_d)
    clipped = loss & ppo_clipped_N.astype(bool)
    loss_d = d[loss]
    signed, absolute = _quantiles(loss_d), _quantiles(np.abs(loss_d))

    def frac(num: int, den: int) -> float:
        return num / den if den else 0.0

    return {
        "tokens/loss": n_loss,
        "tokens/nonzero_adv": n_nonzero,
        "tokens/pos_adv": int(pos.sum()),
        "tokens/neg_adv": int(neg.sum()),
        "tokens/zero_adv": int(zero.sum()),
        "dppo/removed": int(removed.sum()),
        "dppo/removed_pos_adv": int((removed & pos).sum()),
        "dppo/removed_neg_adv": int((removed & neg).sum()),
        "dppo/masked_frac_loss_tokens": frac(int(removed.sum()), n_loss),
        "dppo/masked_frac_nonzero_adv": frac(int(removed.sum()), n_nonzero),
        "dppo/mask_zero_adv": int((dropped & zero).sum()),
        "dppo/exceed_pos": int(exceed_pos.sum()),
        "dppo/exceed_neg": int(exceed_neg.sum()),
        "dppo/exceed_pos_on_pos_adv": int((exceed_pos & pos).sum()),
        "dppo/exceed_neg_on_neg_adv": int((exceed_neg & neg).sum()),
        "dppo/ratio_cap_hits": int((loss & ratio_cap_hit_N.astype(bool)).sum()),
        "ppo/clipped": int(clipped.sum()),
        "ppo/clipped_pos_adv": int((clipped & pos).sum()),
        "ppo/clipped_neg_adv": int((clipped & neg).sum()),
        "ppo/clip_frac_loss_tokens": frac(int(clipped.sum()), n_loss),
        "ppo/clip_frac_nonzero_adv": frac(int(clipped.sum()), n_nonzero),
        "drift/signed_p90": signed["p90"],
        "drift/signed_p99": signed["p99"],
        "drift/signed_max": signed["max"],
        "drift/signed_min": signed["min"],
        "drift/abs_p90": absolute["p90"],
        "drift/abs_p99": absolute["p99"],
        "drift/abs_max": absolute["max"],
        # The tails that matter for the directional mask: up-moves on A>0, down-moves on A<0.
        "drift/max_on_pos_adv": float(d[pos].max()) if pos.any() else None,
        "drift/min_on_neg_adv": float(d[neg].min()) if neg.any() else None,
        "hist": {sign: [*counts] for sign, counts in signed_histograms(d, adv, loss).items()},
    }


# Statistics compared exactly by replay (counts) or to float tolerance (fractions and tails).
COUNT_KEYS: tuple[str, ...] = (
    "tokens/loss",
    "tokens/nonzero_adv",
    "tokens/pos_adv",
    "tokens/neg_adv",
    "tokens/zero_adv",
    "dppo/removed",
    "dppo/removed_pos_adv",
    "dppo/removed_neg_adv",
    "dppo/mask_zero_adv",
    "dppo/exceed_pos",
    "dppo/exceed_neg",
    "dppo/exceed_pos_on_pos_adv",
    "dppo/exceed_neg_on_neg_adv",
    "dppo/ratio_cap_hits",
    "ppo/clipped",
    "ppo/clipped_pos_adv",
    "ppo/clipped_neg_adv",
)
FLOAT_KEYS: tuple[str, ...] = (
    "dppo/masked_frac_loss_tokens",
    "dppo/masked_frac_nonzero_adv",
    "ppo/clip_frac_loss_tokens",
    "ppo/clip_frac_nonzero_adv",
    "drift/signed_p90",
    "drift/signed_p99",
    "drift/signed_max",
    "drift/signed_min",
    "drift/abs_p90",
    "drift/abs_p99",
    "drift/abs_max",
    "drift/max_on_pos_adv",
    "drift/min_on_neg_adv",
)


@dataclass
class LossCallRecord:
    """One loss call: its context, the tensors it saw, its decisions and statistics."""

    call_index: int  # 0-based over the recorder's lifetime
    # Free-form per caller and read back by key (update_index (1-based), epoch, minibatch, group ids, ...).
    context: dict[str, Any]
    dtype: str  # actual dtype of the current logprobs the loss received
    tensors: dict[str, np.ndarray]
    stats: dict[str, Any]  # decision_stats(...) plus decision_dtype; read back by key (COUNT_KEYS, FLOAT_KEYS)
    loss_metrics: dict[str, float] = field(default_factory=dict)  # what the loss itself returned
    started_unix: float = 0.0
    loss_seconds: float = 0.0
    prob_diff_N: np.ndarray | None = None  # in memory only: float64 p - q of the packed path

    def meta(self) -> JsonObject:
        return {
            "format": RECORD_FORMAT,
            "call_index": self.call_index,
            "context": self.context,
            "dtype": self.dtype,
            "stats": self.stats,
            "loss_metrics": {**self.loss_metrics},
            "started_unix": self.started_unix,
            "loss_seconds": self.loss_seconds,
            "hist_bins": [*hist_bin_labels()],
            "magnitude_edges": list(MAGNITUDE_EDGES),
        }


def packed_inputs(data: Sequence[tinker.Datum]) -> dict[str, np.ndarray]:
    """Sampler logprobs, advantages, mask, target tokens and layout of datums, packed over N."""
    fields: dict[str, list[np.ndarray]] = {k: [] for k in ("sampler", "adv", "mask", "target")}
    first, lengths = [], []
    for i, datum in enumerate(data):
        inputs = datum.loss_fn_inputs
        missing = [k for k in ("target_tokens", "logprobs", "advantages", "mask") if k not in inputs]
        if missing:
            raise ValueError(f"datum {i}: loss_fn_inputs lacks {missing}")
        target = losses.as_numpy(inputs["target_tokens"]).reshape(-1)
        parts = {
            "sampler": losses.as_numpy(inputs["logprobs"]).reshape(-1),
            "adv": losses.as_numpy(inputs["advantages"]).reshape(-1),
            "mask": losses.as_numpy(inputs["mask"]).reshape(-1),
        }
        for k, v in parts.items():
            if v.shape != target.shape:
                raise ValueError(f"datum {i}: {k} has {v.shape[0]} values, target_tokens {target.shape[0]}")
            fields[k].append(v)
        fields["target"].append(target)
        tokens = datum.model_input.to_ints()
        first.append(tokens[0] if tokens else -1)
        lengths.append(target.shape[0])
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in fields.items()}
    return {
        "sampler_logprobs_N": cat["sampler"],
        "advantages_N": cat["adv"],
        "mask_N": cat["mask"],
        "target_tokens_N": cat["target"].astype(np.int64),
        "first_token_S": np.asarray(first, dtype=np.int64),
        "lengths_S": np.asarray(lengths, dtype=np.int64),
    }


def record_from_call(
    call_index: int,
    context: Mapping[str, JsonValue],
    data: Sequence[tinker.Datum],
    logprobs_list: Sequence[torch.Tensor],
    loss_cfg: losses.LossConfig,
) -> LossCallRecord:
    """Run the packed path's terms (`losses.datum_token_terms`, exactly what the loss computes)
    on the exact tensors of one loss call and build its record."""

    inputs = packed_inputs(data)
    lp_N = torch.cat([lp.detach().reshape(-1) for lp in logprobs_list]) if len(logprobs_list) else torch.zeros(0)
    if lp_N.shape[0] != inputs["target_tokens_N"].shape[0]:
        raise ValueError(f"loss got {lp_N.shape[0]} logprobs for {inputs['target_tokens_N'].shape[0]} targets")
    terms = losses.datum_token_terms(data, [lp.detach() for lp in logprobs_list], loss_cfg)
    decisions = {
        "dppo_keep_N": terms.dppo_keep_N.cpu().numpy().astype(bool),
        "ppo_clipped_N": terms.ppo_clipped_N.cpu().numpy().astype(bool),
        "ratio_cap_hit_N": terms.ratio_cap_hit_N.cpu().numpy().astype(bool),
    }
    tensors = {"logprobs_N": lp_N.clone().cpu().numpy(), **inputs, **decisions}
    prob_diff_N = terms.prob_diff_N.cpu().numpy()
    stats = decision_stats(
        prob_diff_N,
        tensors["advantages_N"].astype(np.float64),
        terms.loss_token_N.cpu().numpy().astype(bool),
        decisions["dppo_keep_N"],
        decisions["ppo_clipped_N"],
        decisions["ratio_cap_hit_N"],
        delta=loss_cfg.dppo_delta,
    )
    stats["decision_dtype"] = str(terms.prob_diff_N.dtype).replace("torch.", "")
    return LossCallRecord(
        call_index=call_index,
        context=dict(context),
        dtype=str(lp_N.dtype).replace("torch.", ""),
        tensors=tensors,
        stats=stats,
        started_unix=time.time(),
        prob_diff_N=prob_diff_N,
    )


class LossCallRecorder:
    """Wraps loss functions so every call is recorded before the loss runs.

    `on_record` (e.g. a persisting sink) runs after the loss returned, with its metrics attached;
    a record is kept even when the loss raises, so a crash still leaves what the loss saw.
    """

    def __init__(self, loss_cfg: losses.LossConfig, on_record: Callable[[LossCallRecord], None] | None = None):
        self.loss_cfg = loss_cfg
        self.on_record = on_record
        self.records: list[LossCallRecord] = []

    def wrap(self, loss_fn: CustomLossFn, **context: JsonValue) -> CustomLossFn:
        def recorded_loss_fn(data: list, logprobs_list: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
            record = record_from_call(len(self.records), context, data, logprobs_list, self.loss_cfg)
            self.records.append(record)
            t0 = time.perf_counter()
            loss, metrics = loss_fn(data, logprobs_list)
            record.loss_seconds = time.perf_counter() - t0
            record.loss_metrics = {k: float(v) for k, v in metrics.items()}
            if self.on_record is not None:
                self.on_record(record)
            return loss, metrics

        return recorded_loss_fn


# ---- consistency between the loss's own metrics and the recorder's -----------------------------

# Loss metric name -> recorder stat compared against it (counts exactly, fractions to 1e-9).
LOSS_METRIC_CROSSCHECK: tuple[str, ...] = (
    "tokens/loss",
    "tokens/nonzero_adv",
    "dppo/removed",
    "dppo/removed_pos_adv",
    "dppo/removed_neg_adv",
    "dppo/exceed_pos",
    "dppo/exceed_neg",
    "dppo/ratio_cap_hits",
    "ppo/clipped",
)


def crosscheck_loss_metrics(record: LossCallRecord) -> list[str]:
    """Disagreements between what the loss reported and what the recorder counted."""
    problems = []
    for key in LOSS_METRIC_CROSSCHECK:
        if key not in record.loss_metrics:
            problems.append(f"call {record.call_index}: loss did not report {key}")
            continue
        got, want = record.loss_metrics[key], record.stats[key]
        if not math.isclose(float(got), float(want), rel_tol=0.0, abs_tol=1e-6):
            problems.append(f"call {record.call_index}: loss reported {key}={got}, recorder {want}")
    return problems


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
        out = []
        for i, m in enumerate(meta["calls"]):
            tensors = {name: z[f"c{i}.{name}"] for name in TENSOR_FIELDS}
            out.append(
                LossCallRecord(
                    call_index=m["call_index"],
                    context=m["context"],
                    dtype=m["dtype"],
                    tensors=tensors,
                    stats=m["stats"],
                    loss_metrics=m["loss_metrics"],
                    started_unix=m["started_unix"],
                    loss_seconds=m["loss_seconds"],
                )
            )
        return out


def is_record_file(data: bytes) -> bool:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return META_KEY in z.files
    except Exception:  # not an npz at all
        return False


def summary_row(record: LossCallRecord) -> JsonObject:
    """The scalar statistics of one call (no histograms), for result.json and reports."""
    row: JsonObject = {k: record.stats.get(k) for k in COUNT_KEYS + FLOAT_KEYS}
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

    by_sign: JsonObject = {}
    for name, sel in (("pos", adv > 0), ("neg", adv < 0)):
        by_sign[name] = {
            "tokens": int(sel.sum()),
            "mean_p_minus_p_init": float(vs_init[sel].mean()) if sel.any() else None,
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


def record_prob_diff(record: LossCallRecord, loss_cfg: losses.LossConfig) -> np.ndarray:
    """p - q of a record (float64, 0 off loss tokens): kept from the call, else recomputed with
    the packed path from the saved tensors (records loaded from disk carry no p - q)."""
    if record.prob_diff_N is not None:
        return record.prob_diff_N

    t = record.tensors
    terms = losses.token_terms(
        torch.from_numpy(t["logprobs_N"]),
        torch.from_numpy(t["sampler_logprobs_N"].astype(np.float64)),
        torch.from_numpy(t["advantages_N"].astype(np.float64)),
        torch.from_numpy(t["mask_N"].astype(np.float64)),
        loss_cfg,
    )
    record.prob_diff_N = terms.prob_diff_N.numpy()
    return record.prob_diff_N

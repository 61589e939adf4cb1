"""The per-token terms every loss rule decides on (`TokenTerms`: one loss call's decisions, as the
packed path or replay's independent recompute made them), `stats(terms) -> LossStats`, the one
function that counts them, and the families of decisions a rule may train with (`DECISIONS`).

Every consumer reads the same `LossStats` (the loss's returned metrics, the record and its npz
meta, pooling, replay, the diagnostic); each field carries its recorded name and its kind (`count`:
compared exactly, `float`: to float tolerance, `drift`: a p - q tail that no decision moves), and a
`LossStats` is also a read-only mapping from recorded name to value. The p - q histogram's edges
always include delta (`magnitude_edges`), so the bins beyond +-delta hold exactly the strict
exceedances. No torch import: plan loading reads the registry, which imports this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from dppo_harness.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    import torch

Kind = Literal["count", "float", "drift", "hist", "info"]
HIST_SIGNS: tuple[str, ...] = ("pos", "neg", "zero")  # advantage sign of the loss token

# |p - q| bin edges besides delta, right-closed (a, b]; the first bin is [0, first edge].
_BASE_EDGES: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)


@dataclass(frozen=True)
class TokenTerms:
    """Flat packed per-token terms over N tokens (detached, float64 / bool) and the thresholds
    they were decided at."""

    prob_diff_N: torch.Tensor  # p - q on loss tokens, 0.0 elsewhere
    ratio_N: torch.Tensor  # r = exp(lp - mu) on loss tokens, 1.0 elsewhere
    dppo_keep_N: torch.Tensor  # recorded DPPO mask (includes the loss mask, like the reference)
    ppo_clipped_N: torch.Tensor  # clamp active and removing the gradient
    ratio_cap_hit_N: torch.Tensor  # loss & A != 0 & kept & r > C
    loss_token_N: torch.Tensor  # mask == 1
    nonzero_adv_N: torch.Tensor  # loss & A != 0
    advantages_N: torch.Tensor  # float64, as given (junk kept on non-loss tokens)
    dppo_delta: float
    ppo_eps: float
    ratio_cap: float


DECISION_FIELDS = ("dppo_keep_N", "ppo_clipped_N", "ratio_cap_hit_N")  # kept per loss-call record, replayed


def magnitude_edges(delta: float) -> tuple[float, ...]:
    """The |p - q| bin edges at `delta`: the base edges with delta added (an edge once)."""
    return tuple(sorted({*_BASE_EDGES, float(delta)}))


def hist_bin_labels(edges: tuple[float, ...]) -> list[str]:
    """Human-readable labels of the signed p - q bins, most negative first."""
    mags = (0.0,) + edges
    neg = [f"[-{mags[i + 1]:g},-{mags[i]:g})" for i in range(len(edges) - 1, 0, -1)]
    pos = [f"({mags[i]:g},{mags[i + 1]:g}]" for i in range(1, len(edges))]
    return neg + [f"[-{edges[0]:g},{edges[0]:g}]"] + pos


def hist_bin_index(prob_diff: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """Signed bin of each p - q value, comparing in the values' own dtype (like the loss does)."""
    e = np.asarray(edges, dtype=prob_diff.dtype)
    mag_idx = np.minimum(np.searchsorted(e, np.abs(prob_diff), side="left"), len(edges) - 1)
    center = len(edges) - 1
    return np.where(prob_diff > 0, center + mag_idx, center - mag_idx)


def delta_bins(delta: float) -> tuple[int, int]:
    """(first bin above +delta, last bin below -delta) in the bins of `magnitude_edges(delta)`."""
    edges = magnitude_edges(delta)
    k = edges.index(float(delta)) + 1
    center = len(edges) - 1
    return center + k, center - k


@dataclass(frozen=True)
class Histogram:
    """Counts of loss tokens per signed p - q bin, split by advantage sign."""

    edges: tuple[float, ...]
    pos: tuple[int, ...]
    neg: tuple[int, ...]
    zero: tuple[int, ...]

    def recorded(self) -> JsonObject:
        return {"pos": [*self.pos], "neg": [*self.neg], "zero": [*self.zero]}

    def labels(self) -> list[str]:
        return hist_bin_labels(self.edges)


def _metric(name: str, kind: Kind, *, returned: bool = False) -> Any:
    """A `LossStats` field: its recorded name, its kind, and whether the loss returns it to the SDK."""
    return field(metadata={"name": name, "kind": kind, "returned": returned})


@dataclass(frozen=True)
class LossStats(Mapping[str, Any]):
    """Every statistic of one loss call; field order is the recorded order."""

    tokens_loss: int = _metric("tokens/loss", "count", returned=True)
    tokens_nonzero_adv: int = _metric("tokens/nonzero_adv", "count", returned=True)
    tokens_pos_adv: int = _metric("tokens/pos_adv", "count")
    tokens_neg_adv: int = _metric("tokens/neg_adv", "count")
    tokens_zero_adv: int = _metric("tokens/zero_adv", "count")
    dppo_removed: int = _metric("dppo/removed", "count", returned=True)
    dppo_removed_pos_adv: int = _metric("dppo/removed_pos_adv", "count", returned=True)
    dppo_removed_neg_adv: int = _metric("dppo/removed_neg_adv", "count", returned=True)
    dppo_masked_frac_loss_tokens: float = _metric("dppo/masked_frac_loss_tokens", "float", returned=True)
    dppo_masked_frac_nonzero_adv: float = _metric("dppo/masked_frac_nonzero_adv", "float", returned=True)
    dppo_mask_zero_adv: int = _metric("dppo/mask_zero_adv", "count", returned=True)
    dppo_exceed_pos: int = _metric("dppo/exceed_pos", "count", returned=True)
    dppo_exceed_neg: int = _metric("dppo/exceed_neg", "count", returned=True)
    dppo_exceed_pos_on_pos_adv: int = _metric("dppo/exceed_pos_on_pos_adv", "count")
    dppo_exceed_neg_on_neg_adv: int = _metric("dppo/exceed_neg_on_neg_adv", "count")
    dppo_ratio_cap_hits: int = _metric("dppo/ratio_cap_hits", "count", returned=True)
    ppo_clipped: int = _metric("ppo/clipped", "count", returned=True)
    ppo_clipped_pos_adv: int = _metric("ppo/clipped_pos_adv", "count")
    ppo_clipped_neg_adv: int = _metric("ppo/clipped_neg_adv", "count")
    ppo_clip_frac_loss_tokens: float = _metric("ppo/clip_frac_loss_tokens", "float", returned=True)
    ppo_clip_frac_nonzero_adv: float = _metric("ppo/clip_frac_nonzero_adv", "float", returned=True)
    drift_signed_p90: float = _metric("drift/signed_p90", "drift", returned=True)
    drift_signed_p99: float = _metric("drift/signed_p99", "drift", returned=True)
    drift_signed_max: float = _metric("drift/signed_max", "drift", returned=True)
    drift_signed_min: float = _metric("drift/signed_min", "drift", returned=True)
    drift_abs_p90: float = _metric("drift/abs_p90", "drift", returned=True)
    drift_abs_p99: float = _metric("drift/abs_p99", "drift", returned=True)
    drift_abs_max: float = _metric("drift/abs_max", "drift", returned=True)
    # The tails that matter for the directional mask: up-moves on A>0, down-moves on A<0.
    drift_max_on_pos_adv: float | None = _metric("drift/max_on_pos_adv", "drift")
    drift_min_on_neg_adv: float | None = _metric("drift/min_on_neg_adv", "drift")
    hist: Histogram = _metric("hist", "hist")  # noqa: RUF009 - a field's metadata, not a default
    decision_dtype: str = _metric("decision_dtype", "info")

    @classmethod
    def names(cls, *kinds: Kind, returned: bool | None = None) -> tuple[str, ...]:
        """Recorded names of the fields of the given kinds (all kinds when none is given), in order;
        `returned`: only the metrics the loss returns (True) or only the others (False)."""
        return tuple(
            f.metadata["name"]
            for f in dataclasses.fields(cls)
            if (not kinds or f.metadata["kind"] in kinds) and returned in (None, f.metadata["returned"])
        )

    @classmethod
    def scalar_names(cls) -> tuple[str, ...]:
        """The scalar statistics (no histogram, no dtype): counts first, then fractions and tails."""
        return cls.names("count") + cls.names("float", "drift")

    def __getitem__(self, name: str) -> Any:
        if name not in _FIELDS:
            raise KeyError(name)
        value = getattr(self, _FIELDS[name].name)
        return value.recorded() if isinstance(value, Histogram) else value

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def recorded(self) -> JsonObject:
        """The statistics as the record's meta and the evidence write them, by recorded name."""
        return {name: self[name] for name in _FIELDS}

    def metrics(self) -> dict[str, float]:
        """What the loss returns to the SDK: the `returned` statistics as plain floats."""
        return {name: float(self[name]) for name in self.names(returned=True)}

    @classmethod
    def from_recorded(cls, stats: Mapping[str, JsonValue], edges: tuple[float, ...]) -> LossStats:
        """Inverse of `recorded` (a record read back from its npz meta; `edges` from the same meta)."""
        missing = [name for name in _FIELDS if name not in stats]
        if missing:
            raise ValueError(f"loss-call statistics lack {missing}")
        values: dict[str, Any] = {f.name: stats[f.metadata["name"]] for f in dataclasses.fields(cls)}
        hist = stats["hist"]
        counts = [hist.get(s) if isinstance(hist, dict) else None for s in HIST_SIGNS]
        ints = [tuple(n for n in c if isinstance(n, int)) if isinstance(c, list) else () for c in counts]
        if [len(c) if isinstance(c, list) else -1 for c in counts] != [len(c) for c in ints]:
            raise ValueError(f"loss-call statistics: hist is not counts by advantage sign: {hist!r}")
        values["hist"] = Histogram(edges, *ints)
        return cls(**values)

    @classmethod
    def from_row(cls, row: Mapping[str, JsonValue]) -> LossStats:
        """A block of the scalar statistics by recorded name (a per-update row, a pooled block; they
        keep no histogram edges or dtype), typed once so it is read by field."""
        return cls.from_recorded({**row, "hist": {k: [] for k in HIST_SIGNS}, "decision_dtype": ""}, ())

    @staticmethod
    def recorded_name(field_name: str) -> str:
        """The name a field is recorded under (`dppo_removed` -> "dppo/removed")."""
        return str(_BY_FIELD[field_name].metadata["name"])


_FIELDS: dict[str, dataclasses.Field[Any]] = {f.metadata["name"]: f for f in dataclasses.fields(LossStats)}
_BY_FIELD = {f.name: f for f in _FIELDS.values()}


@dataclass(frozen=True)
class Decision:
    """A family of per-token decisions a rule may train with (`LossEntry.decisions`); every loss call
    counts each family, counterfactually for an arm that trains with another. Its statistics: `removed`
    (A != 0 loss tokens it takes out of the gradient), that count over the loss tokens or the A != 0
    ones (`fraction`); its step-row keys (`row_keys`: the step's pooled fraction, its last update's)."""

    name: str  # the prefix of its statistics' recorded names; upper case in the reports' labels
    verb: str  # what it does to a token, in labels and row keys
    past: str  # its count's recorded name

    @property
    def removed(self) -> str:
        return f"{self.name}/{self.past}"

    def fraction(self, over: str = "loss_tokens") -> str:
        return f"{self.name}/{self.verb}_frac_{over}"

    @property
    def row_keys(self) -> tuple[str, str]:
        return f"{self.name}_{self.verb}_frac", f"last_update_{self.verb}_frac"


DPPO_MASK = Decision("dppo", "masked", "removed")
PPO_CLIP = Decision("ppo", "clip", "clipped")
DECISIONS = (DPPO_MASK, PPO_CLIP)


def row_label(key: str, *, trained: bool) -> str:
    return key if trained else f"counterfactual_{key}"


class RowFraction(NamedTuple):
    value: float
    counterfactual: bool  # the arm does not train with the decision: it removed nothing from its gradient


def row_fraction(row: Mapping[str, object], base: str) -> RowFraction:
    """A decision's fraction in a step row (`base`: one of its `row_keys`), whichever label it carries."""
    for key in (base, row_label(base, trained=False)):
        if key in row:
            value = row[key]
            if not isinstance(value, (int, float)):
                raise TypeError(f"step row {key}: {value!r} is not a number")
            return RowFraction(float(value), key != base)
    raise KeyError(base)


def _quantiles(values: np.ndarray) -> tuple[float, float, float, float]:
    """(q90, q99, max, min); zeros when there is no value."""
    if values.size == 0:
        return 0.0, 0.0, 0.0, 0.0
    q90, q99 = np.quantile(values, (0.9, 0.99))
    return float(q90), float(q99), float(values.max()), float(values.min())


def stats(terms: TokenTerms) -> LossStats:
    """Every statistic of one loss call, from its decisions and p - q (the one place they are counted)."""
    loss = np.asarray(terms.loss_token_N).astype(bool)
    adv = np.asarray(terms.advantages_N)
    d = np.asarray(terms.prob_diff_N)
    pos, neg, zero = loss & (adv > 0), loss & (adv < 0), loss & (adv == 0)
    nonzero = pos | neg
    dropped = loss & ~np.asarray(terms.dppo_keep_N).astype(bool)
    removed = dropped & nonzero
    clipped = loss & np.asarray(terms.ppo_clipped_N).astype(bool)
    delta = np.asarray(terms.dppo_delta, dtype=d.dtype)
    exceed_pos, exceed_neg = loss & (d > delta), loss & (d < -delta)
    n_loss, n_nonzero, n_removed, n_clipped = (int(x.sum()) for x in (loss, nonzero, removed, clipped))
    loss_d = d[loss].astype(np.float64)
    signed, absolute = _quantiles(loss_d), _quantiles(np.abs(loss_d))
    edges = magnitude_edges(terms.dppo_delta)
    idx = hist_bin_index(d, edges)
    n_bins = 2 * len(edges) - 1
    counts = [tuple(int(c) for c in np.bincount(idx[m], minlength=n_bins)) for m in (pos, neg, zero)]

    def frac(num: int, den: int) -> float:
        return num / den if den else 0.0

    return LossStats(
        tokens_loss=n_loss,
        tokens_nonzero_adv=n_nonzero,
        tokens_pos_adv=int(pos.sum()),
        tokens_neg_adv=int(neg.sum()),
        tokens_zero_adv=int(zero.sum()),
        dppo_removed=n_removed,
        dppo_removed_pos_adv=int((removed & pos).sum()),
        dppo_removed_neg_adv=int((removed & neg).sum()),
        dppo_masked_frac_loss_tokens=frac(n_removed, n_loss),
        dppo_masked_frac_nonzero_adv=frac(n_removed, n_nonzero),
        dppo_mask_zero_adv=int((dropped & zero).sum()),
        dppo_exceed_pos=int(exceed_pos.sum()),
        dppo_exceed_neg=int(exceed_neg.sum()),
        dppo_exceed_pos_on_pos_adv=int((exceed_pos & pos).sum()),
        dppo_exceed_neg_on_neg_adv=int((exceed_neg & neg).sum()),
        dppo_ratio_cap_hits=int((loss & np.asarray(terms.ratio_cap_hit_N).astype(bool)).sum()),
        ppo_clipped=n_clipped,
        ppo_clipped_pos_adv=int((clipped & pos).sum()),
        ppo_clipped_neg_adv=int((clipped & neg).sum()),
        ppo_clip_frac_loss_tokens=frac(n_clipped, n_loss),
        ppo_clip_frac_nonzero_adv=frac(n_clipped, n_nonzero),
        drift_signed_p90=signed[0],
        drift_signed_p99=signed[1],
        drift_signed_max=signed[2],
        drift_signed_min=signed[3],
        drift_abs_p90=absolute[0],
        drift_abs_p99=absolute[1],
        drift_abs_max=absolute[2],
        drift_max_on_pos_adv=float(d[pos].max()) if pos.any() else None,
        drift_min_on_neg_adv=float(d[neg].min()) if neg.any() else None,
        hist=Histogram(edges, *counts),
        decision_dtype=str(d.dtype),
    )

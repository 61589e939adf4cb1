"""Pooled loss-call statistics, and the diagnostic evidence file names that replay and the
session read as well (the diagnostic's other file names live in `stages.diagnostic.write`).

The lower module under both the diagnostic (which pools the second-epoch calls it trained) and
`replay` (which pools its independent recompute of the same calls): neither imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonObject
from dppo_harness.loss.terms import HIST_SIGNS, LossStats

ANALYSIS_FILE = "diagnostic-analysis.json"
REVISED_SPEC_FILE = "revised-diagnostic-spec.json"
FROZEN_BATCH_STEM = "diagnostic-frozen-batch"


# Token-weighted ratios: summed numerator over summed denominator across pooled calls.
RATIO_PARTS = {
    "dppo/masked_frac_loss_tokens": ("dppo/removed", "tokens/loss"),
    "dppo/masked_frac_nonzero_adv": ("dppo/removed", "tokens/nonzero_adv"),
    "ppo/clip_frac_loss_tokens": ("ppo/clipped", "tokens/loss"),
    "ppo/clip_frac_nonzero_adv": ("ppo/clipped", "tokens/nonzero_adv"),
}
POOLED_QUANTILES = {
    "drift/abs_p90": (True, 0.9),
    "drift/abs_p99": (True, 0.99),
    "drift/signed_p90": (False, 0.9),
    "drift/signed_p99": (False, 0.99),
}


def pool_calls(records: Sequence[ins.LossCallRecord], prob_diffs: Sequence[np.ndarray]) -> JsonObject:
    """Pooled statistics of the given loss calls, weighted by their loss-token counts."""
    sums = {k: int(sum(r.stats[k] for r in records)) for k in LossStats.names("count")}
    pooled: JsonObject = {"calls": len(records), **sums}
    for metric, (num, den) in RATIO_PARTS.items():
        pooled[metric] = sums[num] / sums[den] if sums[den] else 0.0
    loss_d = [d[r.tensors["mask_N"] != 0] for r, d in zip(records, prob_diffs, strict=True)]
    d = np.concatenate(loss_d) if loss_d else np.zeros(0)
    adv = (
        np.concatenate([r.tensors["advantages_N"][r.tensors["mask_N"] != 0] for r in records])
        if records
        else np.zeros(0)
    )
    for metric, (absolute, q) in POOLED_QUANTILES.items():
        x = np.abs(d) if absolute else d
        pooled[metric] = float(np.quantile(x, q)) if x.size else None
    pooled["drift/abs_max"] = float(np.abs(d).max()) if d.size else None
    pooled["drift/signed_max"] = float(d.max()) if d.size else None
    pooled["drift/signed_min"] = float(d.min()) if d.size else None
    pooled["drift/max_on_pos_adv"] = float(d[adv > 0].max()) if (adv > 0).any() else None
    pooled["drift/min_on_neg_adv"] = float(d[adv < 0].min()) if (adv < 0).any() else None
    edges = {r.stats.hist.edges for r in records}
    if len(edges) > 1:
        raise ValueError(f"pooled loss calls were binned at different p - q edges: {sorted(edges)}")
    n_bins = 2 * len(edges.pop()) - 1 if edges else 0
    hist = {s: np.zeros(n_bins, dtype=np.int64) for s in HIST_SIGNS}
    for r in records:
        for s in HIST_SIGNS:
            hist[s] += np.asarray(getattr(r.stats.hist, s), dtype=np.int64)
    pooled["hist"] = {s: [*h.tolist()] for s, h in hist.items()}
    return pooled

"""The report's matplotlib PNG plots (Agg backend): the diagnostic's per-update drift, histograms,
fractions and sentinels, and the comparison's per-step reward, fractions, truncation and accuracy
difference."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dppo_harness.evidence.report.text import rows_by_arm
from dppo_harness.json_types import JsonMap, items, num, obj, objs
from dppo_harness.loss.terms import DECISIONS, LossStats, delta_bins, hist_bin_labels, magnitude_edges, row_fraction

# The diagnostic's plots: file name and the report's title, in the report's order.
PLOTS = {
    "drift_tails": ("diagnostic-drift-tails.png", "Drift tails per update"),
    "histograms": ("diagnostic-p-minus-q-histograms.png", "p - q histograms by advantage sign"),
    "fractions": ("diagnostic-masked-and-clip-fraction.png", "Masked and clip fraction per update"),
    "sentinels": ("diagnostic-sentinel-drift.png", "Sentinel drift"),
}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def plot_drift_tails(rows: Sequence[JsonMap], delta: float) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [num(r["update_index"]) for r in rows]
    stats = [LossStats.from_row(r) for r in rows]
    for stat, style in zip(("signed_max", "signed_p99", "signed_p90", "signed_min", "abs_p90", "abs_p99"), "^o.vsD"):
        line = ("--" if stat.startswith("abs") else "-") + style
        ys = [float("nan") if (v := getattr(s, f"drift_{stat}")) is None else float(v) for s in stats]
        ax.plot(x, ys, line, label=LossStats.recorded_name(f"drift_{stat}"), ms=4)
    for y in (delta, -delta):
        ax.axhline(y, color="red", lw=1, ls=":")
    ax.text(x[0] if x else 0, delta, f" +delta {delta}", color="red", va="bottom", fontsize=8)
    ax.text(x[0] if x else 0, -delta, f" -delta {-delta}", color="red", va="top", fontsize=8)
    ax.set(xlabel="optimizer update (loss call before it)", ylabel="p - q over loss tokens")
    ax.set_title("Drift tails per update (p current, q sampler)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_histograms(hist: JsonMap, delta: float, scope: str) -> bytes:
    labels = hist_bin_labels(magnitude_edges(delta))
    up, down = delta_bins(delta)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharey=True)
    for ax, sign, title in zip(axes, ("pos", "neg", "zero"), ("A > 0", "A < 0", "A = 0 (never engagement)")):
        counts = [num(c) for c in items(hist[sign])] if sign in hist else [0] * len(labels)
        colors = ["tab:red" if (i >= up or i <= down) else "tab:blue" for i in range(len(labels))]
        ax.bar(range(len(labels)), [max(c, 0) for c in counts], color=colors)
        ax.set_yscale("symlog", linthresh=1)
        for b in (up - 0.5, down + 0.5):
            ax.axvline(b, color="red", ls=":", lw=1)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set_title(f"{title}: {sum(counts)} tokens")
    axes[0].set_ylabel("loss tokens")
    fig.suptitle(f"p - q histograms by advantage sign ({scope}); red bins lie beyond +-delta {delta}")
    return _png(fig)


def plot_fractions(rows: Sequence[JsonMap], criteria: Sequence[JsonMap]) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [num(r["update_index"]) for r in rows]
    for i, d in enumerate(DECISIONS):
        for over, ls in (("loss_tokens", "-"), ("nonzero_adv", "--")):
            key = d.fraction(over)
            ax.plot(x, [num(r[key]) for r in rows], ls + "os^v"[i % 4], label=key, ms=4)
    for c in criteria:
        if c["metric"] in {d.fraction() for d in DECISIONS}:
            bounds = obj(c["bounds"])
            for bound in ("min", "max"):
                if bound in bounds:
                    ax.axhline(num(bounds[bound]), ls=":", lw=1, color="gray")
                    y, label = num(bounds[bound]), f"{c['id']} {bound}"
                    ax.text(x[-1] if x else 0, y, label, fontsize=7, ha="right", color="gray")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set(xlabel="optimizer update", ylabel="fraction")
    ax.set_title("DPPO masked fraction and counterfactual PPO clip fraction per update")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_sentinels(points: Sequence[JsonMap]) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [num(p["after_update"]) for p in points]
    s = [obj(p["summary"]) for p in points]
    for key, stat, style, label in (
        ("p_minus_q", "abs_p90", "-o", "|p - q_sampler| q90"),
        ("p_minus_q", "abs_max", "--o", "|p - q_sampler| max"),
        ("p_minus_p_init", "abs_p90", "-s", "|p - p_init| q90 (optimizer drift)"),
        ("p_minus_p_init", "abs_max", "--s", "|p - p_init| max"),
    ):
        ax.plot(x, [num(obj(v[key])[stat]) for v in s], style, label=label)
    ax.set(xlabel="after optimizer update", ylabel="probability difference")
    ax.set_title("Sentinel tokens: initial trainer/sampler mismatch vs optimizer drift")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)


def make_plots(analysis: JsonMap) -> dict[str, bytes]:
    rows = objs(analysis.get("per_update") or [])
    delta = num(obj(analysis["config"])["delta"])
    out: dict[str, bytes] = {}
    if rows:
        out["drift_tails"] = plot_drift_tails(rows, delta)
        out["fractions"] = plot_fractions(rows, objs(analysis.get("criteria", [])))
    pooled = analysis.get("pooled_second_epoch")
    if pooled:
        out["histograms"] = plot_histograms(obj(obj(pooled)["hist"]), delta, "pooled over all second-epoch loss calls")
    sentinels = obj(analysis["sentinels"]) if analysis.get("sentinels") else {}
    points = objs(sentinels.get("points") or [])
    if points:
        out["sentinels"] = plot_sentinels(points)
    return out


COMPARISON_PLOTS = {
    "reward": "comparison-reward-per-step.png",
    "fractions": "comparison-masked-and-clip-fraction.png",
    "truncation": "comparison-truncation-and-answer-yield.png",
    "difference": "comparison-accuracy-difference-ci.png",
}


def plot_comparison_reward(rows: Sequence[JsonMap]) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm, rs in rows_by_arm(rows).items():
        ax.plot([num(r["step"]) + 1 for r in rs], [num(r["reward_mean"]) for r in rs], marker="o", label=arm)
    ax.set_xlabel("rollout step"), ax.set_ylabel("mean reward of the step's batch"), ax.legend()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("per-step reward, both arms")
    return _png(fig)


def plot_comparison_fractions(rows: Sequence[JsonMap]) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm, rs in rows_by_arm(rows).items():
        xs = [num(r["step"]) + 1 for r in rs]
        for i, d in enumerate(DECISIONS):
            cf = row_fraction(rs[0], d.row_keys[0]).counterfactual
            ax.plot(
                xs,
                [row_fraction(r, d.row_keys[0]).value for r in rs],
                marker="ox^v"[i % 4],
                linestyle=":" if cf else ("-", "--", "-.")[i % 3],
                label=f"{arm}: {d.name.upper()} {d.verb} fraction{' (counterfactual)' if cf else ''}",
            )
    ax.set_xlabel("rollout step"), ax.set_ylabel("fraction of loss tokens"), ax.legend(fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("masked / clipped fraction per step (token-pooled over the step's updates)")
    return _png(fig)


def plot_truncation(rows: Sequence[JsonMap], eval_metrics: Mapping[str, JsonMap], max_tokens: int | None) -> bytes:
    """Per step and arm: truncated at max_tokens and no parseable answer; right: each scored model."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    for arm, rs in rows_by_arm(rows).items():
        xs = [num(r["step"]) + 1 for r in rs]
        for key, marker, ls, what in (
            ("truncated", "o", "-", "truncated"),
            ("no_answer", "x", "--", "no parseable answer"),
        ):
            ax1.plot(
                xs,
                [num(r.get(f"{key}_frac", float("nan"))) for r in rs],
                marker=marker,
                linestyle=ls,
                label=f"{arm}: {what}",
            )
    ax1.set_ylim(-0.02, 1.02), ax1.set_xlabel("rollout step"), ax1.set_ylabel("fraction of the step's responses")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_title(f"rollouts (T=1): stopped at max_tokens {max_tokens or ''} / no \\boxed{{}} answer", fontsize=9)
    ax1.legend(fontsize=7)
    models = [m for m in eval_metrics if "eval_truncated_frac" in eval_metrics[m]]
    model_xs = range(len(models))
    for shift, key, label in ((-0.2, "truncated", "truncated"), (0.2, "no_answer", "no parseable answer")):
        fracs = [num(eval_metrics[m][f"eval_{key}_frac"]) for m in models]
        ax2.bar([x + shift for x in model_xs], fracs, width=0.4, label=label)
    ax2.set_xticks(list(model_xs), models, fontsize=7), ax2.set_ylim(0, 1.3)
    ax2.legend(fontsize=7, loc="upper center", ncol=2)
    ax2.set_title("greedy evaluation, per scored model", fontsize=9)
    fig.tight_layout()
    return _png(fig)


def plot_accuracy_difference(scores: Sequence[JsonMap], decision: JsonMap) -> bytes:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar([str(s["arm"]) for s in scores], [num(s["value"]) for s in scores])
    ax1.set_ylim(0, 1), ax1.set_ylabel("greedy accuracy"), ax1.set_title("accuracy per scored model")
    # Each criterion's Hoeffding interval (the rule) with its margin, then the informational interval.
    intervals: list[tuple[str, JsonMap, str, str | None, str]] = [
        (str(c["id"]), c, "o", None, "Hoeffding (rule)") for c in objs(decision.get("criteria", []))
    ]
    if decision.get("informational"):
        intervals.append(("informational", obj(decision["informational"]), "s", "tab:gray", "Newcombe (informational)"))
    for i, (_, c, marker, color, label) in enumerate(intervals):
        d = num(c["mean_difference"])
        yerr = [[d - num(c["lower"])], [num(c["upper"]) - d]]
        ax2.errorbar([i], [d], yerr=yerr, fmt=marker, capsize=6, color=color, label=label)
        if color is None:
            ax2.axhline(num(c["margin"]), color="grey", linestyle=":")
    labels = [iv[0] for iv in intervals]
    ax2.set_xticks(range(len(labels)), labels)
    ax2.set_ylabel("treatment - baseline"), ax2.set_title("paired difference: rule CI and informational CI")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)

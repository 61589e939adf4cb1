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

from dppo_harness.evidence.report.text import rows_by_arm, rule_fraction
from dppo_harness.json_types import JsonMap, items, num, obj, objs
from dppo_harness.loss.terms import delta_bins, hist_bin_labels, magnitude_edges

PLOTS = {
    "drift_tails": "diagnostic-drift-tails.png",
    "histograms": "diagnostic-p-minus-q-histograms.png",
    "fractions": "diagnostic-masked-and-clip-fraction.png",
    "sentinels": "diagnostic-sentinel-drift.png",
}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _xs(rows: Sequence[JsonMap]) -> list[float]:
    return [num(r["update_index"]) for r in rows]


def plot_drift_tails(rows: Sequence[JsonMap], delta: float) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = _xs(rows)
    for key, style in (
        ("drift/signed_max", "-^"),
        ("drift/signed_p99", "-o"),
        ("drift/signed_p90", "-."),
        ("drift/signed_min", "-v"),
        ("drift/abs_p90", "--s"),
        ("drift/abs_p99", "--D"),
    ):
        ax.plot(
            x, [float(num(v)) if (v := r.get(key)) is not None else float("nan") for r in rows], style, label=key, ms=4
        )
    for y in (delta, -delta):
        ax.axhline(y, color="red", lw=1, ls=":")
    ax.text(x[0] if x else 0, delta, f" +delta {delta}", color="red", va="bottom", fontsize=8)
    ax.text(x[0] if x else 0, -delta, f" -delta {-delta}", color="red", va="top", fontsize=8)
    ax.set_xlabel("optimizer update (loss call before it)")
    ax.set_ylabel("p - q over loss tokens")
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
    x = _xs(rows)
    for key, style in (
        ("dppo/masked_frac_loss_tokens", "-o"),
        ("dppo/masked_frac_nonzero_adv", "--o"),
        ("ppo/clip_frac_loss_tokens", "-s"),
        ("ppo/clip_frac_nonzero_adv", "--s"),
    ):
        ax.plot(x, [num(r[key]) for r in rows], style, label=key, ms=4)
    for c in criteria:
        if c["metric"] in ("dppo/masked_frac_loss_tokens", "ppo/clip_frac_loss_tokens"):
            bounds = obj(c["bounds"])
            for bound in ("min", "max"):
                if bound in bounds:
                    ax.axhline(num(bounds[bound]), ls=":", lw=1, color="gray")
                    ax.text(
                        x[-1] if x else 0,
                        num(bounds[bound]),
                        f"{c['id']} {bound}",
                        fontsize=7,
                        ha="right",
                        color="gray",
                    )
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("fraction")
    ax.set_title("DPPO masked fraction and counterfactual PPO clip fraction per update")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_sentinels(points: Sequence[JsonMap]) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [num(p["after_update"]) for p in points]
    s = [obj(p["summary"]) for p in points]
    ax.plot(x, [num(obj(v["p_minus_q"])["abs_p90"]) for v in s], "-o", label="|p - q_sampler| q90")
    ax.plot(x, [num(obj(v["p_minus_q"])["abs_max"]) for v in s], "--o", label="|p - q_sampler| max")
    ax.plot(x, [num(obj(v["p_minus_p_init"])["abs_p90"]) for v in s], "-s", label="|p - p_init| q90 (optimizer drift)")
    ax.plot(x, [num(obj(v["p_minus_p_init"])["abs_max"]) for v in s], "--s", label="|p - p_init| max")
    ax.set_xlabel("after optimizer update")
    ax.set_ylabel("probability difference")
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
        for base, title, marker, ls in (
            ("dppo_masked_frac", "DPPO masked fraction", "o", "-"),
            ("ppo_clip_frac", "PPO clip fraction", "x", "--"),
        ):
            cf = rule_fraction(rs[0], base)[0]
            ax.plot(
                xs,
                [rule_fraction(r, base)[1] for r in rs],
                marker=marker,
                linestyle=":" if cf else ls,
                label=f"{arm}: {title}{' (counterfactual)' if cf else ''}",
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
        ax1.plot(xs, [num(r.get("truncated_frac", float("nan"))) for r in rs], marker="o", label=f"{arm}: truncated")
        ax1.plot(
            xs,
            [num(r.get("no_answer_frac", float("nan"))) for r in rs],
            marker="x",
            linestyle="--",
            label=f"{arm}: no parseable answer",
        )
    ax1.set_ylim(-0.02, 1.02), ax1.set_xlabel("rollout step"), ax1.set_ylabel("fraction of the step's responses")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_title(f"rollouts (T=1): stopped at max_tokens {max_tokens or ''} / no \\boxed{{}} answer", fontsize=9)
    ax1.legend(fontsize=7)
    models = [m for m in eval_metrics if "eval_truncated_frac" in eval_metrics[m]]
    model_xs = range(len(models))
    ax2.bar(
        [x - 0.2 for x in model_xs],
        [num(eval_metrics[m]["eval_truncated_frac"]) for m in models],
        width=0.4,
        label="truncated",
    )
    ax2.bar(
        [x + 0.2 for x in model_xs],
        [num(eval_metrics[m]["eval_no_answer_frac"]) for m in models],
        width=0.4,
        label="no parseable answer",
    )
    ax2.set_xticks(list(model_xs), models, fontsize=7), ax2.set_ylim(0, 1.3)
    ax2.legend(fontsize=7, loc="upper center", ncol=2)
    ax2.set_title("greedy evaluation, per scored model", fontsize=9)
    fig.tight_layout()
    return _png(fig)


def plot_accuracy_difference(scores: Sequence[JsonMap], decision: JsonMap) -> bytes:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar([str(s["arm"]) for s in scores], [num(s["value"]) for s in scores])
    ax1.set_ylim(0, 1), ax1.set_ylabel("greedy accuracy"), ax1.set_title("accuracy per scored model")
    labels = []
    for i, c in enumerate(objs(decision.get("criteria", []))):
        d = num(c["mean_difference"])
        ax2.errorbar(
            [i], [d], yerr=[[d - num(c["lower"])], [num(c["upper"]) - d]], fmt="o", capsize=6, label="Hoeffding (rule)"
        )
        ax2.axhline(num(c["margin"]), color="grey", linestyle=":")
        labels.append(str(c["id"]))
    info = obj(decision["informational"]) if decision.get("informational") else None
    if info:
        d = num(info["mean_difference"])
        x = len(labels)
        ax2.errorbar(
            [x],
            [d],
            yerr=[[d - num(info["lower"])], [num(info["upper"]) - d]],
            fmt="s",
            capsize=6,
            color="tab:gray",
            label="Newcombe (informational)",
        )
        labels.append("informational")
    ax2.set_xticks(range(len(labels)), labels)
    ax2.set_ylabel("treatment - baseline"), ax2.set_title("paired difference: rule CI and informational CI")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)

"""`report.md` for the bounded diagnostic, with matplotlib PNG plots (Agg backend).

Everything is rendered from the analysis JSON the diagnostic registered (`diagnostic-analysis.json`)
so the report says exactly what the evidence says; nothing is re-measured here.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from dppo_harness.evidence.backend import backend_of, report_lines
from dppo_harness.instrument import instrumentation as ins

REPORT_FILE = "report.md"
PLOTS = {
    "drift_tails": "diagnostic-drift-tails.png",
    "histograms": "diagnostic-p-minus-q-histograms.png",
    "fractions": "diagnostic-masked-and-clip-fraction.png",
    "sentinels": "diagnostic-sentinel-drift.png",
}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _xs(rows):
    return [r["update_index"] for r in rows]


def plot_drift_tails(rows: list[dict[str, Any]], delta: float) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = _xs(rows)
    for key, style in (("drift/signed_max", "-^"), ("drift/signed_p99", "-o"), ("drift/signed_p90", "-."),
                       ("drift/signed_min", "-v"), ("drift/abs_p90", "--s"), ("drift/abs_p99", "--D")):
        ax.plot(x, [r.get(key) if r.get(key) is not None else float("nan") for r in rows], style, label=key, ms=4)
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


def plot_histograms(hist: Mapping[str, list[int]], delta: float, scope: str) -> bytes:
    labels = ins.hist_bin_labels()
    up, down = ins.delta_bins(delta)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharey=True)
    for ax, sign, title in zip(axes, ("pos", "neg", "zero"), ("A > 0", "A < 0", "A = 0 (never engagement)")):
        counts = hist.get(sign, [0] * len(labels))
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


def plot_fractions(rows: list[dict[str, Any]], criteria: list[dict[str, Any]]) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = _xs(rows)
    for key, style in (("dppo/masked_frac_loss_tokens", "-o"), ("dppo/masked_frac_nonzero_adv", "--o"),
                       ("ppo/clip_frac_loss_tokens", "-s"), ("ppo/clip_frac_nonzero_adv", "--s")):
        ax.plot(x, [r[key] for r in rows], style, label=key, ms=4)
    for c in criteria:
        if c["metric"] in ("dppo/masked_frac_loss_tokens", "ppo/clip_frac_loss_tokens"):
            for bound in ("min", "max"):
                if bound in c["bounds"]:
                    ax.axhline(c["bounds"][bound], ls=":", lw=1, color="gray")
                    ax.text(x[-1] if x else 0, c["bounds"][bound], f"{c['id']} {bound}", fontsize=7, ha="right", color="gray")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("fraction")
    ax.set_title("DPPO masked fraction and counterfactual PPO clip fraction per update")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_sentinels(points: list[dict[str, Any]]) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [p["after_update"] for p in points]
    s = [p["summary"] for p in points]
    ax.plot(x, [v["p_minus_q"]["abs_p90"] for v in s], "-o", label="|p - q_sampler| q90")
    ax.plot(x, [v["p_minus_q"]["abs_max"] for v in s], "--o", label="|p - q_sampler| max")
    ax.plot(x, [v["p_minus_p_init"]["abs_p90"] for v in s], "-s", label="|p - p_init| q90 (optimizer drift)")
    ax.plot(x, [v["p_minus_p_init"]["abs_max"] for v in s], "--s", label="|p - p_init| max")
    ax.set_xlabel("after optimizer update")
    ax.set_ylabel("probability difference")
    ax.set_title("Sentinel tokens: initial trainer/sampler mismatch vs optimizer drift")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)


def make_plots(analysis: Mapping[str, Any]) -> dict[str, bytes]:
    rows = analysis.get("per_update") or []
    delta = analysis["config"]["delta"]
    out: dict[str, bytes] = {}
    if rows:
        out["drift_tails"] = plot_drift_tails(rows, delta)
        out["fractions"] = plot_fractions(rows, analysis.get("criteria", []))
    pooled = analysis.get("pooled_second_epoch")
    if pooled:
        out["histograms"] = plot_histograms(pooled["hist"], delta, "pooled over all second-epoch loss calls")
    points = (analysis.get("sentinels") or {}).get("points") or []
    if points:
        out["sentinels"] = plot_sentinels(points)
    return out


def _v(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def yield_text(y: Mapping[str, Any]) -> str:
    """'12 of 256 responses (4.7%) truncated at max_tokens 512, 30 (11.7%) without a parseable answer, mean 210 tokens'."""
    limit = f" at max_tokens {y['max_tokens']}" if y.get("max_tokens") else ""
    return (f"{y['truncated']} of {y['n']} responses ({_pct(y['truncated_frac'])}) truncated{limit}, "
            f"{y['no_answer']} ({_pct(y['no_answer_frac'])}) without a parseable answer, mean "
            f"{y['mean_response_tokens']:.0f} tokens")


def declared_lines(declared: Mapping[str, Any], measured: list[tuple[str, Mapping[str, Any] | None]]) -> list[str]:
    """The renderer and its thinking mode with the measured truncation right under it, and the loss
    normalization against the cookbook ppo's sum (both as effective-config.json declares them)."""
    out = []
    r = declared.get("renderer")
    seen = [f"  - {label}: {yield_text(y)}" for label, y in measured if y]
    if r:
        prefill = "every generation prompt ends with `<think>\\n`" if r.get("thinking") == "enabled" else "no think prefill"
        head = f"- renderer `{r['name']}`, thinking {r.get('thinking')} ({prefill}); measured truncation"
    else:
        head = "- renderer: not declared in effective-config.json; measured truncation"
    out.append(head + (":" if seen else ": not measured"))
    out += seen
    n = declared.get("loss_normalization")
    if n:
        out.append(f"- loss normalization `{n['mode']}`: {n['definition']}. The cookbook's `ppo` instead: "
                   f"{n['cookbook_ppo']}.")
    return out


def _cause_status(c: Mapping[str, Any]) -> str:
    """Verified or suspected, said plainly: a stand-in run verifies only that the evidence
    for the planned model is missing; its measured cause is suspected, for the stand-in only."""
    if c.get("stand_in"):
        return (f"Cause for the planned model: **{c['cause']}** (verified: a stand-in served). Measured cause on the "
                f"stand-in: {c.get('measured_cause') or 'none'} (suspected, and about the stand-in only).")
    label = "verified" if c["cause"] in ("code_or_instrumentation_defect", "missing_evidence") else "suspected"
    return f"Cause: **{c['cause'] or 'none (active)'}** ({label if c['cause'] else 'criteria met'})."


def _headline_lines(analysis: Mapping[str, Any], backend: str) -> list[str]:
    """Whether the mask fired, the state and its cause, and where it ran."""
    c = analysis["classification"]
    rows = analysis.get("per_update") or []
    fired = c["mask_fired"] or any((r.get("dppo/removed") or 0) > 0 for r in rows)
    return [
        "# Bounded DPPO activation diagnostic",
        "",
        f"**Did the DPPO mask fire? {'YES' if fired else 'NO'}.** "
        f"{'It removed nonzero-advantage gradients' if fired else 'No nonzero-advantage token was removed'} "
        f"in {'the second epoch' if c['mask_fired'] else 'any recorded loss call' if not fired else 'the first epoch only'}. "
        f"State: **{c['state']}**; cause: **{c['cause'] or 'n/a (criteria met)'}**.",
        "",
        _cause_status(c),
        "",
        c["explanation"],
        "",
        f"Backend: `{backend}`{' (embedded CPU rehearsal server, not Spindle; its model is a stand-in)' if backend == 'local' else ''}. "
        f"Loop: {analysis['loop']}.",
    ]


def _run_lines(analysis: Mapping[str, Any]) -> list[str]:
    """The run's size, time, batch, schedule and loss, as configured and as done."""
    cfg = analysis["config"]
    lines = [
        "",
        "## Run",
        "",
        f"- updates done: {analysis['updates_done']} of {cfg['max_updates']} (stop: {analysis['stop_reason']})",
        f"- wall time: {analysis['wall_seconds']:.1f} s of the {cfg['max_wall_seconds']:.0f} s cap "
        f"(setup incl. restore, sampling and freezing: {analysis['setup_seconds']:.1f} s)",
        f"- batch: {cfg['groups_per_batch']} GSM8K train groups x {cfg['group_size']}, T={cfg['temperature']}, "
        f"max_tokens {cfg['max_tokens']}; frozen batch sha256 `{analysis['frozen_batch_sha256']}`",
        f"- schedule: {cfg['epochs']} epochs x {cfg['minibatches_per_epoch']} minibatches of {cfg['groups_per_minibatch']} "
        "complete groups, no new sampling, no old-logprob refresh",
        f"- loss: DPPO Binary-TV delta {cfg['delta']}, C {cfg['ratio_cap']}, {cfg['normalization']}; counterfactual "
        f"PPO eps {cfg['ppo_eps']}; AdamW {cfg['adam']}",
    ]
    lines += declared_lines(analysis.get("declared") or {},
                            [("frozen batch rollouts", analysis.get("rollout_yield"))])
    if cfg.get("reductions"):
        lines.append(f"- size reductions (test plan): {cfg['reductions']}")
    if analysis.get("errors"):
        lines.append(f"- errors: {analysis['errors']}")
    return lines


def _criteria_lines(analysis: Mapping[str, Any]) -> list[str]:
    """The fixed criteria table and the pooled second epoch they were judged on."""
    pooled = analysis.get("pooled_second_epoch")
    lines = ["", "## Fixed criteria (all second-epoch loss calls, pooled by loss-token counts)", "",
             "| criterion | metric | value | bounds | result |", "|---|---|---|---|---|"]
    for cr in analysis.get("criteria", []):
        res = "n/a (does not apply)" if cr["passed"] is None else ("met" if cr["passed"] else f"NOT met: {cr['reason']}")
        lines.append(f"| {cr['id']} | `{cr['metric']}` | {_v(cr['value'])} | {cr['bounds']} | {res} |")
    if pooled:
        lines += ["", f"Pooled second epoch: {pooled['calls']} calls, {pooled['tokens/loss']} loss tokens "
                  f"({pooled['tokens/nonzero_adv']} with A != 0); exceedances +{pooled['dppo/exceed_pos']} / "
                  f"-{pooled['dppo/exceed_neg']}; ratio-cap hits {pooled['dppo/ratio_cap_hits']}; masked fraction over "
                  f"A != 0 tokens {_v(pooled['dppo/masked_frac_nonzero_adv'])}."]
    return lines


def _per_update_lines(rows: list[Mapping[str, Any]]) -> list[str]:
    """One table row per optimizer update (the loss call before it)."""
    lines = ["", "## Per update (the loss call before each optimizer step)", "",
             "| update | epoch | mb | loss tok | A!=0 tok | removed (+/-) | masked frac | exceed +/- | cap hits | "
             "PPO clipped | abs(p-q) q90 | abs(p-q) p99 | abs(p-q) max | max p-q on A>0 | min p-q on A<0 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['update_index']} | {r.get('epoch')} | {r.get('minibatch')} | {r['tokens/loss']} | {r['tokens/nonzero_adv']} | "
            f"{r['dppo/removed']} ({r['dppo/removed_pos_adv']}/{r['dppo/removed_neg_adv']}) | {_v(r['dppo/masked_frac_loss_tokens'])} | "
            f"{r['dppo/exceed_pos']}/{r['dppo/exceed_neg']} | {r['dppo/ratio_cap_hits']} | {r['ppo/clipped']} | "
            f"{_v(r['drift/abs_p90'])} | {_v(r['drift/abs_p99'])} | {_v(r['drift/abs_max'])} | "
            f"{_v(r['drift/max_on_pos_adv'])} | {_v(r['drift/min_on_neg_adv'])} |")
    return lines


def _sentinel_lines(sent: Mapping[str, Any]) -> list[str]:
    """The sentinel tokens' drift after each update (nothing when none were followed)."""
    if not sent.get("points"):
        return []
    lines = ["", f"## Sentinel tokens ({sent.get('tokens')} tokens of sequences {sent.get('sequence_indices')})", "",
             f"Selection: {sent.get('selection_rule')}.", "",
             "| after update | abs(p-q) q90 | abs(p-q) max | abs(p-p_init) q90 | abs(p-p_init) max | mean p-p_init on A>0 | on A<0 |",
             "|---|---|---|---|---|---|---|"]
    for p in sent["points"]:
        s = p["summary"]
        lines.append(f"| {p['after_update']} | {_v(s['p_minus_q']['abs_p90'])} | {_v(s['p_minus_q']['abs_max'])} | "
                     f"{_v(s['p_minus_p_init']['abs_p90'])} | {_v(s['p_minus_p_init']['abs_max'])} | "
                     f"{_v(s['by_advantage_sign']['pos']['mean_p_minus_p_init'])} | "
                     f"{_v(s['by_advantage_sign']['neg']['mean_p_minus_p_init'])} |")
    return lines


def _plot_lines(plot_files: Mapping[str, str]) -> list[str]:
    lines = ["", "## Plots", ""]
    for key, title in (("drift_tails", "Drift tails per update"), ("histograms", "p - q histograms by advantage sign"),
                       ("fractions", "Masked and clip fraction per update"), ("sentinels", "Sentinel drift")):
        lines.append(f"![{title}]({plot_files[key]})" if key in plot_files else f"- {title}: not available (no data)")
    return lines


def _defect_and_fix_lines(analysis: Mapping[str, Any]) -> list[str]:
    """The evidence against a code defect, and the fixes this loop made."""
    c = analysis["classification"]
    lines = ["", "## Evidence against a code defect", "", f"- {c['evidence_against_code_defect']}",
             "- every loss call recomputed with the independent padded implementation (`python -m dppo_harness.instrument.replay`): "
             + ("no mismatch" if not c["integrity_problems"] else f"{len(c['integrity_problems'])} problem(s)"),
             "- golden parity of both rules against the pinned reference runs in the unit stage (prerequisite of this stage)"]
    if analysis.get("fixes"):
        lines += ["", "## Fixes in this replacement loop (the prior code could not be audited)", ""]
        lines += [f"- {f}" for f in analysis["fixes"]]
    return lines


def _next_action_lines(next_action: Mapping[str, Any] | None) -> list[str]:
    if not next_action:
        return []
    lines = ["", "## Next action (not executed)", ""]
    if next_action.get("kind") == "frozen_revised_comparison_spec":
        lines.append(f"Frozen revised comparison spec, sha256 `{next_action['spec_sha256']}`, requires "
                     f"{next_action['requires_before_execution']}. See `diagnostic-next-action.json`.")
    else:
        lines.append(str(next_action.get("action")))
    return lines


def _limitation_lines(c: Mapping[str, Any], backend: str) -> list[str]:
    lines = ["", "## Limitations", "",
             "- The accuracy hypothesis was not tested: verdict stays inconclusive.",
             "- The earlier run's code, patch, audit script and evidence could not be fetched; this loop is a replacement.",
             ]
    if backend == "local" or c.get("stand_in"):
        lines.append(f"- Stand-in model `{c.get('served_model') or 'embedded server model'}` computed every number here "
                     "(backend `" + backend + "`), so drift magnitudes and the mask's activity say nothing about Qwen3.5-2B.")
    return lines


def render_markdown(analysis: Mapping[str, Any], plot_files: Mapping[str, str], backend: str,
                    next_action: Mapping[str, Any] | None = None) -> str:
    lines = _headline_lines(analysis, backend)
    lines += _run_lines(analysis)
    lines += _criteria_lines(analysis)
    lines += _per_update_lines(analysis.get("per_update") or [])
    lines += _sentinel_lines(analysis.get("sentinels") or {})
    lines += _plot_lines(plot_files)
    lines += _defect_and_fix_lines(analysis)
    lines += _next_action_lines(next_action)
    lines += _limitation_lines(analysis["classification"], backend)
    return "\n".join(lines) + "\n"


def write_report(bundle: Any, analysis: Mapping[str, Any], backend: str,
                 next_action: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Render plots and report.md, register them in the bundle; returns {key: file name}."""
    plots = make_plots(analysis)
    names = {}
    for key, data in plots.items():
        bundle.register_bytes(PLOTS[key], "plot", data)
        names[key] = PLOTS[key]
    text = render_markdown(analysis, names, backend, next_action)
    # On the embedded server, name the stand-in that computed.

    text += "".join(line + "\n" for line in report_lines(backend_of(getattr(bundle, "result", {}))))
    bundle.register_bytes(REPORT_FILE, "report", text.encode())
    return {**names, "report": REPORT_FILE}


# ---- comparison section ------------------------------------------------------------------------

COMPARISON_PLOTS = {
    "reward": "comparison-reward-per-step.png",
    "fractions": "comparison-masked-and-clip-fraction.png",
    "truncation": "comparison-truncation-and-answer-yield.png",
    "difference": "comparison-accuracy-difference-ci.png",
}
CF_NOTE = ("cf = counterfactual: the rule the arm does not train with, counted on the arm's own tensors "
           "(the GRPO arm's DPPO mask, the DPPO arm's PPO clip); it removed nothing from that arm's gradient")


def _by_arm(rows: list[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["arm"], []).append(r)
    return {a: sorted(rs, key=lambda r: r["step"]) for a, rs in out.items()}


def _fraction(row: Mapping[str, Any], base: str) -> tuple[bool, float]:
    """(counterfactual?, value) of a loss-rule fraction in a step row, whichever label it carries."""
    if base in row:
        return False, float(row[base])
    return True, float(row[f"counterfactual_{base}"])


def plot_comparison_reward(rows: list[Mapping[str, Any]]) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm, rs in _by_arm(rows).items():
        ax.plot([r["step"] + 1 for r in rs], [r["reward_mean"] for r in rs], marker="o", label=arm)
    ax.set_xlabel("rollout step"), ax.set_ylabel("mean reward of the step's batch"), ax.legend()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("per-step reward, both arms")
    return _png(fig)


def plot_comparison_fractions(rows: list[Mapping[str, Any]]) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm, rs in _by_arm(rows).items():
        xs = [r["step"] + 1 for r in rs]
        for base, title, marker, ls in (("dppo_masked_frac", "DPPO masked fraction", "o", "-"),
                                        ("ppo_clip_frac", "PPO clip fraction", "x", "--")):
            cf = _fraction(rs[0], base)[0]
            ax.plot(xs, [_fraction(r, base)[1] for r in rs], marker=marker, linestyle=":" if cf else ls,
                    label=f"{arm}: {title}{' (counterfactual)' if cf else ''}")
    ax.set_xlabel("rollout step"), ax.set_ylabel("fraction of loss tokens"), ax.legend(fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("masked / clipped fraction per step (token-pooled over the step's updates)")
    return _png(fig)


def plot_truncation(rows: list[Mapping[str, Any]], eval_metrics: Mapping[str, Mapping[str, Any]],
                    max_tokens: int | None) -> bytes:
    """Per step and arm: truncated at max_tokens and no parseable answer; right: each scored model."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    for arm, rs in _by_arm(rows).items():
        xs = [r["step"] + 1 for r in rs]
        ax1.plot(xs, [r.get("truncated_frac", float("nan")) for r in rs], marker="o", label=f"{arm}: truncated")
        ax1.plot(xs, [r.get("no_answer_frac", float("nan")) for r in rs], marker="x", linestyle="--",
                 label=f"{arm}: no parseable answer")
    ax1.set_ylim(-0.02, 1.02), ax1.set_xlabel("rollout step"), ax1.set_ylabel("fraction of the step's responses")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_title(f"rollouts (T=1): stopped at max_tokens {max_tokens or ''} / no \\boxed{{}} answer", fontsize=9)
    ax1.legend(fontsize=7)
    models = [m for m in eval_metrics if "eval_truncated_frac" in eval_metrics[m]]
    xs = range(len(models))
    ax2.bar([x - 0.2 for x in xs], [eval_metrics[m]["eval_truncated_frac"] for m in models], width=0.4, label="truncated")
    ax2.bar([x + 0.2 for x in xs], [eval_metrics[m]["eval_no_answer_frac"] for m in models], width=0.4,
            label="no parseable answer")
    ax2.set_xticks(list(xs), models, fontsize=7), ax2.set_ylim(0, 1.3)
    ax2.legend(fontsize=7, loc="upper center", ncol=2)
    ax2.set_title("greedy evaluation, per scored model", fontsize=9)
    fig.tight_layout()
    return _png(fig)


def plot_accuracy_difference(scores: list[Mapping[str, Any]], decision: Mapping[str, Any]) -> bytes:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar([s["arm"] for s in scores], [s["value"] for s in scores])
    ax1.set_ylim(0, 1), ax1.set_ylabel("greedy accuracy"), ax1.set_title("accuracy per scored model")
    labels = []
    for i, c in enumerate(decision.get("criteria", [])):
        d = c["mean_difference"]
        ax2.errorbar([i], [d], yerr=[[d - c["lower"]], [c["upper"] - d]], fmt="o", capsize=6, label="Hoeffding (rule)")
        ax2.axhline(c["margin"], color="grey", linestyle=":")
        labels.append(c["id"])
    info = decision.get("informational")
    if info:
        d = info["mean_difference"]
        x = len(labels)
        ax2.errorbar([x], [d], yerr=[[d - info["lower"]], [info["upper"] - d]], fmt="s", capsize=6, color="tab:gray",
                     label="Newcombe (informational)")
        labels.append("informational")
    ax2.set_xticks(range(len(labels)), labels)
    ax2.set_ylabel("treatment - baseline"), ax2.set_title("paired difference: rule CI and informational CI")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def resume_lines(resume: Mapping[str, Any] | None) -> list[str]:
    """The report's account of a resumed run: which run and session it continues, from which
    step, how many times it was resumed (the provenance block's `resume`)."""
    if not resume:
        return []
    cont = resume["continues_session"]
    snap = cont.get("last_snapshot") or {}
    return [f"**Resumed** ({resume['resumed_times']} time(s) in all): this session continued comparison run "
            f"`{resume['comparison_run']}` from step {resume['from_step']} (the last step every arm had saved), after "
            f"session `{cont['run_id']}` stopped with status `{cont['status']}`; its last snapshot "
            f"`{snap.get('name')}` sha256 `{snap.get('sha256')}`. The preflight and the gate were not rerun: their "
            f"evidence was reused after it verified by sha256 (`{resume['evidence_ref']}`).", ""]


def _pooled_rollout_yield(rs: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """An arm's rollouts over all its steps (every step samples the same number of responses)."""
    if not rs or not all("truncated_frac" in r and "responses" in r for r in rs):
        return None
    n = sum(int(r["responses"]) for r in rs)
    trunc = sum(round(r["truncated_frac"] * r["responses"]) for r in rs)
    none = sum(round(r["no_answer_frac"] * r["responses"]) for r in rs)
    return {"n": n, "truncated": trunc, "truncated_frac": trunc / n, "no_answer": none, "no_answer_frac": none / n,
            "mean_response_tokens": sum(r["mean_response_tokens"] * r["responses"] for r in rs) / n,
            "max_tokens": rs[0].get("max_tokens")}


TRUNCATION_WARN_FRAC = 0.5  # from here on, a scored model's accuracy mostly measures truncation


def truncation_warnings(scores: list[Mapping[str, Any]], eval_metrics: Mapping[str, Mapping[str, Any]],
                        max_tokens: int | None) -> list[str]:
    """A plain warning for each scored model whose greedy outputs were mostly cut off at max_tokens."""
    out = []
    for s in scores:
        m = eval_metrics.get(s["arm"]) or {}
        frac = m.get("eval_truncated_frac")
        if isinstance(frac, (int, float)) and frac >= TRUNCATION_WARN_FRAC:
            out.append(f"\n**{s['arm']}: {_pct(frac)} of its greedy outputs stopped at max_tokens {max_tokens or ''}** "
                       f"({_pct(m.get('eval_no_answer_frac', 0.0))} without a parseable answer): its accuracy measures "
                       "truncation more than answers.")
    return out


def render_comparison_markdown(rows: list[Mapping[str, Any]], scores: list[Mapping[str, Any]],
                               decision: Mapping[str, Any], plot_files: Mapping[str, str], backend: str,
                               eval_metrics: Mapping[str, Mapping[str, Any]] | None = None,
                               declared: Mapping[str, Any] | None = None, max_tokens: int | None = None,
                               resume: Mapping[str, Any] | None = None) -> str:
    eval_metrics = eval_metrics or {}
    pairs = "; ".join(dict.fromkeys(f"{c['treatment']} vs {c['baseline']}" for c in decision.get("criteria", [])))
    lines = [f"# Paired comparison: {pairs or 'no criterion decided'}", ""]
    if backend == "local" or decision.get("rehearsal"):
        lines += ["**REHEARSAL** on the embedded CPU server's stand-in model under the declared rehearsal plan; "
                  "not a result about Qwen3.5-2B. Verdict always inconclusive.", ""]
    lines += resume_lines(resume)
    by_arm = _by_arm(rows)
    measured = [(f"{arm} rollouts, all steps", _pooled_rollout_yield(rs)) for arm, rs in by_arm.items()]
    for s in scores:
        m = eval_metrics.get(s["arm"]) or {}
        if "eval_truncated_frac" in m:
            n = int(m["eval_n"])
            measured.append((f"{s['arm']} greedy evaluation", {
                "n": n, "truncated": round(m["eval_truncated_frac"] * n), "truncated_frac": m["eval_truncated_frac"],
                "no_answer": round(m["eval_no_answer_frac"] * n), "no_answer_frac": m["eval_no_answer_frac"],
                "mean_response_tokens": m["eval_mean_response_tokens"], "max_tokens": max_tokens}))
    lines += ["## Setup", ""] + declared_lines(declared or {}, measured) + [""]
    lines += ["## Per step and arm", "",
              "| arm | step | reward | format | DPPO masked frac | PPO clip frac | abs(p-q) q90 | KL(s\\|t) v1 | entropy | "
              "truncated | no answer | mean len | loss tokens | s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for base in ("dppo_masked_frac", "ppo_clip_frac"):
            cf, v = _fraction(r, base)
            cells.append(f"{'cf ' if cf else ''}{_v(v)}")
        lines.append(f"| {r['arm']} | {r['step'] + 1} | {_v(r['reward_mean'])} | {_v(r['format_rate'])} | "
                     f"{cells[0]} | {cells[1]} | {_v(r['drift_abs_p90'])} | {_v(r.get('kl_sample_train_v1'))} | "
                     f"{_v(r.get('entropy'))} | {_v(r.get('truncated_frac'), '.3f')} | {_v(r.get('no_answer_frac'), '.3f')} | "
                     f"{_v(r.get('mean_response_tokens'), '.0f')} | {r['loss_tokens']} | {_v(r['seconds'], '.1f')} |")
    lines += ["", CF_NOTE + ". KL(s|t) and entropy: tinker-cookbook `compute_kl_sample_train` (sampler vs trainer "
              "logprobs over the step's loss tokens); each arm's cookbook-named metrics are in `metrics-<arm>.jsonl`.",
              "", f"![reward]({plot_files['reward']})", "", f"![fractions]({plot_files['fractions']})", "",
              f"![truncation and answer yield]({plot_files['truncation']})", "",
              "## Evaluation (one frozen evaluator, greedy)", "",
              "| model | accuracy | n | invalid outputs | truncated | mean len | predictions |", "|---|---|---|---|---|---|---|"]
    for s in scores:
        m = eval_metrics.get(s["arm"]) or {}
        lines.append(f"| {s['arm']} | {_v(s['value'])} | {_v(m.get('eval_n'), '.0f')} | "
                     f"{_v(m.get('eval_invalid_outputs'), '.0f')} | {_v(m.get('eval_truncated_frac'), '.3f')} | "
                     f"{_v(m.get('eval_mean_response_tokens'), '.0f')} | `{s['predictions_ref']}` |")
    lines += truncation_warnings(scores, eval_metrics, max_tokens)
    lines += ["", "## Decision (paired Hoeffding)", ""]
    for c in decision.get("criteria", []):
        lines.append(f"- {c['id']}: {c['treatment']} - {c['baseline']} = {_v(c['mean_difference'])}, "
                     f"{100 * (1 - c['alpha']):g}% CI [{_v(c['lower'])}, {_v(c['upper'])}] (n={c['n']}, margin {c['margin']:g})")
    lines += [f"- verdict **{decision.get('verdict')}** ({decision.get('outcome_reason')}): {decision.get('explanation')}",
              f"- observations: `{decision['observations_file']['name']}` sha256 `{decision['observations_file']['sha256']}`"]
    info = decision.get("informational")
    if info:
        lines += ["", "### Informational paired interval (not the decision rule)", "",
                  f"- {info['label']}.",
                  f"- Newcombe (1998) method 10, {100 * (1 - info['alpha']):g}%: {info['treatment']} - {info['baseline']} = "
                  f"{_v(info['mean_difference'])}, [{_v(info['lower'])}, {_v(info['upper'])}] (n={info['n']})",
                  f"- discordant pairs: {info['treatment_only_correct']} items only {info['treatment']} got right, "
                  f"{info['baseline_only_correct']} only {info['baseline']}; concordant: {info['both_correct']} both, "
                  f"{info['neither_correct']} neither; exact McNemar p = {_v(info['mcnemar_exact_p'])}"]
    lines += ["", f"![difference]({plot_files['difference']})", ""]
    return "\n".join(lines)


def write_comparison_report(bundle: Any, rows: list[Mapping[str, Any]], scores: list[Mapping[str, Any]],
                            decision: Mapping[str, Any], backend: str, *, max_tokens: int | None = None,
                            resume: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The comparison section of report.md with its plots, registered in the bundle. Per-model
    evaluation metrics come from the result's `metrics.arms`, the renderer and normalization from
    effective-config.json: what the evidence already says."""
    import json

    result = getattr(bundle, "result", {}) or {}
    eval_metrics = {s["arm"]: (result.get("metrics", {}).get("arms", {}).get(s["arm"]) or {}) for s in scores}
    declared: dict[str, Any] = {}
    if bundle.entry("effective-config.json") is not None:
        eff = json.loads(bundle.file_path("effective-config.json").read_text())
        declared = {k: eff[k] for k in ("renderer", "loss_normalization") if k in eff}
    plots = {"reward": plot_comparison_reward(rows), "fractions": plot_comparison_fractions(rows),
             "truncation": plot_truncation(rows, eval_metrics, max_tokens),
             "difference": plot_accuracy_difference(scores, decision)}
    for key, data in plots.items():
        bundle.register_bytes(COMPARISON_PLOTS[key], "plot", data)
    text = render_comparison_markdown(rows, scores, decision, COMPARISON_PLOTS, backend, eval_metrics, declared,
                                      max_tokens, resume)
    bundle.register_bytes(REPORT_FILE, "report", text.encode())
    return {**COMPARISON_PLOTS, "report": REPORT_FILE}

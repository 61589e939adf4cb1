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

from dppo_harness import instrumentation as ins

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


def _cause_status(c: Mapping[str, Any]) -> str:
    """Verified or suspected, said plainly (issue 11): a stand-in run verifies only that the evidence
    for the planned model is missing; its measured cause is suspected, for the stand-in only."""
    if c.get("stand_in"):
        return (f"Cause for the planned model: **{c['cause']}** (verified: a stand-in served). Measured cause on the "
                f"stand-in: {c.get('measured_cause') or 'none'} (suspected, and about the stand-in only).")
    label = "verified" if c["cause"] in ("code_or_instrumentation_defect", "missing_evidence") else "suspected"
    return f"Cause: **{c['cause'] or 'none (active)'}** ({label if c['cause'] else 'criteria met'})."


def render_markdown(analysis: Mapping[str, Any], plot_files: Mapping[str, str], backend: str,
                    next_action: Mapping[str, Any] | None = None) -> str:
    c = analysis["classification"]
    cfg = analysis["config"]
    pooled = analysis.get("pooled_second_epoch")
    rows = analysis.get("per_update") or []
    fired = c["mask_fired"] or any((r.get("dppo/removed") or 0) > 0 for r in rows)
    lines = [
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
    if cfg.get("reductions"):
        lines.append(f"- size reductions (test plan): {cfg['reductions']}")
    if analysis.get("errors"):
        lines.append(f"- errors: {analysis['errors']}")
    lines += ["", "## Fixed criteria (all second-epoch loss calls, pooled by loss-token counts)", "",
              "| criterion | metric | value | bounds | result |", "|---|---|---|---|---|"]
    for cr in analysis.get("criteria", []):
        res = "n/a (does not apply)" if cr["passed"] is None else ("met" if cr["passed"] else f"NOT met: {cr['reason']}")
        lines.append(f"| {cr['id']} | `{cr['metric']}` | {_v(cr['value'])} | {cr['bounds']} | {res} |")
    if pooled:
        lines += ["", f"Pooled second epoch: {pooled['calls']} calls, {pooled['tokens/loss']} loss tokens "
                  f"({pooled['tokens/nonzero_adv']} with A != 0); exceedances +{pooled['dppo/exceed_pos']} / "
                  f"-{pooled['dppo/exceed_neg']}; ratio-cap hits {pooled['dppo/ratio_cap_hits']}; masked fraction over "
                  f"A != 0 tokens {_v(pooled['dppo/masked_frac_nonzero_adv'])}."]
    lines += ["", "## Per update (the loss call before each optimizer step)", "",
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
    sent = analysis.get("sentinels") or {}
    if sent.get("points"):
        lines += ["", f"## Sentinel tokens ({sent.get('tokens')} tokens of sequences {sent.get('sequence_indices')})", "",
                  f"Selection: {sent.get('selection_rule')}.", "",
                  "| after update | abs(p-q) q90 | abs(p-q) max | abs(p-p_init) q90 | abs(p-p_init) max | mean p-p_init on A>0 | on A<0 |",
                  "|---|---|---|---|---|---|---|"]
        for p in sent["points"]:
            s = p["summary"]
            lines.append(f"| {p['after_update']} | {_v(s['p_minus_q']['abs_p90'])} | {_v(s['p_minus_q']['abs_max'])} | "
                         f"{_v(s['p_minus_p_init']['abs_p90'])} | {_v(s['p_minus_p_init']['abs_max'])} | "
                         f"{_v(s['by_advantage_sign']['pos']['mean_p_minus_p_init'])} | "
                         f"{_v(s['by_advantage_sign']['neg']['mean_p_minus_p_init'])} |")
    lines += ["", "## Plots", ""]
    for key, title in (("drift_tails", "Drift tails per update"), ("histograms", "p - q histograms by advantage sign"),
                       ("fractions", "Masked and clip fraction per update"), ("sentinels", "Sentinel drift")):
        lines.append(f"![{title}]({plot_files[key]})" if key in plot_files else f"- {title}: not available (no data)")
    lines += ["", "## Evidence against a code defect", "", f"- {c['evidence_against_code_defect']}",
              "- every loss call recomputed with the independent padded implementation (`python -m dppo_harness.replay`): "
              + ("no mismatch" if not c["integrity_problems"] else f"{len(c['integrity_problems'])} problem(s)"),
              "- golden parity of both rules against the pinned reference runs in the unit stage (prerequisite of this stage)"]
    if analysis.get("fixes"):
        lines += ["", "## Fixes in this replacement loop (the prior code could not be audited)", ""]
        lines += [f"- {f}" for f in analysis["fixes"]]
    if next_action:
        lines += ["", "## Next action (not executed)", ""]
        if next_action.get("kind") == "frozen_revised_comparison_spec":
            lines.append(f"Frozen revised comparison spec, sha256 `{next_action['spec_sha256']}`, requires "
                         f"{next_action['requires_before_execution']}. See `diagnostic-next-action.json`.")
        else:
            lines.append(str(next_action.get("action")))
    lines += ["", "## Limitations", "",
              "- The accuracy hypothesis was not tested: verdict stays inconclusive.",
              "- The earlier run's code, patch, audit script and evidence could not be fetched; this loop is a replacement.",
              ]
    if backend == "local" or c.get("stand_in"):
        lines.append(f"- Stand-in model `{c.get('served_model') or 'embedded server model'}` computed every number here "
                     "(backend `" + backend + "`), so drift magnitudes and the mask's activity say nothing about Qwen3.5-2B.")
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
    # identity.report_lines: on the embedded server, name the stand-in that computed.
    from dppo_harness.identity import report_lines

    text += "".join(line + "\n" for line in report_lines(getattr(bundle, "result", {}).get("backend")))
    bundle.register_bytes(REPORT_FILE, "report", text.encode())
    return {**names, "report": REPORT_FILE}


# ---- comparison section ------------------------------------------------------------------------

COMPARISON_PLOTS = {
    "reward": "comparison-reward-per-step.png",
    "fractions": "comparison-masked-and-clip-fraction.png",
    "difference": "comparison-accuracy-difference-ci.png",
}


def _by_arm(rows: list[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["arm"], []).append(r)
    return {a: sorted(rs, key=lambda r: r["step"]) for a, rs in out.items()}


def plot_comparison_reward(rows: list[Mapping[str, Any]]) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm, rs in _by_arm(rows).items():
        ax.plot([r["step"] + 1 for r in rs], [r["reward_mean"] for r in rs], marker="o", label=arm)
    ax.set_xlabel("rollout step"), ax.set_ylabel("mean reward of the step's batch"), ax.legend()
    ax.set_title("per-step reward, both arms")
    return _png(fig)


def plot_comparison_fractions(rows: list[Mapping[str, Any]]) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm, rs in _by_arm(rows).items():
        xs = [r["step"] + 1 for r in rs]
        ax.plot(xs, [r["dppo_masked_frac"] for r in rs], marker="o", label=f"{arm}: DPPO masked fraction")
        ax.plot(xs, [r["ppo_clip_frac"] for r in rs], marker="x", linestyle="--", label=f"{arm}: PPO clip fraction")
    ax.set_xlabel("rollout step"), ax.set_ylabel("fraction of loss tokens"), ax.legend(fontsize=7)
    ax.set_title("masked / clipped fraction per step (token-pooled over the step's updates)")
    return _png(fig)


def plot_accuracy_difference(scores: list[Mapping[str, Any]], decision: Mapping[str, Any]) -> bytes:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar([s["arm"] for s in scores], [s["value"] for s in scores])
    ax1.set_ylabel("greedy accuracy"), ax1.set_title("accuracy per scored model")
    for i, c in enumerate(decision.get("criteria", [])):
        d = c["mean_difference"]
        ax2.errorbar([i], [d], yerr=[[d - c["lower"]], [c["upper"] - d]], fmt="o", capsize=6)
        ax2.axhline(c["margin"], color="grey", linestyle=":")
    ax2.set_xticks(range(len(decision.get("criteria", []))), [c["id"] for c in decision.get("criteria", [])])
    ax2.set_ylabel("treatment - baseline"), ax2.set_title("paired difference, Hoeffding CI")
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


def render_comparison_markdown(rows: list[Mapping[str, Any]], scores: list[Mapping[str, Any]],
                               decision: Mapping[str, Any], plot_files: Mapping[str, str], backend: str,
                               resume: Mapping[str, Any] | None = None) -> str:
    lines = ["# Paired comparison: DPPO Binary-TV vs GRPO clipped-ratio", ""]
    if backend == "local" or decision.get("rehearsal"):
        lines += ["**REHEARSAL** on the embedded CPU server's stand-in model under the declared rehearsal plan; "
                  "not a result about Qwen3.5-2B. Verdict always inconclusive.", ""]
    lines += resume_lines(resume)
    lines += ["## Per step and arm", "", "| arm | step | reward | format | masked frac | clip frac | |p-q| q90 | loss tokens | s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['step'] + 1} | {_v(r['reward_mean'])} | {_v(r['format_rate'])} | "
                     f"{_v(r['dppo_masked_frac'])} | {_v(r['ppo_clip_frac'])} | {_v(r['drift_abs_p90'])} | "
                     f"{r['loss_tokens']} | {_v(r['seconds'], '.1f')} |")
    lines += ["", f"![reward]({plot_files['reward']})", "", f"![fractions]({plot_files['fractions']})", "",
              "## Evaluation (one frozen evaluator, greedy)", "", "| model | accuracy | predictions |", "|---|---|---|"]
    for s in scores:
        lines.append(f"| {s['arm']} | {_v(s['value'])} | `{s['predictions_ref']}` |")
    lines += ["", "## Decision (paired Hoeffding)", ""]
    for c in decision.get("criteria", []):
        lines.append(f"- {c['id']}: {c['treatment']} - {c['baseline']} = {_v(c['mean_difference'])}, "
                     f"{100 * (1 - c['alpha']):g}% CI [{_v(c['lower'])}, {_v(c['upper'])}] (n={c['n']}, margin {c['margin']:g})")
    lines += [f"- verdict **{decision.get('verdict')}** ({decision.get('outcome_reason')}): {decision.get('explanation')}",
              f"- observations: `{decision['observations_file']['name']}` sha256 `{decision['observations_file']['sha256']}`",
              "", f"![difference]({plot_files['difference']})", ""]
    return "\n".join(lines)


def write_comparison_report(bundle: Any, rows: list[Mapping[str, Any]], scores: list[Mapping[str, Any]],
                            decision: Mapping[str, Any], backend: str,
                            resume: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The comparison section of report.md with its plots, registered in the bundle."""
    plots = {"reward": plot_comparison_reward(rows), "fractions": plot_comparison_fractions(rows),
             "difference": plot_accuracy_difference(scores, decision)}
    for key, data in plots.items():
        bundle.register_bytes(COMPARISON_PLOTS[key], "plot", data)
    text = render_comparison_markdown(rows, scores, decision, COMPARISON_PLOTS, backend, resume)
    bundle.register_bytes(REPORT_FILE, "report", text.encode())
    return {**COMPARISON_PLOTS, "report": REPORT_FILE}

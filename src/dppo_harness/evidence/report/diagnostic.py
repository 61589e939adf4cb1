"""`report.md` for the bounded diagnostic, with its plots, rendered from the analysis JSON the diagnostic
registered (`diagnostic-analysis.json`) so it says exactly what the evidence says: nothing is re-measured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dppo_harness.evidence.report.plots import PLOTS, make_plots
from dppo_harness.evidence.report.text import REPORT_FILE, declared_lines, fmt
from dppo_harness.json_types import JsonMap, items, obj, objs
from dppo_harness.loss.terms import LossStats

if TYPE_CHECKING:
    from dppo_harness.evidence.bundle import EvidenceBundle


def _cause_status(c: JsonMap) -> str:
    """Verified or suspected, said plainly: a stand-in run verifies only that the evidence
    for the planned model is missing; its measured cause is suspected, for the stand-in only."""
    if c.get("stand_in"):
        return (
            f"Cause for the planned model: **{c['cause']}** (verified: a stand-in served). Measured cause on the "
            f"stand-in: {c.get('measured_cause') or 'none'} (suspected, and about the stand-in only)."
        )
    label = "verified" if c["cause"] in ("code_or_instrumentation_defect", "missing_evidence") else "suspected"
    return f"Cause: **{c['cause'] or 'none (active)'}** ({label if c['cause'] else 'criteria met'})."


def _headline_lines(analysis: JsonMap, backend: str) -> list[str]:
    c = obj(analysis["classification"])
    rows = objs(analysis.get("per_update") or [])
    fired = c["mask_fired"] or any(LossStats.from_row(r).dppo_removed > 0 for r in rows)
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
        str(c["explanation"]),
        "",
        f"Backend: `{backend}`{' (embedded CPU rehearsal server, not Spindle; its model is a stand-in)' if backend == 'local' else ''}. "
        f"Loop: {analysis['loop']}.",
    ]


def _run_lines(analysis: JsonMap) -> list[str]:
    cfg = obj(analysis["config"])
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
    declared = obj(analysis["declared"]) if analysis.get("declared") else {}
    rollout_yield = obj(analysis["rollout_yield"]) if analysis.get("rollout_yield") else None
    lines += declared_lines(declared, [("frozen batch rollouts", rollout_yield)])
    if analysis.get("errors"):
        lines.append(f"- errors: {analysis['errors']}")
    return lines


def _criteria_lines(analysis: JsonMap) -> list[str]:
    """The fixed criteria table and the pooled second epoch they were judged on."""
    block = obj(analysis["pooled_second_epoch"]) if analysis.get("pooled_second_epoch") else None
    lines = [
        "",
        "## Fixed criteria (all second-epoch loss calls, pooled by loss-token counts)",
        "",
        "| criterion | metric | value | bounds | result |",
        "|---|---|---|---|---|",
    ]
    for cr in objs(analysis.get("criteria", [])):
        res = (
            "n/a (does not apply)" if cr["passed"] is None else ("met" if cr["passed"] else f"NOT met: {cr['reason']}")
        )
        lines.append(f"| {cr['id']} | `{cr['metric']}` | {fmt(cr['value'])} | {cr['bounds']} | {res} |")
    if block:
        p = LossStats.from_row(block)
        lines += [
            "",
            f"Pooled second epoch: {block['calls']} calls, {p.tokens_loss} loss tokens ({p.tokens_nonzero_adv} "
            f"with A != 0); exceedances +{p.dppo_exceed_pos} / -{p.dppo_exceed_neg}; ratio-cap hits "
            f"{p.dppo_ratio_cap_hits}; masked fraction over A != 0 tokens {fmt(p.dppo_masked_frac_nonzero_adv)}.",
        ]
    return lines


def _per_update_lines(rows: Sequence[JsonMap]) -> list[str]:
    lines = [
        "",
        "## Per update (the loss call before each optimizer step)",
        "",
        "| update | epoch | mb | loss tok | A!=0 tok | removed (+/-) | masked frac | exceed +/- | cap hits | "
        "PPO clipped | abs(p-q) q90 | abs(p-q) p99 | abs(p-q) max | max p-q on A>0 | min p-q on A<0 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, s in ((r, LossStats.from_row(r)) for r in rows):
        lines.append(
            f"| {r['update_index']} | {r.get('epoch')} | {r.get('minibatch')} | {s.tokens_loss} | {s.tokens_nonzero_adv} | "
            f"{s.dppo_removed} ({s.dppo_removed_pos_adv}/{s.dppo_removed_neg_adv}) | {fmt(s.dppo_masked_frac_loss_tokens)} | "
            f"{s.dppo_exceed_pos}/{s.dppo_exceed_neg} | {s.dppo_ratio_cap_hits} | {s.ppo_clipped} | "
            f"{fmt(s.drift_abs_p90)} | {fmt(s.drift_abs_p99)} | {fmt(s.drift_abs_max)} | "
            f"{fmt(s.drift_max_on_pos_adv)} | {fmt(s.drift_min_on_neg_adv)} |"
        )
    return lines


def _sentinel_lines(sent: JsonMap) -> list[str]:
    """The sentinel tokens' drift after each update (nothing when none were followed)."""
    if not sent.get("points"):
        return []
    lines = [
        "",
        f"## Sentinel tokens ({sent.get('tokens')} tokens of sequences {sent.get('sequence_indices')})",
        "",
        f"Selection: {sent.get('selection_rule')}.",
        "",
        "| after update | abs(p-q) q90 | abs(p-q) max | abs(p-p_init) q90 | abs(p-p_init) max | mean p-p_init on A>0 | on A<0 |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in objs(sent["points"]):
        s = obj(p["summary"])
        p_q, p_init, by_sign = obj(s["p_minus_q"]), obj(s["p_minus_p_init"]), obj(s["by_advantage_sign"])
        lines.append(
            f"| {p['after_update']} | {fmt(p_q['abs_p90'])} | {fmt(p_q['abs_max'])} | "
            f"{fmt(p_init['abs_p90'])} | {fmt(p_init['abs_max'])} | "
            f"{fmt(obj(by_sign['pos'])['mean_p_minus_p_init'])} | "
            f"{fmt(obj(by_sign['neg'])['mean_p_minus_p_init'])} |"
        )
    return lines


def _plot_lines(plot_files: Mapping[str, str]) -> list[str]:
    lines = ["", "## Plots", ""]
    for key, (_, title) in PLOTS.items():
        lines.append(f"![{title}]({plot_files[key]})" if key in plot_files else f"- {title}: not available (no data)")
    return lines


def _defect_and_fix_lines(analysis: JsonMap) -> list[str]:
    c = obj(analysis["classification"])
    lines = [
        "",
        "## Evidence against a code defect",
        "",
        f"- {c['evidence_against_code_defect']}",
        "- every loss call recomputed with the independent padded implementation (`python -m dppo_harness.instrument.replay`): "
        + ("no mismatch" if not c["integrity_problems"] else f"{len(items(c['integrity_problems']))} problem(s)"),
        "- golden parity of both rules against the pinned reference runs in the unit stage (prerequisite of this stage)",
    ]
    if analysis.get("fixes"):
        lines += ["", "## Fixes in this replacement loop (the prior code could not be audited)", ""]
        lines += [f"- {f}" for f in items(analysis["fixes"])]
    return lines


def _next_action_lines(next_action: JsonMap) -> list[str]:
    lines = ["", "## Next action (not executed)", ""]
    if next_action.get("kind") == "frozen_revised_comparison_spec":
        lines.append(
            f"Frozen revised comparison spec, sha256 `{next_action['spec_sha256']}`, requires "
            f"{next_action['requires_before_execution']}. See `diagnostic-next-action.json`."
        )
    else:
        lines.append(str(next_action.get("action")))
    return lines


def _limitation_lines(c: JsonMap, backend: str) -> list[str]:
    lines = [
        "",
        "## Limitations",
        "",
        "- The accuracy hypothesis was not tested: verdict stays inconclusive.",
        "- The earlier run's code, patch, audit script and evidence could not be fetched; this loop is a replacement.",
    ]
    if c.get("stand_in"):  # the served model differs from the plan's (evidence.backend.ServedModel)
        lines.append(
            f"- Stand-in model `{c.get('served_model') or 'a model the service did not name'}` computed every number here "
            "(backend `" + backend + "`), so drift magnitudes and the mask's activity say nothing about Qwen3.5-2B."
        )
    return lines


def render_markdown(analysis: JsonMap, plot_files: Mapping[str, str], backend: str, next_action: JsonMap) -> str:
    lines = _headline_lines(analysis, backend)
    lines += _run_lines(analysis)
    lines += _criteria_lines(analysis)
    lines += _per_update_lines(objs(analysis.get("per_update") or []))
    lines += _sentinel_lines(obj(analysis["sentinels"]) if analysis.get("sentinels") else {})
    lines += _plot_lines(plot_files)
    lines += _defect_and_fix_lines(analysis)
    lines += _next_action_lines(next_action)
    lines += _limitation_lines(obj(analysis["classification"]), backend)
    return "\n".join(lines) + "\n"


def write_report(bundle: EvidenceBundle, analysis: JsonMap, backend: str, next_action: JsonMap) -> dict[str, str]:
    """Render plots and report.md, register them in the bundle; returns {key: file name}."""
    names = {k: bundle.register_bytes(PLOTS[k][0], "plot", data)["name"] for k, data in make_plots(analysis).items()}
    text = render_markdown(analysis, names, backend, next_action)
    bundle.register_bytes(REPORT_FILE, "report", text.encode())
    return {**names, "report": REPORT_FILE}

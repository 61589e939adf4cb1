"""The comparison's `report.md`: per step and arm, the evaluation, the decision, with its plots.

Rendered from the step rows, the scores and the decision the comparison registered, with the
per-model evaluation metrics and the declared renderer from the evidence; nothing is re-measured here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dppo_harness.evaluation.answer_yield import ResponseYield, pooled
from dppo_harness.evidence.files import EFFECTIVE_CONFIG_FILE
from dppo_harness.evidence.report.plots import (
    COMPARISON_PLOTS,
    plot_accuracy_difference,
    plot_comparison_fractions,
    plot_comparison_reward,
    plot_truncation,
)
from dppo_harness.evidence.report.text import REPORT_FILE, declared_lines, fmt, pct, rows_by_arm
from dppo_harness.json_types import JsonMap, JsonObject, JsonValue, num, obj, objs
from dppo_harness.loss.terms import DECISIONS, row_fraction

if TYPE_CHECKING:
    from dppo_harness.evidence.bundle import EvidenceBundle

CF_NOTE = (
    "cf = counterfactual: the rule the arm does not train with, counted on the arm's own tensors "
    "(the GRPO arm's DPPO mask, the DPPO arm's PPO clip); it removed nothing from that arm's gradient"
)


def resume_lines(resume: JsonMap | None) -> list[str]:
    """The report's account of a resumed run: which run and session it continues, from which
    step, how many times it was resumed (the provenance block's `resume`)."""
    if not resume:
        return []
    cont = obj(resume["continues_session"])
    snap = obj(cont["last_snapshot"]) if cont.get("last_snapshot") else {}
    return [
        f"**Resumed** ({resume['resumed_times']} time(s) in all): this session continued comparison run "
        f"`{resume['comparison_run']}` from step {resume['from_step']} (the last step every arm had saved), after "
        f"session `{cont['run_id']}` stopped with status `{cont['status']}`; its last snapshot "
        f"`journal.jsonl#{snap.get('seq')}` sha256 `{snap.get('sha256')}`. The preflight and the gate were not rerun: their "
        f"evidence was reused after it verified by sha256 (`{resume['evidence_ref']}`).",
        "",
    ]


def _counted(m: JsonMap, n: JsonValue, prefix: str, max_tokens: JsonValue) -> ResponseYield:
    """The counts behind the recorded fractions and mean length (`<prefix>truncated_frac`, ...) of `n` responses."""
    k = int(num(n))
    t, a, tok = (
        round(num(m[f"{prefix}{f}"]) * k) for f in ("truncated_frac", "no_answer_frac", "mean_response_tokens")
    )
    return ResponseYield(k, t, a, tok, None if max_tokens is None else int(num(max_tokens)))


TRUNCATION_WARN_FRAC = 0.5  # from here on, a scored model's accuracy mostly measures truncation


def truncation_warnings(
    scores: Sequence[JsonMap], eval_metrics: Mapping[str, JsonMap], max_tokens: int | None
) -> list[str]:
    """A plain warning for each scored model whose greedy outputs were mostly cut off at max_tokens."""
    out = []
    for s in scores:
        m = eval_metrics.get(str(s["arm"])) or {}
        frac = m.get("eval_truncated_frac")
        if isinstance(frac, (int, float)) and frac >= TRUNCATION_WARN_FRAC:
            out.append(
                f"\n**{s['arm']}: {pct(frac)} of its greedy outputs stopped at max_tokens {max_tokens or ''}** "
                f"({pct(m.get('eval_no_answer_frac', 0.0))} without a parseable answer): its accuracy measures "
                "truncation more than answers."
            )
    return out


def _title_lines(decision: JsonMap, backend: str, resume: JsonMap | None) -> list[str]:
    pairs = "; ".join(dict.fromkeys(f"{c['treatment']} vs {c['baseline']}" for c in objs(decision.get("criteria", []))))
    lines = [f"# Paired comparison: {pairs or 'no criterion decided'}", ""]
    if backend == "local" or decision.get("rehearsal"):
        lines += [
            "**REHEARSAL** on the embedded CPU server's stand-in model under the declared rehearsal plan; "
            "not a result about Qwen3.5-2B. Verdict always inconclusive.",
            "",
        ]
    return lines + resume_lines(resume)


def _measured_yields(
    rows: Sequence[JsonMap], scores: Sequence[JsonMap], eval_metrics: Mapping[str, JsonMap], max_tokens: int | None
) -> list[tuple[str, JsonMap | None]]:
    """Truncation and answer yield as measured: each arm's rollouts over all its steps, then each
    scored model's greedy evaluation."""
    measured: list[tuple[str, JsonMap | None]] = []
    for arm, rs in rows_by_arm(rows).items():
        ok = rs and all("truncated_frac" in r and "responses" in r for r in rs)
        y = pooled([_counted(r, r["responses"], "", r.get("max_tokens")) for r in rs]).as_dict() if ok else None
        measured.append((f"{arm} rollouts, all steps", y))
    for s in scores:
        m = eval_metrics.get(str(s["arm"])) or {}
        if "eval_truncated_frac" in m:
            measured.append((f"{s['arm']} greedy evaluation", _counted(m, m["eval_n"], "eval_", max_tokens).as_dict()))
    return measured


def _per_step_lines(rows: Sequence[JsonMap]) -> list[str]:
    """One table row per step and arm (counterfactual fractions marked), its note, and the per-step plots."""
    lines = [
        "## Per step and arm",
        "",
        "| arm | step | reward | format | "
        + "".join(f"{d.name.upper()} {d.verb} frac | " for d in DECISIONS)
        + "abs(p-q) q90 | KL(s\\|t) v1 | entropy | truncated | no answer | mean len | loss tokens | s |",
        "|" + "---|" * (12 + len(DECISIONS)),
    ]
    for r in rows:
        cells = ""
        for d in DECISIONS:
            f = row_fraction(r, d.row_keys[0])
            cells += f"{'cf ' if f.counterfactual else ''}{fmt(f.value)} | "
        lines.append(
            f"| {r['arm']} | {num(r['step']) + 1} | {fmt(r['reward_mean'])} | {fmt(r['format_rate'])} | "
            f"{cells}{fmt(r['drift_abs_p90'])} | {fmt(r.get('kl_sample_train_v1'))} | "
            f"{fmt(r.get('entropy'))} | {fmt(r.get('truncated_frac'), '.3f')} | {fmt(r.get('no_answer_frac'), '.3f')} | "
            f"{fmt(r.get('mean_response_tokens'), '.0f')} | {r['loss_tokens']} | {fmt(r['seconds'], '.1f')} |"
        )
    lines += [
        "",
        CF_NOTE + ". KL(s|t) and entropy: tinker-cookbook `compute_kl_sample_train` (sampler vs trainer "
        "logprobs over the step's loss tokens).",
        "",
    ]
    for key, alt in (("reward", "reward"), ("fractions", "fractions"), ("truncation", "truncation and answer yield")):
        lines += [f"![{alt}]({COMPARISON_PLOTS[key]})", ""]
    return lines


def _evaluation_lines(
    scores: Sequence[JsonMap], eval_metrics: Mapping[str, JsonMap], max_tokens: int | None
) -> list[str]:
    lines = [
        "## Evaluation (one frozen evaluator, greedy)",
        "",
        "| model | accuracy | n | invalid outputs | truncated | mean len | predictions |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        m = eval_metrics.get(str(s["arm"])) or {}
        lines.append(
            f"| {s['arm']} | {fmt(s['value'])} | {fmt(m.get('eval_n'), '.0f')} | "
            f"{fmt(m.get('eval_invalid_outputs'), '.0f')} | {fmt(m.get('eval_truncated_frac'), '.3f')} | "
            f"{fmt(m.get('eval_mean_response_tokens'), '.0f')} | `{s['predictions_ref']}` |"
        )
    return lines + truncation_warnings(scores, eval_metrics, max_tokens)


def _decision_lines(decision: JsonMap) -> list[str]:
    """Each criterion's paired Hoeffding interval, the verdict, the observations file, the
    informational interval when there is one, and the difference plot."""
    lines = ["", "## Decision (paired Hoeffding)", ""]
    for c in objs(decision.get("criteria", [])):
        lines.append(
            f"- {c['id']}: {c['treatment']} - {c['baseline']} = {fmt(c['mean_difference'])}, "
            f"{100 * (1 - num(c['alpha'])):g}% CI [{fmt(c['lower'])}, {fmt(c['upper'])}] (n={c['n']}, margin {c['margin']:g})"
        )
    obs = obj(decision["observations_file"])
    lines += [
        f"- verdict **{decision.get('verdict')}** ({decision.get('outcome_reason')}): {decision.get('explanation')}",
        f"- observations: `{obs['name']}` sha256 `{obs['sha256']}`",
    ]
    if decision.get("informational"):
        lines += _informational_lines(obj(decision["informational"]))
    return lines + ["", f"![difference]({COMPARISON_PLOTS['difference']})", ""]


def _informational_lines(info: JsonMap) -> list[str]:
    """The Newcombe paired interval and the discordant pairs: reported beside the decision, not part of its rule."""
    return [
        "",
        "### Informational paired interval (not the decision rule)",
        "",
        f"- {info['label']}.",
        f"- Newcombe (1998) method 10, {100 * (1 - num(info['alpha'])):g}%: {info['treatment']} - {info['baseline']} = "
        f"{fmt(info['mean_difference'])}, [{fmt(info['lower'])}, {fmt(info['upper'])}] (n={info['n']})",
        f"- discordant pairs: {info['treatment_only_correct']} items only {info['treatment']} got right, "
        f"{info['baseline_only_correct']} only {info['baseline']}; concordant: {info['both_correct']} both, "
        f"{info['neither_correct']} neither; exact McNemar p = {fmt(info['mcnemar_exact_p'])}",
    ]


def write_comparison_report(
    bundle: EvidenceBundle,
    rows: Sequence[JsonMap],
    scores: Sequence[JsonMap],
    decision: JsonMap,
    backend: str,
    *,
    max_tokens: int | None = None,
    resume: JsonMap | None = None,
) -> dict[str, str]:
    """The comparison section of report.md with its plots, registered in the bundle. Per-model
    evaluation metrics come from the result's `metrics.arms`, the renderer and normalization from
    effective-config.json: what the evidence already says."""
    arms = bundle.result["metrics"]["arms"]
    eval_metrics = {str(s["arm"]): arms.get(s["arm"]) or {} for s in scores}
    declared: JsonObject = {}
    if bundle.entry(EFFECTIVE_CONFIG_FILE) is not None:
        eff = json.loads(bundle.file_path(EFFECTIVE_CONFIG_FILE).read_text())
        declared = {k: eff[k] for k in ("renderer", "loss_normalization") if k in eff}
    plots = {
        "reward": plot_comparison_reward(rows),
        "fractions": plot_comparison_fractions(rows),
        "truncation": plot_truncation(rows, eval_metrics, max_tokens),
        "difference": plot_accuracy_difference(scores, decision),
    }
    for key, data in plots.items():
        bundle.register_bytes(COMPARISON_PLOTS[key], "plot", data)
    # Section by section: title (rehearsal and resume notes), setup, per step and arm, evaluation, decision.
    lines = _title_lines(decision, backend, resume)
    lines += ["## Setup", ""] + declared_lines(declared, _measured_yields(rows, scores, eval_metrics, max_tokens))
    lines += [""] + _per_step_lines(rows)
    lines += _evaluation_lines(scores, eval_metrics, max_tokens)
    lines += _decision_lines(decision)
    bundle.register_bytes(REPORT_FILE, "report", "\n".join(lines).encode())
    return {**COMPARISON_PLOTS, "report": REPORT_FILE}

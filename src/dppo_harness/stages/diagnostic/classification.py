"""The diagnostic's verdict and the evidence it weighs: the plan's fixed analysis criteria on pooled
second-epoch values (nothing tuned, relaxed or selected; a criterion that cannot be measured fails
as missing), the variant and anchor checks, the deterministic must-fire / must-not-fire self-test
(fixed cases through the real packed loss and the recorder, their counts and gradients checked,
exact +-delta boundaries included), and the classification: active or not, and if not, why (one of
CAUSES), explained from the measured numbers and judged for the planned model (the served model,
`evidence.backend.ServedModel`, is an input), with the next action that follows."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import tinker
import torch
from pydantic import JsonValue

from dppo_harness.evidence.backend import ServedModel
from dppo_harness.evidence.report.text import fmt
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument.instrumentation import POOLED_QUANTILES, RATIO_PARTS
from dppo_harness.json_types import JsonMap, JsonObject, items, num
from dppo_harness.loss import losses
from dppo_harness.loss.loss_registry import DPPO_LOSS, GRPO_LOSS, get_loss
from dppo_harness.loss.terms import LossStats
from dppo_harness.stages.checks import Bounds, BoundsJson, Measured, is_number
from dppo_harness.stages.diagnostic.config import DiagnosticError

if TYPE_CHECKING:
    from dppo_harness.plans import ExperimentSpec
    from dppo_harness.plans.models import AnalysisCriterion, BoundedDiagnostic
    from dppo_harness.rollout.frozen_batch import FrozenBatch
    from dppo_harness.stages.diagnostic.loop import SentinelPoint, SentinelSummary

CAUSES = (
    "code_or_instrumentation_defect",
    "wrong_reference_or_variant",
    "legitimate_inactive_regime",
    "missing_evidence",
)


def pinned_variant_problems(cfg: losses.LossConfig) -> list[str]:
    """The trained rule must be the pinned reference variant: the registered losses' parameters
    (delta and C of the DPPO rule, eps of the GRPO clip it counts)."""
    problems = []
    dppo, grpo = get_loss(DPPO_LOSS).params, get_loss(GRPO_LOSS).params
    for name, got, want in (
        ("delta", cfg.dppo_delta, dppo["dppo_delta"]),
        ("ratio_cap", cfg.ratio_cap, dppo["ratio_cap"]),
        ("ppo_eps", cfg.ppo_eps, grpo["ppo_eps"]),
    ):
        if got != want:
            problems.append(f"{name} {got} differs from the pinned reference value {want}")
    return problems


def anchor_problems(
    records: Sequence[ins.LossCallRecord],
    frozen: FrozenBatch | None,
    moved: bool | None = None,
) -> list[str]:
    """The anchor must be the frozen sampler logprobs of each call's sequences: never refreshed,
    never the current policy. Anchor == current only convicts when the sentinels show the trainer
    actually moved (with a zero learning rate and a bit-identical sampler the two are legitimately equal)."""
    problems = []
    if frozen is not None:  # none: nothing to compare
        for r in records:
            got, indices = r.tensors["sampler_logprobs_N"], items(r.context["sequence_indices"])
            want = np.concatenate([frozen.sequence(int(num(s)))["logprobs"] for s in indices])
            if got.shape != want.shape or not np.array_equal(got.astype(np.float64), want.astype(np.float64)):
                problems.append(
                    f"update {r.context.get('update_index')}: anchor logprobs differ from the frozen batch (refreshed?)"
                )
    later = [r for r in records if r.context.get("update_index", 1) > 1]
    if later and moved:
        same = all(
            np.array_equal(
                r.tensors["logprobs_N"][r.tensors["mask_N"] != 0].astype(np.float64),
                r.tensors["sampler_logprobs_N"][r.tensors["mask_N"] != 0].astype(np.float64),
            )
            for r in later
        )
        if same:
            problems.append(
                "after the first update the anchor equals the current logprobs bitwise: anchored on the current policy"
            )
    return problems


@dataclass(frozen=True)
class Classification:
    """Active or not, and if not, why (one of CAUSES), explained from the measured numbers."""

    state: str  # "active", "partially_active" or "inactive"
    mask_fired: bool
    active: bool
    cause: str | None
    explanation: str
    evidence_against_code_defect: str
    integrity_problems: tuple[str, ...]
    variant_problems: tuple[str, ...]
    # The cause the measurements alone gave, before judging them for the planned model (a
    # stand-in's measured state is a fact about the stand-in only), and who computed.
    measured_cause: str | None
    served_model: str | None
    stand_in: bool


def _pooled_line(calls: int, p: LossStats, delta: float) -> str:
    """The pooled second-epoch counts and drift (`calls` loss calls pooled), in one sentence."""
    return (
        f"Second epoch, {calls} loss calls, {p.tokens_loss} loss tokens "
        f"(A>0 {p.tokens_pos_adv}, A<0 {p.tokens_neg_adv}, A=0 {p.tokens_zero_adv}): "
        f"removed {p.dppo_removed} (A>0 {p.dppo_removed_pos_adv}, A<0 {p.dppo_removed_neg_adv}), "
        f"masked fraction {fmt(p.dppo_masked_frac_loss_tokens)} of loss tokens; "
        f"largest p-q on an A>0 token {fmt(p.drift_max_on_pos_adv)} vs +delta {delta}, "
        f"smallest p-q on an A<0 token {fmt(p.drift_min_on_neg_adv)} vs -delta {-delta}; "
        f"exceedances +{p.dppo_exceed_pos} / -{p.dppo_exceed_neg}; "
        f"pooled |p-q| q90 {fmt(p.drift_abs_p90)}, p99 {fmt(p.drift_abs_p99)}, max {fmt(p.drift_abs_max)}; "
        f"counterfactual PPO clip fraction {fmt(p.ppo_clip_frac_loss_tokens)}."
    )


def _sentinel_line(init: Mapping[str, Any], last: SentinelPoint | None) -> str:
    """Trainer-vs-sampler drift on the sentinels at initialization and after the last measurement."""
    return (
        f"Sentinels ({init['tokens']} tokens): trainer-vs-sampler |p-q| q90 {fmt(init['p_minus_q']['abs_p90'])} "
        f"(max {fmt(init['p_minus_q']['abs_max'])}) at initialization"
        + (
            f"; after update {last['after_update']}: |p-q| q90 {fmt(last['summary']['p_minus_q']['abs_p90'])}, "
            f"optimizer drift |p-p_init| q90 {fmt(last['summary']['p_minus_p_init']['abs_p90'])} "
            f"(max {fmt(last['summary']['p_minus_p_init']['abs_max'])})."
            if last
            else "."
        )
    )


def classify(
    *,
    criteria: Sequence[CriterionResult],
    pooled: Mapping[str, JsonValue] | None,
    selftest: SelftestReport,
    integrity_problems: Sequence[str],
    variant_problems: Sequence[str],
    sentinels: SentinelSummary,
    updates_done: int,
    second_epoch_calls: int,
    stop_reason: str,
    delta: float,
    served: ServedModel,
    updates_planned: int = 0,
    minibatches_per_epoch: int = 0,
    errors: Sequence[str] = (),
) -> Classification:
    """Active or not, and if not, why: one of CAUSES, explained from the measured numbers. A run
    that stopped on an error and is not active lacks evidence (unless a defect was shown). The
    cause is judged for the question asked (does the mask engage on the PLANNED model?): on a
    stand-in nothing measured is evidence about the planned model, so it is missing_evidence
    whatever the stand-in did (`measured_cause` keeps the measured one); a code defect found on the
    stand-in stays a defect (the code is the same)."""
    cases = selftest.get("cases", {})
    evidence_against_defect = (  # the self-test's verdict and case count
        f"deterministic must-fire/must-not-fire self-test {'passed' if selftest.get('passed') else 'FAILED'} "
        f"({sum(c['passed'] for c in cases.values())}/{len(cases)} cases)"
    )
    applicable = [c for c in criteria if c.applies]
    active = bool(applicable) and all(c.passed for c in applicable) and not integrity_problems and not variant_problems
    p = LossStats.from_row(pooled) if pooled else None
    fired = p is not None and p.dppo_removed > 0
    state = "active" if active else ("partially_active" if fired else "inactive")
    # What was measured: pooled values, a short second epoch, and the sentinels.
    lines: list[str] = []
    if p is not None:
        lines.append(_pooled_line(second_epoch_calls, p, delta))
    planned_second = max(0, min(updates_planned, 2 * minibatches_per_epoch) - minibatches_per_epoch)
    if p is not None and planned_second and second_epoch_calls < planned_second:
        lines.append(
            f"Only {second_epoch_calls} of {planned_second} planned second-epoch loss calls ran "
            f"(stopped: {stop_reason}); the pooled values cover those calls only."
        )
    init, last = sentinels.get("at_init"), sentinels.get("last")
    if init:
        lines.append(_sentinel_line(init, last))
    # The cause of a run that is not active: the first that applies.
    cause: str | None = None
    if active:
        lines.append("Every applicable criterion is met: the mask engages in this regime.")
    elif second_epoch_calls == 0:
        lines.insert(
            0,
            f"No second-epoch loss call was recorded ({updates_done} updates done; stopped: {stop_reason}), "
            "so the fixed analysis has nothing to pool.",
        )
        cause = "missing_evidence"
    elif integrity_problems or not selftest.get("passed"):
        lines.append("Integrity problems: " + "; ".join(list(integrity_problems)[:5] or ["self-test failed"]))
        cause = "code_or_instrumentation_defect"
    elif variant_problems:
        lines.append("Variant/anchor problems: " + "; ".join(variant_problems[:5]))
        cause = "wrong_reference_or_variant"
    elif any(c.applies and c.reason.startswith("missing") for c in criteria):
        lines.append(
            "A criterion could not be measured: " + ", ".join(c.id for c in criteria if c.reason.startswith("missing"))
        )
        cause = "missing_evidence"
    else:
        if p is not None and p.tokens_nonzero_adv == 0:
            lines.append(
                "No second-epoch loss token has a nonzero advantage (every group's rewards were constant), "
                "so there is no policy-gradient signal to move the policy and nothing the mask could remove."
            )
        failing = [f"{c.id} ({c.reason})" for c in criteria if c.applies and not c.passed]
        lines.append(
            "The recorded decisions agree with the pinned rule on every token "
            f"({evidence_against_defect}; every recorded decision and returned metric recomputed from the stored "
            "tensors by the independent replay), the anchor is the frozen "
            "sampler logprobs, and the variant is the pinned one; the criteria fail on the measured drift itself: "
            + "; ".join(failing)
            + "."
        )
        cause = "legitimate_inactive_regime"
    explanation = " ".join(lines)
    if errors and not active and cause != "code_or_instrumentation_defect":
        cause = "missing_evidence"
        explanation += f" The run stopped on an error before completing its schedule: {errors[0]}"
    if served.rehearsal:
        explanation += (
            f" These measurements come from the stand-in {served.served}, not {served.planned}: the measured "
            f"state ({state}, measured cause {cause or 'none'}) is a fact about the stand-in only, so for "
            f"{served.planned} the evidence is missing."
        )
    return Classification(
        state=state,
        mask_fired=fired,
        active=active,
        cause="missing_evidence" if served.rehearsal and cause != "code_or_instrumentation_defect" else cause,
        explanation=explanation,
        evidence_against_code_defect=evidence_against_defect,
        integrity_problems=tuple(integrity_problems),
        variant_problems=tuple(variant_problems),
        measured_cause=cause,
        served_model=served.served,
        stand_in=served.rehearsal,
    )


def next_action(
    classification: Classification,
    d: BoundedDiagnostic,
    spec: ExperimentSpec | None,
    served: ServedModel,
    updates_done: int,
) -> JsonObject:
    """Stand-in: the same frozen plan unchanged on the real service. Active: the frozen revised
    comparison spec (not executed). Otherwise: the cheapest next step."""
    c = classification
    if c.stand_in and c.cause != "code_or_instrumentation_defect":
        return {  # the same frozen plan, unchanged, on the real service
            "kind": "cheapest_next_action",
            "executed": False,
            "cause": "missing_evidence",
            "action": f"run this same frozen plan unchanged on the real service (Spindle, {served.planned}): the "
            f"stand-in's result says nothing about {served.planned}; more epochs become a candidate only after a "
            "real-model run shows the regime is inactive there",
            "plan_id": d.plan_id,
            "plan_changes": [],
            "served_model": served.served,
            "measured_on_stand_in": {  # what the run measured
                "state": c.state,
                "measured_cause": c.measured_cause,
                "mask_fired": c.mask_fired,
                "updates_done": updates_done,
            },
            "not_yet_candidates": [
                "more epochs over the frozen batch (only after a real-model run shows an inactive regime)"
            ],
        }
    if classification.active and spec is not None:
        sch = d.schedule
        revised = spec.model_dump(mode="json", exclude_unset=True)
        revised["title"] = spec.title + " (revised schedule r2, proposed)"
        revised["method"] = (
            spec.method
            + f"\n\nRevision r2 (from {d.plan_id}): each rollout batch of {sch.groups_per_batch} groups x {sch.group_size} "
            f"is split into {sch.minibatches_per_epoch} minibatches of {sch.groups_per_minibatch} complete groups and "
            f"trained for {sch.epochs} epochs ({sch.minibatches_per_epoch * sch.epochs} optim_steps per batch), the "
            "schedule under which the bounded diagnostic measured an engaged DPPO mask. Both arms use it."
        )
        for arm in revised.get("arms", []):
            arm["updates_per_batch"] = sch.minibatches_per_epoch * sch.epochs
        for check in revised.get("activation_gate", {}).get("checks", []):
            if check.get("metric") == "executed_updates_per_batch":
                check["min"] = check["max"] = sch.minibatches_per_epoch * sch.epochs
        revised["feasibility"] = None
        blob = json.dumps(revised, sort_keys=True, separators=(",", ":")).encode()
        return {
            "kind": "frozen_revised_comparison_spec",
            "executed": False,
            "spec_sha256": hashlib.sha256(blob).hexdigest(),
            "requires_before_execution": [
                "requester approval",
                "feasibility pilot on the new schedule",
                "restoration preflight",
                "activation gate of the revised spec",
            ],
            "spec": revised,
        }
    cause = classification.cause
    pinned = get_loss(DPPO_LOSS).params
    cheapest = {
        "missing_evidence": "rerun this same bounded diagnostic unchanged on a backend fast enough to reach the second "
        "epoch inside the 12-minute cap (measure feasibility first); no setting changes",
        "code_or_instrumentation_defect": "fix the defect named in the integrity problems, rerun the unit suite's "
        "must-fire/must-not-fire and golden parity, then rerun this diagnostic unchanged",
        "wrong_reference_or_variant": "re-pin the loss to the reference variant (sampler anchor, "
        f"delta {pinned['dppo_delta']:g}, C {pinned['ratio_cap']:g}), "
        "rerun correctness preflight, then rerun this diagnostic unchanged",
        "legitimate_inactive_regime": "propose (not run) a requester-approved revised diagnostic in which the policy "
        "moves further from the sampler before the trust region is judged (e.g. more "
        "epochs over the frozen batch at the same lr), frozen before measurement",
        None: "partially active: report the measured values; a revised plan needs the requester's approval",
    }[cause]
    return {"kind": "cheapest_next_action", "executed": False, "cause": cause, "action": cheapest}


@dataclass(frozen=True)
class CriterionResult:
    id: str
    metric: str
    value: Measured
    applies: bool
    passed: bool | None  # None when the criterion does not apply
    reason: str
    bounds: BoundsJson


def _applies(criterion: AnalysisCriterion, pooled: LossStats) -> bool:
    cond = criterion.applies_when
    if cond is None:
        return True
    for needle, tokens in (("A > 0", pooled.tokens_pos_adv), ("A < 0", pooled.tokens_neg_adv)):
        if needle in cond:
            return tokens > 0
    raise DiagnosticError(f"analysis.criteria[{criterion.id}].applies_when: cannot interpret {cond!r}")


_POOLING_OK = {
    "token_weighted_ratio": set(RATIO_PARTS),
    "pooled_quantile": set(POOLED_QUANTILES),
    "token_count_sum": set(LossStats.names("count")),
}


def evaluate_criteria(criteria: Sequence[AnalysisCriterion], pooled: JsonMap) -> list[CriterionResult]:
    """The plan's fixed criteria on pooled values (the rule shared with the gate's checks,
    `checks.Bounds`); nothing is tuned, relaxed or selected here."""
    out, stats = [], LossStats.from_row(pooled)
    for c in criteria:
        if c.metric not in _POOLING_OK.get(c.pooling, set()):
            raise DiagnosticError(
                f"analysis.criteria[{c.id}]: pooling {c.pooling!r} of {c.metric!r} is not implemented"
            )
        bounds = Bounds.of(c)
        value = stats[c.metric]  # a scalar statistic, or None: not measured
        passed: bool | None
        applies, passed, reason = True, False, "missing: not measured"
        if not _applies(c, stats):
            applies, passed, reason = False, None, f"does not apply: {c.applies_when} is false"
        elif is_number(value):
            problems = bounds.problems(value)
            passed, reason = not problems, "; ".join(problems) or "met"
        out.append(CriterionResult(c.id, c.metric, value, applies, passed, reason, bounds.as_json()))
    return out


class SelftestCase(TypedDict):
    """One must-fire / must-not-fire case through the real packed loss."""

    expected: list[int]
    recorded: list[int]
    loss_reported: list[int]
    expected_counts: dict[str, int]
    grads: list[float]
    passed: bool
    problems: list[str]


class SelftestReport(TypedDict):
    """diagnostic-selftest.json: every case, and whether all passed."""

    passed: bool
    loss_config: dict[str, Any]  # dataclasses.asdict of the loss's LossConfig
    cases: dict[str, SelftestCase]
    note: str


def _case_datums(rows: Sequence[tuple[float, ...]]) -> tuple[list[tinker.Datum], list[torch.Tensor]]:
    """One datum per row (p, q, A, mask[, exact current logprob]) after two prompt positions with
    junk logprobs. The sampler logprob travels as the SDK's float32, the current one is float64
    (the loss computes in float64), so exact decision boundaries are reachable."""
    data: list[tinker.Datum] = []
    lps: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        p, q, a, m = row[:4]
        lp = row[4] if len(row) > 4 else math.log(p)
        target = [11 + i, 12 + i, 13 + i]
        data.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints([10 + i, 11 + i, 12 + i]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_numpy(np.asarray(target).astype(np.int64)),
                    "logprobs": tinker.TensorData.from_numpy(np.asarray([-7.0, 3.0, math.log(q)], np.float32)),
                    "advantages": tinker.TensorData.from_numpy(np.asarray([0.0, 0.0, a], np.float32)),
                    "mask": tinker.TensorData.from_numpy(np.array([0.0, 0.0, m], dtype=np.float32)),
                },
            )
        )
        lps.append(torch.tensor([0.5, -40.0, lp], dtype=torch.float64, requires_grad=True))
    return data, lps


def _boundary_row(q: float, a: float, diff: float) -> tuple[float, float, float, float, float]:
    """A row whose p - q is EXACTLY `diff` as the loss computes it (torch float64 exp of the
    float64 current logprob minus exp of the float32 sampler logprob). Not every q admits one,
    so q walks float32 steps from the given value until one does (deterministic). Choose q so that
    the smaller of p, q lies in [0.125, 0.25): only then is an odd multiple of 2**-55 like 0.15 a
    representable exact difference."""
    mu32 = np.float32(math.log(q))
    for _ in range(200):
        q64 = torch.tensor(float(mu32), dtype=torch.float64).exp()
        lp0 = torch.log(q64 + diff)
        for k in range(-8, 9):
            lp = lp0
            step = torch.tensor(math.inf if k > 0 else -math.inf, dtype=torch.float64)
            for _ in range(abs(k)):
                lp = torch.nextafter(lp, step)
            if float(lp.exp() - q64) == diff:
                return (float(lp.exp()), float(np.exp(np.float64(mu32))), a, 1.0, float(lp))
        mu32 = np.nextafter(mu32, np.float32(0.0))
    raise DiagnosticError(f"no float64 logprob gives p - q == {diff!r} exactly")


# (p, q, A, mask[, lp]) rows, expected (removed_pos, removed_neg, mask_zero_adv), grad must be zero per row
SelftestRows = tuple[tuple[tuple[float, ...], ...], tuple[int, int, int], tuple[bool, ...]]


def selftest_cases(delta: float) -> dict[str, SelftestRows]:
    """The cases at the rule's `delta`: the rows that sit near +-delta are placed relative to it."""
    return {
        "must_fire_pos_adv_up": (((0.80, 0.40, 1.0, 1.0),), (1, 0, 0), (True,)),
        "must_fire_neg_adv_down": (((0.10, 0.60, -1.0, 1.0),), (0, 1, 0), (True,)),
        "must_fire_both_signs": (
            ((0.95, 0.50, 0.5, 1.0), (0.05, 0.50, -0.5, 1.0), (0.5, 0.5, 0.5, 1.0)),
            (1, 1, 0),
            (True, True, False),
        ),
        # Probability difference, not ratio: these two separate Binary-TV from a ratio clip (p - q just
        # above delta at a ratio under 1 + eps while delta < eps / (1 + eps); a ratio beyond 1 +- eps at |p - q| = delta / 2).
        "must_fire_high_q_small_ratio": (((0.995, 0.995 - (delta + 0.005), 1.0, 1.0),), (1, 0, 0), (True,)),
        "must_not_fire_large_ratio_small_prob": (
            ((1.5 * delta, delta, 1.0, 1.0), (0.5 * delta, delta, -1.0, 1.0)),
            (0, 0, 0),
            (False, False),
        ),
        "must_not_fire_on_policy": (((0.3, 0.3, 1.0, 1.0), (0.7, 0.7, -1.0, 1.0)), (0, 0, 0), (False, False)),
        "must_not_fire_below_delta": (
            ((0.5 + (delta - 0.05), 0.50, 1.0, 1.0), (0.5 - (delta - 0.05), 0.50, -1.0, 1.0)),
            (0, 0, 0),
            (False, False),
        ),
        "must_not_fire_recovery_direction": (
            ((0.05, 0.90, 1.0, 1.0), (0.90, 0.05, -1.0, 1.0)),
            (0, 0, 0),
            (False, False),
        ),
        "zero_advantage_is_not_engagement": (((0.05, 0.90, 0.0, 1.0),), (0, 0, 1), (True,)),
        "padding_is_not_engagement": (
            ((0.99, 0.01, 1.0, 0.0), (0.01, 0.99, -1.0, 0.0), (0.5, 1e-4, 1.0, 0.0)),
            (0, 0, 0),
            (True, True, True),
        ),
        # Exact +-delta boundaries: the rule is strict, so p - q == +-delta is kept, one ulp beyond is removed.
        "boundary_exact_plus_delta_kept": ((_boundary_row(0.20, 1.0, delta),), (0, 0, 0), (False,)),
        "boundary_one_ulp_above_plus_delta_removed": (
            (_boundary_row(0.20, 1.0, math.nextafter(delta, 1.0)),),
            (1, 0, 0),
            (True,),
        ),
        "boundary_exact_minus_delta_kept": ((_boundary_row(0.30, -1.0, -delta),), (0, 0, 0), (False,)),
        "boundary_one_ulp_below_minus_delta_removed": (
            (_boundary_row(0.30, -1.0, math.nextafter(-delta, -1.0)),),
            (0, 1, 0),
            (True,),
        ),
        # Ratio cap C: r = 20 on a kept token is a hit (weight C); on a dropped token it is not (no gradient to cap).
        "ratio_cap_hit_on_kept_token": (((2e-5, 1e-6, 1.0, 1.0),), (0, 0, 0), (False,)),
        "ratio_cap_not_counted_on_dropped_token": (((0.90, 0.04, 1.0, 1.0),), (1, 0, 0), (True,)),
        # Counterfactual PPO eps=0.2, both sides: clipped only where the ratio left [0.8, 1.2] in A's direction.
        "ppo_clip_pos_side": (((0.13, 0.10, 1.0, 1.0), (0.07, 0.10, 1.0, 1.0)), (0, 0, 0), (False, False)),
        "ppo_clip_neg_side": (((0.07, 0.10, -1.0, 1.0), (0.13, 0.10, -1.0, 1.0)), (0, 0, 0), (False, False)),
    }


# Further counts a case must show (cap hits and counterfactual clips), by LossStats field.
SELFTEST_EXTRA: dict[str, dict[str, int]] = {
    "padding_is_not_engagement": {"dppo_ratio_cap_hits": 0, "ppo_clipped": 0, "tokens_loss": 0},
    "ratio_cap_hit_on_kept_token": {"dppo_ratio_cap_hits": 1, "ppo_clipped": 1},
    "ratio_cap_not_counted_on_dropped_token": {"dppo_ratio_cap_hits": 0},
    "ppo_clip_pos_side": {"ppo_clipped": 1, "ppo_clipped_pos_adv": 1, "ppo_clipped_neg_adv": 0},
    "ppo_clip_neg_side": {"ppo_clipped": 1, "ppo_clipped_pos_adv": 0, "ppo_clipped_neg_adv": 1},
    "boundary_exact_plus_delta_kept": {"dppo_exceed_pos": 0},
    "boundary_one_ulp_above_plus_delta_removed": {"dppo_exceed_pos": 1},
    "boundary_exact_minus_delta_kept": {"dppo_exceed_neg": 0},
    "boundary_one_ulp_below_minus_delta_removed": {"dppo_exceed_neg": 1},
}
_SELFTEST_COUNTS = ("dppo_removed_pos_adv", "dppo_removed_neg_adv", "dppo_mask_zero_adv")  # a case's expected triple


def deterministic_selftest(
    loss_fn_factory: Callable[[losses.LossConfig], losses.PackedLoss] | None = None,
    loss_cfg: losses.LossConfig | None = None,
) -> SelftestReport:
    """Must-fire and must-not-fire cases through the real packed loss (counts from its metrics
    and from the recorder) and its gradients: a removed token gets exactly zero gradient, a kept
    nonzero-advantage token a nonzero one. Also run in tests/unit (the suite's evidence)."""
    cfg = loss_cfg or losses.LossConfig(DPPO_LOSS, normalization="token_mean")
    factory = loss_fn_factory or losses.make_loss_fn
    cases: dict[str, SelftestCase] = {}
    for name, (rows, expected, zero_grad) in selftest_cases(cfg.dppo_delta).items():
        data, lps = _case_datums(rows)
        rec = ins.LossCallRecorder(cfg)
        loss, metrics = rec.wrap(factory(cfg))(data, lps)
        loss.backward()
        s = rec.records[0].stats
        got = tuple(getattr(s, k) for k in _SELFTEST_COUNTS)
        reported = tuple(int(metrics.get(LossStats.recorded_name(k), -1)) for k in _SELFTEST_COUNTS)
        grads = [float(lp.grad[-1]) if lp.grad is not None else math.nan for lp in lps]
        prompt_grads_zero = all(lp.grad is not None and float(lp.grad[:2].abs().sum()) == 0.0 for lp in lps)
        grad_ok = all((g == 0.0) if z else (g != 0.0 and math.isfinite(g)) for g, z in zip(grads, zero_grad))
        problems = []
        if got != expected:
            problems.append(f"recorded (removed+, removed-, zero-adv drops) {got} != expected {expected}")
        if reported != expected:
            problems.append(f"loss reported {reported} != expected {expected}")
        if not grad_ok:
            problems.append(f"response-token gradients {grads} (zero expected: {list(zero_grad)})")
        if not prompt_grads_zero:
            problems.append("prompt positions received a gradient")
        extra = {LossStats.recorded_name(k): (getattr(s, k), want) for k, want in SELFTEST_EXTRA.get(name, {}).items()}
        for key, (value, want) in extra.items():
            if value != want:
                problems.append(f"recorded {key}={value} != expected {want}")
            if key in metrics and int(metrics[key]) != want:
                problems.append(f"loss reported {key}={metrics[key]} != expected {want}")
        cases[name] = {
            "expected": list(expected),
            "recorded": list(got),
            "loss_reported": list(reported),
            "expected_counts": {key: want for key, (_, want) in extra.items()},
            "grads": grads,
            "passed": not problems,
            "problems": problems,
        }
    return {
        "passed": all(c["passed"] for c in cases.values()),
        "loss_config": asdict(cfg),
        "cases": cases,
        "note": "deterministic inputs through losses.make_loss_fn and the recorder; the same cases run in "
        "tests/unit/test_diagnostic_analysis.py, golden parity in tests/unit covers exact boundaries",
    }

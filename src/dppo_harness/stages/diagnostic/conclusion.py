"""The diagnostic's answer to the question asked: the classification and cause judged for the
planned model, the next action (the frozen revised comparison spec when active, else the
cheapest step), and the <= 2-sentence summary.

Pure functions. The served model (`evidence.backend.ServedModel`) is an INPUT, so the
summary never has to guess which model computed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import JsonValue

from dppo_harness.evidence.backend import ServedModel
from dppo_harness.json_types import JsonObject
from dppo_harness.loss.loss_registry import DPPO_LOSS, get_loss
from dppo_harness.stages.diagnostic.classification import Classification

if TYPE_CHECKING:
    from dppo_harness.plans import ExperimentSpec
    from dppo_harness.plans.models import BoundedDiagnostic


def cause_for_question(measured_cause: str | None, served: ServedModel) -> str | None:
    """The cause for the question asked (does the mask engage on the PLANNED model?). On a stand-in
    nothing measured is evidence about the planned model: missing_evidence, whatever the stand-in
    did. A code defect found on the stand-in stays a defect (the code is the same)."""
    if served.rehearsal and measured_cause != "code_or_instrumentation_defect":
        return "missing_evidence"
    return measured_cause


_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def count_sentences(text: str) -> int:
    """Sentences = terminal punctuation followed by whitespace or the end (decimals like 0.5 and
    names like local/tiny-qwen3 do not end one); a trailing fragment without a full stop counts."""
    stripped = text.strip()
    if not stripped:
        return 0
    ends = len(_SENTENCE_END.findall(stripped))
    return ends + (0 if _SENTENCE_END.search(stripped[-1:] + " ") else 1)


def compose_summary(
    *,
    served: ServedModel,
    updates_done: int,
    max_updates: int,
    groups: int,
    group_size: int,
    wall_seconds: float,
    state: str,
    cause: str | None,
    active: bool,
    next_action: str,
) -> str:
    """Two plain sentences: what ran (naming the stand-in when one served) and what it showed,
    with the next action. Details live in report.md."""
    name = served.served or "a model the service did not name"
    model = f"the stand-in {name} (not {served.planned})" if served.rehearsal else name
    first = (
        f"A bounded DPPO diagnostic trained {model} for {updates_done} of {max_updates} updates on one "
        f"frozen {groups}x{group_size} GSM8K batch in {wall_seconds:.0f} s"
    )
    shown = "the mask engaged" if active else f"the measured state was {state}"
    if served.rehearsal:
        second = (
            f"On the stand-in {shown}, so for {served.planned} the cause is {cause or 'none'} "
            f"and the next action is to {next_action.split(':')[0]}"
        )
    else:
        second = f"Pooled over the second epoch {shown} (cause {cause or 'none'}); next: {next_action.split(':')[0]}"
    return _plain(first) + ". " + _plain(second) + "."


def _plain(s: str) -> str:
    # No inner sentence ends: a summary sentence must stay one sentence.
    return re.sub(r"[.!?](?=\s)", ",", s).rstrip(".!? ")


def for_planned_model(c: Classification, served: ServedModel) -> Classification:
    """The classification judged for the question asked: on a stand-in, keep the measured state and
    cause (`measured_cause`) but the cause for the planned model is missing_evidence."""
    cause = cause_for_question(c.cause, served)
    extra = ""
    if served.rehearsal:
        extra = (
            f" These measurements come from the stand-in {served.served}, not {served.planned}: the measured "
            f"state ({c.state}, measured cause {c.cause or 'none'}) is a fact about the stand-in only, so for "
            f"{served.planned} the evidence is missing."
        )
    return replace(
        c,
        cause=cause,
        explanation=c.explanation + extra,
        measured_cause=c.cause,
        served_model=served.served,
        stand_in=served.rehearsal,
    )


def next_action(
    classification: Classification,
    d: BoundedDiagnostic,
    spec: ExperimentSpec | None,
    served: ServedModel | None = None,
    measured: Mapping[str, JsonValue] | None = None,
) -> JsonObject:
    """Stand-in: the same frozen plan unchanged on the real service. Active: the frozen revised
    comparison spec (not executed). Otherwise: the cheapest next step."""
    if served is not None and served.rehearsal and classification.cause != "code_or_instrumentation_defect":
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
            "measured_on_stand_in": dict(measured or {}),  # analyse passes what the run measured
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

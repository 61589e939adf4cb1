"""The diagnostic's answer to the question asked: served-model identity, the cause judged for the
planned model, the cheapest next action, and the <= 2-sentence summary (issue 11 points 1-2).

Pure functions. The served-model identity is an INPUT (the connectivity/identity detection of
issue 10 can build a `ServedModel`; `served_model_from_info` reads a get_info response), so the
summary never has to guess which model computed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RERUN_ON_SERVICE = (
    "run this same frozen plan unchanged on the real service (Spindle, {model}): the stand-in's result says "
    "nothing about {model}; more epochs become a candidate only after a real-model run shows the regime is "
    "inactive there"
)


@dataclass(frozen=True)
class ServedModel:
    """Which model computed. `stand_in` is the substitute's identity when one served, else None."""

    requested: str
    served: str
    stand_in: str | None
    source: str  # where the identity was read (e.g. "get_info model_data.arch")

    @property
    def is_stand_in(self) -> bool:
        return self.stand_in is not None


def served_model_from_info(info: Mapping[str, Any] | None, requested: str, *, backend: str) -> ServedModel:
    """Identity from a dumped get_info response: `model_data.arch` names what really computes
    (the embedded server answers to the requested name but its arch is the stand-in). The local
    backend is always a stand-in, even when the response lacks the arch."""
    md = (info or {}).get("model_data") or {}
    arch = md.get("arch")
    name = md.get("model_name")
    marker = md.get("embedded_server")
    if arch and arch != requested and (marker or backend == "local" or str(arch).startswith("local/")):
        return ServedModel(requested, str(arch), str(arch), "get_info model_data.arch")
    if backend == "local":
        stand_in = str(arch) if arch else "embedded server stand-in (identity not reported)"
        return ServedModel(requested, stand_in, stand_in, "backend=local")
    if not name:  # optional in the SDK's ModelData: unavailable, never the requested name
        return ServedModel(requested, f"a model the service did not name (requested {requested})", None,
                           "unavailable: the get_info response has no model_data.model_name")
    return ServedModel(requested, str(name), None, "get_info model_data.model_name")


def cause_for_question(measured_cause: str | None, active: bool, served: ServedModel) -> str | None:
    """The cause for the question asked (does the mask engage on the PLANNED model?). On a stand-in
    nothing measured is evidence about the planned model: missing_evidence, whatever the stand-in
    did. A code defect found on the stand-in stays a defect (the code is the same)."""
    if not served.is_stand_in:
        return measured_cause
    if measured_cause == "code_or_instrumentation_defect":
        return measured_cause
    return "missing_evidence"


def stand_in_next_action(served: ServedModel, plan_id: str, measured: Mapping[str, Any]) -> dict[str, Any]:
    """The cheapest next action after a stand-in run: the same frozen plan, unchanged, on the real service."""
    return {
        "kind": "cheapest_next_action",
        "executed": False,
        "cause": "missing_evidence",
        "action": RERUN_ON_SERVICE.format(model=served.requested),
        "plan_id": plan_id,
        "plan_changes": [],
        "served_model": served.served,
        "measured_on_stand_in": dict(measured),
        "not_yet_candidates": ["more epochs over the frozen batch (only after a real-model run shows an inactive regime)"],
    }


_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def count_sentences(text: str) -> int:
    """Sentences = terminal punctuation followed by whitespace or the end (decimals like 0.5 and
    names like local/tiny-qwen3 do not end one); a trailing fragment without a full stop counts."""
    stripped = text.strip()
    if not stripped:
        return 0
    ends = len(_SENTENCE_END.findall(stripped))
    return ends + (0 if _SENTENCE_END.search(stripped[-1:] + " ") else 1)


def compose_summary(*, served: ServedModel, updates_done: int, max_updates: int, groups: int, group_size: int,
                    wall_seconds: float, state: str, cause: str | None, active: bool, next_action: str) -> str:
    """Two plain sentences: what ran (naming the stand-in when one served) and what it showed,
    with the next action. Details live in report.md."""
    model = (f"the stand-in {served.stand_in} (not {served.requested})" if served.is_stand_in
             else served.served)
    first = (f"A bounded DPPO diagnostic trained {model} for {updates_done} of {max_updates} updates on one "
             f"frozen {groups}x{group_size} GSM8K batch in {wall_seconds:.0f} s")
    shown = "the mask engaged" if active else f"the measured state was {state}"
    if served.is_stand_in:
        second = (f"On the stand-in {shown}, so for {served.requested} the cause is {cause or 'none'} "
                  f"and the next action is to {next_action.split(':')[0]}")
    else:
        second = f"Pooled over the second epoch {shown} (cause {cause or 'none'}); next: {next_action.split(':')[0]}"
    return _plain(first) + ". " + _plain(second) + "."


def _plain(s: str) -> str:
    # No inner sentence ends: a summary sentence must stay one sentence.
    return re.sub(r"[.!?](?=\s)", ",", s).rstrip(".!? ")

"""What a spec says about its losses, checked against what the harness implements: the
correctness-preflight paths it names, and the loss parameters its text states (the GRPO clip eps,
the DPPO mask delta and ratio cap). A spec is refused at load, in one line naming the field and
quoting the statement, when it names a path the harness does not run or states a parameter the
registered loss its arms train does not use."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal

from dppo_harness.json_types import JsonObject
from dppo_harness.loss import loss_registry
from dppo_harness.loss.correctness_paths import IMPLEMENTED_PATHS, implemented_list
from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.models import ExperimentSpec
from dppo_harness.plans.prose import contexted_sentences, read_number


def check_loss_statements(spec: ExperimentSpec) -> None:
    """Every check of this module (the plan loader's one call)."""
    check_correctness_paths(spec)
    check_loss_params(spec)


def check_correctness_paths(spec: ExperimentSpec) -> tuple[str, ...]:
    """The spec's correctness path ids, each one the harness implements with the kind the spec
    gives it, each named once, at least one when the preflight is required; else PlanError."""
    block = spec.correctness_preflight
    if block.required and not block.paths:
        raise PlanError(
            f"correctness_preflight.paths: the spec requires a correctness preflight but names no path "
            f"(implemented: {implemented_list()})"
        )
    seen: set[str] = set()
    for i, path in enumerate(block.paths):
        at = f"correctness_preflight.paths[{i}]"
        known = IMPLEMENTED_PATHS.get(path.id)
        if known is None:
            raise PlanError(
                f"{at}.id: {path.id!r} is not a correctness path this harness implements "
                f"(implemented: {implemented_list()})"
            )
        if path.kind != known.kind:
            raise PlanError(f"{at}.kind: {path.kind!r}, but the harness's path {path.id!r} is of kind {known.kind!r}")
        if path.id in seen:
            raise PlanError(f"{at}.id: {path.id!r} is named twice")
        seen.add(path.id)
    return tuple(p.id for p in block.paths)


# ---------------------------------------------------------------------------------------------
# Loss parameters stated in the text


# A number's place: a token that starts with a digit (a symbol such as "eps" in "1-eps" is not a
# statement); the whole token goes to the prose number reader, which refuses what it cannot read.
# Inside clip(...) a comma ends the token (it separates the bounds).
def _n(group: str, in_clip: bool = False) -> str:
    return rf"(?P<{group}>\.?\d[^\s;)\]{',' if in_clip else ''}]*)"


_IS = r"\s*(?:=|:|\bof\b|\bis\b|\bat\b)?\s*"
_CLIP = r"(?i)\b(?:clip|clamp)\(\s*r\s*,\s*"
_FORMS: dict[str, tuple[re.Pattern[str], ...]] = {
    "ppo_eps": (
        re.compile(r"(?i)(?<!adam )(?<!adamw )(?<![\w-])(?:eps|epsilon|ε)" + _IS + _n("a")),
        re.compile(_CLIP + r"1\s*-\s*" + _n("a", True) + r"\s*,\s*1\s*\+\s*" + _n("b", True) + r"\s*\)"),
        re.compile(_CLIP + _n("lo", True) + r"\s*,\s*" + _n("hi", True) + r"\s*\)"),
    ),
    "dppo_delta": (re.compile(r"(?i)(?<![\w-])(?:delta|δ)" + _IS + _n("a")),),
    "ratio_cap": (
        re.compile(r"(?i)\bratio[- ]cap(?:\s+C)?" + _IS + _n("a")),
        re.compile(r"(?<![\w-])C\s*=\s*" + _n("a")),
    ),
}
_WHAT = {"ppo_eps": "the GRPO clip eps", "dppo_delta": "the DPPO mask delta", "ratio_cap": "the DPPO ratio cap"}
_FORM = {"ppo_eps": "eps=0.2 or clip(r, 1-0.2, 1+0.2)", "dppo_delta": "delta = 0.15", "ratio_cap": "ratio cap C = 10"}


@dataclass(frozen=True)
class LossParamStatement:
    key: str  # a LossConfig threshold: ppo_eps, dppo_delta or ratio_cap
    value: float
    field: str  # the spec field the statement is in
    source: str  # the sentence verbatim


def spec_model(raw: JsonObject) -> ExperimentSpec:
    """A decoded spec validated (tests and tools that edit a spec's JSON)."""
    return ExperimentSpec.model_validate(raw)


def _texts(spec: ExperimentSpec) -> Iterator[tuple[str, str]]:
    yield "method", spec.method
    yield "baseline", spec.baseline
    yield "command", spec.command
    yield "activation_gate.reason", spec.activation_gate.reason
    for i, c in enumerate(spec.activation_gate.checks):
        yield f"activation_gate.checks[{i}].measures", c.measures or ""


def _number(token: str, at: str, key: str, sentence: str) -> Decimal:
    token = token.rstrip(".,")  # the punctuation after a number (a full stop, a comma before a space)
    try:
        if "," in token:
            raise ValueError(token)
        return Decimal(repr(read_number(token, False)))
    except ValueError:
        raise PlanError(
            f"{at}: cannot read {_WHAT[key]} {token!r} in {sentence!r} (a form the reader reads: {_FORM[key]})"
        ) from None


def _value(key: str, m: re.Match[str], at: str, sentence: str) -> float:
    groups = m.groupdict()
    if "lo" in groups:  # clip(r, lo, hi): eps from both bounds, which must agree
        a = Decimal(1) - _number(groups["lo"], at, key, sentence)
        b = _number(groups["hi"], at, key, sentence) - Decimal(1)
    else:
        a = _number(groups["a"], at, key, sentence)
        b = _number(groups["b"], at, key, sentence) if groups.get("b") else a
    if a != b:
        raise PlanError(
            f"{at}: the clip {m.group(0)!r} is not symmetric ({a} below, {b} above) in {sentence!r}; "
            f"the registered GRPO clip is symmetric (a form the reader reads: {_FORM[key]})"
        )
    return float(a)


def stated_loss_params(spec: ExperimentSpec) -> dict[str, list[LossParamStatement]]:
    """Every statement of a loss parameter in the spec's text, by parameter (history sentences,
    "an earlier draft used ...", are not statements of this spec)."""
    arm_names = [a.name for a in spec.arms]
    out: dict[str, list[LossParamStatement]] = {}
    for at, text in _texts(spec):
        for _, sentence, context in contexted_sentences(text, arm_names):
            if context == "history":
                continue
            for key, forms in _FORMS.items():
                taken: list[tuple[int, int]] = []
                for form in forms:
                    for m in form.finditer(sentence):
                        if any(s < m.end() and m.start() < e for s, e in taken):
                            continue
                        taken.append(m.span())
                        out.setdefault(key, []).append(
                            LossParamStatement(key, _value(key, m, at, sentence), at, sentence)
                        )
    return out


def check_loss_params(spec: ExperimentSpec) -> dict[str, list[LossParamStatement]]:
    """Each statement of a parameter equals it in every registered loss the arms train that uses
    it (so statements also agree with each other); else PlanError quoting the statement and the
    registered value. A parameter no arm's loss uses is refused too."""
    stated = stated_loss_params(spec)
    for key, statements in stated.items():
        registered = {
            a.loss: float(loss_registry.get_loss(a.loss).params[key])
            for a in spec.arms
            if key in loss_registry.get_loss(a.loss).params
        }
        for s in statements:
            if not registered:
                raise PlanError(
                    f"{s.field}: states {_WHAT[key]} {s.value:g} ({s.source!r}), but no arm trains a "
                    f"loss with it (arms' losses: {', '.join(sorted({a.loss for a in spec.arms}))})"
                )
            for loss, value in registered.items():
                if not math.isclose(s.value, value, rel_tol=1e-12):
                    raise PlanError(
                        f"{s.field}: states {_WHAT[key]} {s.value:g} ({s.source!r}), but the registered "
                        f"loss {loss} uses {value:g}"
                    )
    return stated

"""The rules a rehearsal plan obeys against the spec it derives from (by repository path and
sha256): every leaf where it differs is declared with its reason, and the spec's gates and
thresholds stay as written (`_FROZEN`), but for the executed-model check's `one_of`, which follows
`base_model`, and the restoration learning rates, which follow the arms' lr.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from pydantic import JsonValue

from dppo_harness.json_types import JsonObject
from dppo_harness.plans.models import (
    Difference,
    ExperimentSpec,
    PlanError,
    RehearsalPlan,
    _fail,
    decode,
    format_path,
    validate_model,
)

# Spec subtrees a rehearsal may not change (its gates and thresholds stay as written), as
# (pattern over the leaf path, exception pattern or None).
_FROZEN = (
    re.compile(r"^activation_gate(\.|\[|$)"),
    re.compile(r"^decision_rule(\.|\[|$)"),
    re.compile(r"^success_criterion$"),
    re.compile(r"^correctness_preflight(\.|\[|$)"),
    re.compile(r"^arms\[\d+\]\.(loss|updates_per_batch)$"),
    re.compile(r"^restoration_preflight(\.|\[|$)"),
)
_FOLLOWS_BASE_MODEL = re.compile(r"^activation_gate\.checks\[(\d+)\]\.one_of(\[\d+\])?$")
_FOLLOWS_LR = re.compile(r"^restoration_preflight\.groups\[\d+\]\.arms\[\d+\]\.optimizer_config\.learning_rate$")
# A field path in a JSON document: object keys and list indices.
JsonPath = tuple[str | int, ...]


class _Missing(enum.Enum):
    """A leaf that one JSON document lacks."""

    MISSING = enum.auto()


_MISSING = _Missing.MISSING
# The deviation field (models.DEVIATION_FIELDS) of a difference, by the spec's top-level key (default "objective").
_DEVIATION_FIELD_OF = {
    "base_model": "model",
    "steps": "steps",
    "batch_size": "effective_batch",
    "dataset": "dataset",
    "eval": "evaluator",
    "primary_endpoint": "endpoint",
}


def _leaves(obj: JsonValue, path: JsonPath = ()) -> Iterator[tuple[JsonPath, JsonValue]]:
    """(path, value) of every leaf; an empty object or list is a leaf itself."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _parse_path(dotted: str) -> JsonPath:
    out: list[str | int] = []
    for part in dotted.split("."):
        name, *idx = part.split("[")
        out.append(name)
        out += [int(i.rstrip("]")) for i in idx]
    return tuple(out)


def _get(obj: JsonValue, path: JsonPath) -> JsonValue | _Missing:
    for p in path:
        if isinstance(p, int) and isinstance(obj, list) and p < len(obj):
            obj = obj[p]
            continue
        if isinstance(p, str) and isinstance(obj, dict) and p in obj:
            obj = obj[p]
            continue
        return _MISSING
    return obj


def _same(a: JsonValue | _Missing, b: JsonValue | _Missing) -> bool:
    """JSON equality that keeps true apart from 1 (and 1 from 1.0 only by value)."""
    if isinstance(a, _Missing) or isinstance(b, _Missing):
        return a is b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) or (
        type(a) in (int, float) and type(b) in (int, float) and a == b
    )


def _changed_leaves(a: JsonValue, b: JsonValue) -> list[JsonPath]:
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    return sorted((p for p in la.keys() | lb.keys() if not _same(la.get(p, _MISSING), lb.get(p, _MISSING))), key=str)


def _derived_from_file(rel: str, plan_path: Path | None, repo_root: Path | None) -> Path:
    if repo_root is not None:
        return Path(repo_root) / rel
    if plan_path is None:
        raise PlanError("derived_from.path: a rehearsal given as bytes needs repo_root to find its derived-from spec")
    for base in Path(plan_path).resolve().parents:
        if (base / rel).is_file():
            return base / rel
    raise PlanError(f"derived_from.path: {rel} not found in any directory above {plan_path}")


def check_rehearsal(plan: RehearsalPlan, raw: JsonObject, derived_path: Path) -> None:
    """PlanError naming the field unless the derived-from file's sha256 matches, the frozen subtrees
    are unchanged, and the leaves that differ are exactly the declared differences, values matching."""
    ref = plan.derived_from
    try:
        data = derived_path.read_bytes()
    except OSError as exc:
        raise _fail("derived_from.path", f"cannot read {derived_path} ({exc.strerror})") from None
    got = hashlib.sha256(data).hexdigest()
    if got != ref.sha256:
        raise _fail("derived_from.sha256", f"recorded {ref.sha256} but {ref.path} hashes to {got}")
    try:
        base = decode(data, derived_path)
        kind, _ = validate_model(base)
    except PlanError as exc:
        raise _fail("derived_from.path", f"not a usable plan ({exc})") from None
    if kind != "experiment_spec":
        raise _fail("derived_from.path", f"expected an experiment spec, got kind {kind!r}")
    spec = raw["spec"]
    declared = [(i, d, _parse_path(d.field)) for i, d in enumerate(plan.differences)]

    for p in _changed_leaves(base, spec):
        leaf = format_path(p)
        _check_not_frozen(leaf, spec, plan.spec)
        if not any(p[: len(dp)] == dp for _, _, dp in declared):
            raise _fail(
                f"spec.{leaf}",
                f"differs from {ref.path} ({_show(_get(base, p))} -> "
                f"{_show(_get(spec, p))}) but is not listed in differences",
            )
    for i, d, dp in declared:
        old, new = _get(base, dp), _get(spec, dp)
        if isinstance(old, _Missing) or isinstance(new, _Missing):
            raise _fail(f"differences[{i}].field", f"{d.field!r} is not a field of both specs")
        if _same(old, new):
            raise _fail(f"differences[{i}]", f"{d.field!r} does not differ: both specs have {_show(old)}")
        if not _same(d.spec, old):
            raise _fail(
                f"differences[{i}].spec", f"expected {_show(old)} (the value in {ref.path}), got {_show(d.spec)}"
            )
        if not _same(d.rehearsal, new):
            raise _fail(
                f"differences[{i}].rehearsal", f"expected {_show(new)} (the value in spec), got {_show(d.rehearsal)}"
            )


def _check_not_frozen(leaf: str, spec: JsonValue, model: ExperimentSpec) -> None:
    """`spec` is the rehearsal's spec as decoded, `model` the same spec validated."""
    m = _FOLLOWS_BASE_MODEL.match(leaf)
    if m:
        check = model.activation_gate.checks[int(m.group(1))]
        if check.metric == "executed_base_model" and model.base_model in (check.one_of or []):
            return  # the executed-model check follows base_model
    if _FOLLOWS_LR.match(leaf) and _same(_get(spec, _parse_path(leaf)), model.optimizer.lr):
        return  # the restoration preflight's learning rate follows optimizer.lr
    if any(f.match(leaf) for f in _FROZEN):
        raise _fail(
            f"spec.{leaf}",
            "a rehearsal keeps the spec's gates and thresholds as written "
            "(activation_gate, decision_rule, success_criterion, correctness_preflight, "
            "arms[*].loss, arms[*].updates_per_batch, restoration_preflight)",
        )


def _show(v: JsonValue | _Missing) -> str:
    return "<absent>" if isinstance(v, _Missing) else json.dumps(v)


def rehearsal_deviation(d: Difference) -> dict[str, str]:
    """A declared rehearsal difference as a deviation ({field, original, effective, reason})."""
    top = d.field.split(".")[0].split("[")[0]
    return {
        "field": _DEVIATION_FIELD_OF.get(top, "objective"),
        "original": f"{d.field} = {json.dumps(d.spec)}",
        "effective": f"{d.field} = {json.dumps(d.rehearsal)}",
        "reason": f"rehearsal: {d.reason}",
    }

"""Rehearsal plans: the rules a declared rehearsal obeys against its spec, and the tool that
writes one (`python -m dppo_harness.plans rehearse`).

A rehearsal is a complete experiment spec at rehearsal size. It names the spec it derives from
by repository path and sha256, declares every leaf where it differs (with the reason), and keeps
the spec's gates and thresholds as written (`activation_gate`, `decision_rule`,
`success_criterion`, `correctness_preflight`, `arms[*].loss`, `arms[*].updates_per_batch`,
`restoration_preflight`; only the executed-model check's `one_of` follows `base_model` and the
restoration learning rates follow the arms' lr).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import JsonValue

from dppo_harness.json_types import JsonObject
from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.models import Difference, ExperimentSpec, RehearsalPlan, _fail, decode, validate_model
from dppo_harness.plans.prose import Stated, format_number, rewrite
from dppo_harness.plans.resolution import default_settlements, load_resolution
from dppo_harness.plans.run_config import RunConfig, build_run_config
from dppo_harness.plans.schema_errors import format_path

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
    return sorted(
        {p for p, v in _leaves(b) if not _same(_get(a, p), v)} | {p for p, v in _leaves(a) if not _same(_get(b, p), v)},
        key=str,
    )


def leaf_differences(a: JsonValue, b: JsonValue) -> dict[str, tuple[JsonValue, JsonValue]]:
    """Field path -> (value in a, value in b) of every leaf where two JSON documents differ
    (None where one side lacks the leaf)."""
    out: dict[str, tuple[JsonValue, JsonValue]] = {}
    for p in _changed_leaves(a, b):
        x, y = _get(a, p), _get(b, p)
        out[format_path(p)] = (None if isinstance(x, _Missing) else x, None if isinstance(y, _Missing) else y)
    return out


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
    """The rules a rehearsal plan (validated `plan`, decoded `raw`) obeys against the spec it
    derives from (PlanError naming the field): the derived-from file's sha256 matches; the frozen
    subtrees are unchanged; every leaf that differs is declared in `differences` with matching
    values, and every declared difference really differs."""
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


# ----------------------------------------------------------------------------- the rehearse tool

STAND_IN = "local/tiny-qwen3-gsm8k"  # the embedded server's stand-in model
# The declared rehearsal size `plans rehearse` uses unless told otherwise (the shipped plan's).
DEFAULT_STEPS, DEFAULT_GROUPS, DEFAULT_EVAL_ITEMS = 3, 4, 50
# Rollouts per rehearsal batch when `--groups` is not given: the shipped plan's 4 groups x 8. The
# stand-in answers few prompts, so a smaller batch can hold no group with unequal rewards, hence no
# gradient-bearing token for the gate to measure (the measurements: docs/benchmarks.md).
DEFAULT_ROLLOUTS = 32
# The learning rate at which the stand-in's DPPO mask fires inside the spec's gate ranges, and why.
STAND_IN_LR = 0.01
_MEASURED_LR = (
    "the stand-in's DPPO mask was measured to fire at this lr (gate pilot of the saved spec at 4 groups: "
    "lr 3e-3 gave a mean second-update masked fraction 0.00049; lr 1e-2 gave 0.022, |p-q| q90 0.12, clip "
    "fraction 0.33) and not at 2e-5 (bounded diagnostic: 0 tokens removed)"
)
# The shipped plan's reason (the saved spec's lr is the one measured): kept word for word.
_SAVED_SPEC_LR_REASON = (
    "lr 0.01: at the spec's 2e-5 the stand-in's DPPO mask does not fire (bounded diagnostic: 0 tokens removed), so "
    "the spec's own gate ranges could not pass and the pipeline could not be rehearsed end to end; at this lr the "
    "stand-in's mask fires measurably inside those unchanged ranges (measured on the stand-in with the gate pilot at "
    "4 groups: lr 3e-3 gave a mean second-update masked fraction 0.00049 < 0.001; lr 1e-2 gave 0.022, |p-q| q90 "
    "0.12, clip fraction 0.33, all in range)"
)
# A rehearsal plan states its launch: it authorizes nothing on a service that is not the embedded server.
_LAUNCH: JsonObject = {
    "source": "this project's declared rehearsal plan, not a requester's launch",
    "launch_mode": "rehearsal",
    "scope": "offline rehearsal on the embedded server only; no stage is authorized on a real service",
    "only_authorized_run": False,
    "authorized_stages": [],
}
_PURPOSE = (
    "Drive the whole paired-comparison pipeline (restoration preflight, activation gate, {arms}, frozen "
    "evaluation of base and {checkpoints}, paired Hoeffding decision, report) offline on the embedded server's "
    "stand-in model. Not a measurement of the hypothesis: results are always labelled rehearsal with verdict "
    "inconclusive."
)
_PROSE_WORDS = {
    "groups_per_batch": "groups_per_batch",
    "rollout_steps": "steps",
    "optim_steps": "steps",
    "lr": "lr",
    "eval_items": "test items",
}


@dataclass(frozen=True)
class RehearsalSize:
    steps: int = DEFAULT_STEPS  # rollout steps per arm
    groups: int | None = DEFAULT_GROUPS  # groups per rollout batch (None: DEFAULT_ROLLOUTS / group size)
    eval_items: int = DEFAULT_EVAL_ITEMS
    lr: float | None = None  # None: the spec's learning rates stay
    lr_reason: str | None = None  # why this lr (default: the measured reason at STAND_IN_LR, else a generic one)
    stand_in: str = STAND_IN


def default_groups(group_size: int, updates_per_batch: int, spec_groups: int) -> int:
    """Groups per rehearsal batch when none is asked for: DEFAULT_ROLLOUTS rollouts, whole
    minibatches, at least one group per minibatch, at most the spec's own batch."""
    groups = max(updates_per_batch, DEFAULT_ROLLOUTS // group_size // updates_per_batch * updates_per_batch)
    return min(groups, spec_groups) if spec_groups % updates_per_batch == 0 else groups


def _lr_reason(size: RehearsalSize, lr: float, run: RunConfig) -> str:
    if size.lr_reason:
        return size.lr_reason
    spec_lr = run.arms[0].lr
    if lr == STAND_IN_LR and spec_lr == 2e-5:
        return _SAVED_SPEC_LR_REASON
    if lr == STAND_IN_LR:
        return (
            f"lr {format_number(lr)}: the spec's {format_number(spec_lr)} is a setting for {run.base_model}, not "
            f"for the stand-in; {_MEASURED_LR}; the gate ranges it must meet are unchanged"
        )
    return (
        f"lr {format_number(lr)}: set for the stand-in model with `plans rehearse --lr` (the spec's "
        f"{format_number(spec_lr)} is a setting for {run.base_model}, not for the stand-in); the gate ranges it "
        "must meet are unchanged"
    )


def _derived_path(spec_path: Path, out_path: Path) -> str:
    """The spec's path as `derived_from.path`: relative to the nearest project root above the
    output that holds the spec, else to the nearest common directory (how the loader finds it)."""
    spec_abs, out_dir = spec_path.resolve(), out_path.resolve().parent
    for base in (out_dir, *out_dir.parents):
        if (base / "pyproject.toml").is_file() and spec_abs.is_relative_to(base):
            return spec_abs.relative_to(base).as_posix()
    common = Path(os.path.commonpath([spec_abs, out_dir]))
    return spec_abs.relative_to(common).as_posix()


def _spec_run(spec_path: Path, model: ExperimentSpec) -> RunConfig:
    """The spec's run config as the stages read it; a spec whose resolution file settles values is
    refused (a rehearsal rewrites the method text those values' sentences belong to)."""
    resolution = load_resolution(spec_path)
    if resolution is not None and resolution.model.interpretations:
        raise PlanError(
            f"{spec_path}: {resolution.file} settles {', '.join(resolution.settlements.entries)}, which a "
            "rehearsal plan cannot carry yet (its method text is rewritten); rehearse a spec whose prose "
            "states these values"
        )
    return build_run_config(model, default_settlements(spec_path))


def make_rehearsal(spec_path: Path, out_path: Path, size: RehearsalSize = RehearsalSize()) -> bytes:
    """The bytes of a declared rehearsal plan of the spec at `spec_path` (to be written at
    `out_path`): the stand-in model, the given size and lr, every difference declared with its
    reason, gates and decision rule unchanged, `derived_from` with the spec's sha256."""
    data = Path(spec_path).read_bytes()
    raw = decode(data, spec_path)
    kind, model = validate_model(raw)
    if not isinstance(model, ExperimentSpec):
        raise _fail("<root>", f"{spec_path}: plans rehearse needs an experiment spec, got kind {kind!r}")
    run = _spec_run(Path(spec_path), model)
    size, groups_reason = _with_default_groups(size, run)
    groups = _checked_groups(size, run)
    edits = _SpecEdits(json.loads(json.dumps(raw)))
    _swap_in_stand_in(edits, model, run, size.stand_in)
    _resize(edits, run, size, groups, groups_reason)
    _follow_lr(edits, model, run, size)
    _follow_method(edits, model, run, size)
    plan = _rehearsal_plan(Path(spec_path), Path(out_path), data, edits, model)
    return (json.dumps(plan, indent=2) + "\n").encode()


@dataclass
class _SpecEdits:
    """The rehearsal's spec as it is rewritten, with each difference declared as it is made."""

    spec: JsonValue
    differences: list[JsonValue] = field(default_factory=list)

    def change(self, at: str, new: JsonValue, reason: str) -> None:
        """Set the leaf `at` to `new` and declare the difference (nothing when it already is `new`)."""
        old = _get(self.spec, _parse_path(at))
        if isinstance(old, _Missing):
            raise KeyError(f"{at}: not a field of the spec")  # every changed field is one of the schema's
        if _same(old, new):
            return
        _set(self.spec, _parse_path(at), new)
        self.differences.append({"field": at, "spec": old, "rehearsal": new, "reason": reason})


def _with_default_groups(size: RehearsalSize, run: RunConfig) -> tuple[RehearsalSize, str]:
    """`size` with its groups per batch set (`default_groups` when none is asked for), and why a
    default that is not the shipped plan's was chosen ("" otherwise)."""
    if size.groups is not None:
        return size, ""
    size = replace(
        size,
        groups=default_groups(int(run.group_size.value), run.updates_per_batch, int(run.groups_per_batch.value)),
    )
    if size.groups == DEFAULT_GROUPS:
        return size, ""
    return size, (
        f"; {size.groups} groups: {DEFAULT_ROLLOUTS} rollouts per batch as in the shipped "
        "rehearsal, since the stand-in answers few prompts and a smaller batch can hold no group "
        "with unequal rewards (measured on the variant spec's gate pilot at lr 1e-2: at 2 and at 4 "
        "groups x 4 it moved nothing, masked fraction 0 and |p-q| q90 below 1e-6; at 8 x 4 it "
        "passed)"
    )


def _checked_groups(size: RehearsalSize, run: RunConfig) -> int:
    """The rehearsal's groups per batch, once every size is at least 1 and the groups form the
    spec's complete-group minibatches (PlanError naming the option otherwise)."""
    assert size.groups is not None
    for name, v in (("--steps", size.steps), ("--groups", size.groups), ("--eval-items", size.eval_items)):
        if v < 1:
            raise PlanError(f"{name}: must be at least 1, got {v}")
    if size.groups % run.updates_per_batch:
        raise PlanError(
            f"--groups: {size.groups} groups cannot form {run.updates_per_batch} complete-group minibatches"
        )
    return size.groups


def _swap_in_stand_in(edits: _SpecEdits, model: ExperimentSpec, run: RunConfig, stand_in: str) -> None:
    """The stand-in model computes; the gate's executed_base_model check follows it."""
    model_reason = (
        f"offline rehearsal on the embedded CPU server: the stand-in model computes, not {run.base_model} "
        "(no Tinker service is reachable here); the gate's executed_base_model check follows base_model"
    )
    edits.change("base_model", stand_in, model_reason)
    for i, check in enumerate(model.activation_gate.checks):
        if check.metric == "executed_base_model" and check.one_of and run.base_model in check.one_of:
            edits.change(
                f"activation_gate.checks[{i}].one_of[{check.one_of.index(run.base_model)}]", stand_in, model_reason
            )


def _resize(edits: _SpecEdits, run: RunConfig, size: RehearsalSize, groups: int, groups_reason: str) -> None:
    """Steps, batch size and test items at rehearsal size; the schedule's shape stays."""
    gs, upb = int(run.group_size.value), run.updates_per_batch
    size_reason = (
        f"size: {size.steps} rollout steps x {groups} groups x {gs} and {size.eval_items} test items "
        "so that gate -> both arms -> evaluation of base and arms -> decision -> report fits 10 minutes on "
        f"2 CPU cores; the schedule's shape (group size, {upb} complete-group minibatch updates per batch, "
        f"temperature, max_tokens) is unchanged{groups_reason}"
    )
    edits.change("steps", size.steps * upb, size_reason)
    edits.change("batch_size", groups * gs, size_reason)
    edits.change("eval.n_examples", size.eval_items, size_reason)


def _follow_lr(edits: _SpecEdits, model: ExperimentSpec, run: RunConfig, size: RehearsalSize) -> None:
    """A rehearsal lr, when one is asked for, in the optimizer, every arm and every restoration arm."""
    if size.lr is None:
        return
    lr_reason = _lr_reason(size, size.lr, run)
    edits.change("optimizer.lr", size.lr, lr_reason)
    for i in range(len(model.arms)):
        edits.change(f"arms[{i}].lr", size.lr, lr_reason)
    for g, group in enumerate(model.restoration_preflight.groups):
        for a in range(len(group.arms)):
            edits.change(
                f"restoration_preflight.groups[{g}].arms[{a}].optimizer_config.learning_rate", size.lr, lr_reason
            )


def _follow_method(edits: _SpecEdits, model: ExperimentSpec, run: RunConfig, size: RehearsalSize) -> None:
    """The method text's statements of the schedule, rewritten to the size and lr above."""
    method, words = _rewritten_method(model.method, run.prose, size, run.updates_per_batch)
    if words:
        follows = "size and lr differences" if size.lr is not None else "size differences"
        edits.change(
            "method",
            method,
            f"the method text states the executed schedule ({', '.join(words)}): it follows "
            f"the {follows} above, nothing else in it changes",
        )


def _rehearsal_plan(
    spec_path: Path, out_path: Path, data: bytes, edits: _SpecEdits, model: ExperimentSpec
) -> JsonObject:
    """The rehearsal plan around the rewritten spec, its declared differences and `derived_from`."""
    two = len(model.arms) == 2
    return {
        "kind": "rehearsal",
        "version": 1,
        "plan_id": f"{spec_path.stem}-rehearsal-local-v1",
        "label": "rehearsal",
        "purpose": _PURPOSE.format(
            arms="both arms" if two else "every arm",
            checkpoints="both final checkpoints" if two else "every final checkpoint",
        ),
        "launch": _LAUNCH,
        "derived_from": {"path": _derived_path(spec_path, out_path), "sha256": hashlib.sha256(data).hexdigest()},
        "differences": edits.differences,
        "spec": edits.spec,
    }


def _rewritten_method(text: str, stated: Mapping[str, Stated], size: RehearsalSize, upb: int) -> tuple[str, list[str]]:
    new = {
        "groups_per_batch": str(size.groups),
        "rollout_steps": str(size.steps),
        "optim_steps": str(size.steps * upb),
        "eval_items": f"the first {size.eval_items}",
    }
    if size.lr is not None:
        new["lr"] = format_number(size.lr)
    replacements: dict[str, tuple[Stated, str]] = {}
    for key, value in new.items():
        s = stated.get(key)
        if s is None:
            continue
        old = text[s.start : s.end]
        if key == "eval_items" and old == f"all {size.eval_items}":
            continue
        if key != "eval_items" and s.value == (size.lr if key == "lr" else int(value)):
            continue
        replacements[key] = (s, value)
    words = list(dict.fromkeys(_PROSE_WORDS[k] for k in _PROSE_WORDS if k in replacements))
    return rewrite(text, replacements), words


def _set(obj: JsonValue, path: JsonPath, value: JsonValue) -> None:
    """Set the leaf at `path` (its parent exists: `path` is a leaf of the spec it came from)."""
    parent = _get(obj, path[:-1])
    last = path[-1]
    if isinstance(parent, dict) and isinstance(last, str):
        parent[last] = value
        return
    if isinstance(parent, list) and isinstance(last, int):
        parent[last] = value
        return
    raise KeyError(f"{format_path(path)}: no such field to set")

"""Frozen plans: schema validation, sha256 of the exact file bytes, effective config, deviations.

Two plan kinds live in `plans/`:
- `experiment_spec`: the saved experiment spec, verbatim from the brief (it has no `kind` key);
- `bounded_diagnostic`: the requester's revised diagnostic (`"kind": "bounded_diagnostic"`).

Validation is strict: an unknown key, a missing key or a wrong type raises `PlanError` whose
message starts with the field path, e.g. `activation_gate.checks[2].min: expected number, got str`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dppo_harness import constants

PlanKind = Literal["experiment_spec", "bounded_diagnostic", "rehearsal"]
# The brief's structured output only knows these deviation fields.
DEVIATION_FIELDS = ("model", "objective", "effective_batch", "steps", "dataset", "evaluator", "endpoint")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class PlanError(ValueError):
    """A plan file that cannot be used; the message names the offending field path."""


# ----------------------------------------------------------------------------- schema DSL


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _fail(path: str, msg: str) -> PlanError:
    return PlanError(f"{path or '<root>'}: {msg}")


class Schema:
    def check(self, value: Any, path: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class Str(Schema):
    def __init__(self, pattern: str | None = None, choices: Sequence[str] | None = None):
        self.pattern = re.compile(pattern) if pattern else None
        self.choices = tuple(choices) if choices else None

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, str):
            raise _fail(path, f"expected string, got {_type_name(value)}")
        if self.choices is not None and value not in self.choices:
            raise _fail(path, f"expected one of {list(self.choices)}, got {value!r}")
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise _fail(path, f"expected a string matching {self.pattern.pattern!r}, got {value!r}")


class Num(Schema):
    def __init__(self, lo: float | None = None, hi: float | None = None):
        self.lo, self.hi = lo, hi

    def check(self, value: Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, f"expected number, got {_type_name(value)}")
        if not math.isfinite(value):
            raise _fail(path, f"expected a finite number, got {value!r}")
        if self.lo is not None and value < self.lo:
            raise _fail(path, f"expected a number >= {self.lo}, got {value!r}")
        if self.hi is not None and value > self.hi:
            raise _fail(path, f"expected a number <= {self.hi}, got {value!r}")


class Int(Num):
    def check(self, value: Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, f"expected integer, got {_type_name(value)}")
        super().check(value, path)


class Bool(Schema):
    def __init__(self, const: bool | None = None):
        self.const = const

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, bool):
            raise _fail(path, f"expected bool, got {_type_name(value)}")
        if self.const is not None and value is not self.const:
            raise _fail(path, f"expected {str(self.const).lower()}, got {str(value).lower()}")


class Null(Schema):
    def check(self, value: Any, path: str) -> None:
        if value is not None:
            raise _fail(path, f"expected null, got {_type_name(value)}")


class Nullable(Schema):
    def __init__(self, inner: Schema):
        self.inner = inner

    def check(self, value: Any, path: str) -> None:
        if value is not None:
            self.inner.check(value, path)


class AnyJson(Schema):
    def check(self, value: Any, path: str) -> None:
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise _fail(path, f"expected JSON data, got {_type_name(value)} ({exc})") from None


class ListOf(Schema):
    def __init__(self, item: Schema, min_len: int = 0, max_len: int | None = None):
        self.item, self.min_len, self.max_len = item, min_len, max_len

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, list):
            raise _fail(path, f"expected list, got {_type_name(value)}")
        if len(value) < self.min_len:
            raise _fail(path, f"expected at least {self.min_len} items, got {len(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            raise _fail(path, f"expected at most {self.max_len} items, got {len(value)}")
        for i, item in enumerate(value):
            self.item.check(item, f"{path}[{i}]")


class MapOf(Schema):
    """An object with free keys and uniform values."""

    def __init__(self, value: Schema):
        self.value = value

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise _fail(path, f"expected object, got {_type_name(value)}")
        for k, v in value.items():
            self.value.check(v, _join(path, k))


class Obj(Schema):
    """An object with a closed key set: unknown keys and missing required keys are errors."""

    def __init__(
        self,
        required: Mapping[str, Schema],
        optional: Mapping[str, Schema] | None = None,
        rule: Any = None,
    ):
        self.required = dict(required)
        self.optional = dict(optional or {})
        self.rule = rule  # extra cross-field check: rule(value, path) raises PlanError

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise _fail(path, f"expected object, got {_type_name(value)}")
        for key in value:
            if key not in self.required and key not in self.optional:
                raise _fail(_join(path, key), "unknown key")
        for key in self.required:
            if key not in value:
                raise _fail(_join(path, key), "missing required key")
        for key, v in value.items():
            (self.required.get(key) or self.optional[key]).check(v, _join(path, key))
        if self.rule is not None:
            self.rule(value, path)


def _needs_bound(value: dict, path: str) -> None:
    if not any(k in value for k in ("min", "max", "one_of", "min_exclusive")):
        raise _fail(path, "expected at least one of min, max, one_of, min_exclusive")
    if "min" in value and "max" in value and value["min"] > value["max"]:
        raise _fail(_join(path, "max"), f"max {value['max']!r} is below min {value['min']!r}")


# ----------------------------------------------------------------------------- schemas

_FEATURES = Obj({k: Bool() for k in (
    "custom_loss", "custom_optimizer", "paired_comparison", "paired_training_arms",
    "checkpoint_restore", "warmup_adaptation", "generated_training_data", "learned_generator",
    "heldout_loss", "adaptive_selection",
)})
_TOL = Obj({"atol": Num(lo=0), "rtol": Num(lo=0)}, {"min_cosine": Num(-1, 1)})
_OPT_CONFIG = Obj(
    {"learning_rate": Num(lo=0), "beta1": Num(0, 1), "beta2": Num(0, 1), "eps": Num(lo=0)},
    {"weight_decay": Num(lo=0), "grad_clip_norm": Num(lo=0)},
)
_GATE_CHECK = Obj(
    {"metric": Str(), "measures": Str()},
    {"min": Num(), "max": Num(), "one_of": ListOf(Str(), min_len=1)},
    rule=_needs_bound,
)
_DEVIATION = Obj({"field": Str(choices=DEVIATION_FIELDS), "original": Str(), "effective": Str(), "reason": Str()})

EXPERIMENT_SPEC_SCHEMA = Obj({
    "title": Str(), "hypothesis": Str(), "method": Str(), "base_model": Str(),
    "lora_rank": Int(lo=1), "training_type": Str(),
    "dataset": Obj({"name": Str(), "hf_path": Str(), "split": Str(), "n_examples": Int(lo=1)}),
    "optimizer": Obj({"name": Str(), "lr": Num(lo=0)}),
    "steps": Int(lo=1), "batch_size": Int(lo=1), "max_seq_len": Int(lo=1),
    "eval": Obj({"benchmark": Str(), "metric": Str(), "n_examples": Int(lo=1), "aggregation": Nullable(Str())}),
    "baseline": Str(),
    "experiment_features": _FEATURES,
    "correctness_preflight": Obj({
        "required": Bool(), "status": Str(),
        "paths": ListOf(Obj({
            "id": Str(), "kind": Str(), "baseline_revision": Str(), "reference_revision": Str(),
            "tolerances": MapOf(_TOL),
        })),
    }),
    "activation_gate": Obj({"applicable": Bool(), "reason": Str(), "checks": ListOf(_GATE_CHECK)}),
    "restoration_preflight": Obj({
        "applicable": Bool(), "reason": Str(), "fixed_batch_required": Bool(),
        "groups": ListOf(Obj({"arms": ListOf(Obj({
            "name": Str(), "optimizer": Str(), "optimizer_config": _OPT_CONFIG,
        }), min_len=1)})),
    }),
    "success_criterion": Str(),
    "decision_rule": Obj({
        "version": Int(), "estimand": Str(), "unit": Str(), "seeds": ListOf(Int()),
        "alpha": Num(0, 1), "method": Str(),
        "criteria": ListOf(Obj({
            "id": Str(), "metric": Str(), "weights": MapOf(Num()), "margin": Num(),
            "bounds": ListOf(Num(), min_len=2, max_len=2),
        }), min_len=1),
    }),
    "primary_endpoint": Str(),
    "arms": ListOf(Obj({
        "name": Str(), "loss": Str(), "seed": Int(), "lr": Num(lo=0), "updates_per_batch": Int(lo=1),
    }), min_len=1),
    "feasibility_required": Bool(),
    "feasibility": Nullable(AnyJson()),
    "budget": Obj({"gpu_hours": Num(lo=0), "max_wall_minutes": Num(lo=0)}),
    "generation_audit": Obj({
        "required": Bool(), "answer_comparison": Str(), "min_sample_size": Int(lo=0),
        "max_label_errors": Int(lo=0), "max_eval_overlaps": Int(lo=0),
    }),
    "command": Str(),
    "feasibility_check": Obj({
        "status": Str(), "problems": ListOf(Str()), "wall_seconds": Nullable(Num()),
        "gpu_hours": Nullable(Num()), "known_gpu_hours": Num(), "phases": MapOf(AnyJson()),
    }),
})


def _schedule_rule(value: dict, path: str) -> None:
    if value["minibatches_per_epoch"] * value["groups_per_minibatch"] != value["groups_per_batch"]:
        raise _fail(_join(path, "groups_per_minibatch"),
                    "minibatches_per_epoch x groups_per_minibatch must equal groups_per_batch")
    if value["max_optimizer_updates"] > value["epochs"] * value["minibatches_per_epoch"]:
        raise _fail(_join(path, "max_optimizer_updates"), "exceeds epochs x minibatches_per_epoch")


def _diagnostic_rule(value: dict, path: str) -> None:
    if value["original_hypothesis_tested"] is False and not value["tested_instead"].strip():
        raise _fail("tested_instead", "must describe the claim tested when original_hypothesis_tested is false")
    updates = value["recording"]["sentinels"]["after_updates"]
    cap = value["schedule"]["max_optimizer_updates"]
    if any(u > cap for u in updates):
        raise _fail("recording.sentinels.after_updates", f"an update index exceeds max_optimizer_updates {cap}")


DIAGNOSTIC_SCHEMA = Obj({
    "kind": Str(choices=("bounded_diagnostic",)),
    "version": Int(lo=1, hi=1),
    "plan_id": Str(),
    "title": Str(),
    "original_plan": Obj({
        "file": Str(), "sha256": Str(pattern=_SHA256_RE.pattern), "experiment_version": Str(),
        "kept_intact": Bool(const=True),
    }),
    "authorization": Obj({"source": Str(), "launch_mode": Str(), "scope": Str(), "only_authorized_run": Bool()}),
    "question": Str(),
    "original_hypothesis_tested": Bool(),
    "tested_instead": Str(),
    "experiment_features": _FEATURES,
    "fixed_settings": Obj({
        "base_model": Str(), "lora_rank": Int(lo=1), "seed": Int(),
        "initialization": Obj({
            "source": Str(), "require_observed_successful_load": Bool(), "trained_pilot_weights_allowed": Bool(),
        }),
        "treatment": Obj({
            "arm": Str(), "loss": Str(choices=("dppo_binary_tv",)), "delta": Num(lo=0), "ratio_cap": Num(lo=0),
            "variant": Str(), "variant_note": Str(), "anchor": Str(choices=("sampler_logprobs",)),
            "divergence": Str(), "reference_revision": Str(),
        }),
        "counterfactual_baseline": Obj({"loss": Str(), "ppo_eps": Num(lo=0), "trained": Bool(), "note": Str()}),
        "optimizer": Obj({
            "name": Str(choices=("adamw",)), "learning_rate": Num(lo=0), "beta1": Num(0, 1), "beta2": Num(0, 1),
            "eps": Num(lo=0), "weight_decay": Num(lo=0), "grad_clip_norm": Num(lo=0),
        }),
        "sampling": Obj({
            "renderer": Str(), "dataset": Str(), "split": Str(choices=("train",)),
            "temperature": Num(lo=0), "max_tokens": Int(lo=1),
        }),
        "advantages": Str(choices=("group_mean_centered",)),
        "loss_normalization": Obj({"mode": Str(choices=("sum", "token_mean")), "denominator": Str(), "reason": Str()}),
    }),
    "schedule": Obj({
        "sampling_batches": Int(lo=1, hi=1), "groups_per_batch": Int(lo=1), "group_size": Int(lo=1),
        "minibatches_per_epoch": Int(lo=1), "groups_per_minibatch": Int(lo=1), "complete_groups_only": Bool(),
        "epochs": Int(lo=1), "max_optimizer_updates": Int(lo=1), "new_sampling_after_batch": Bool(const=False),
        "old_logprob_refresh": Bool(const=False), "frozen_fields": ListOf(Str(), min_len=1),
        "assert_hashes_before_every_reuse": Bool(), "record_sampler_checkpoint": Bool(),
    }, rule=_schedule_rule),
    "caps": Obj({
        "max_wall_minutes": Num(lo=0), "wall_clock_includes": ListOf(Str()), "gpu_hours_cap": Num(lo=0),
        "gpu_hours_cap_source": Str(), "stop_rule": Str(), "on_setup_exhausting_cap": Str(),
        "check_remaining_budget_before_service_work": Bool(),
    }),
    "recording": Obj({
        "before_each_loss_and_update": ListOf(Str(), min_len=1),
        "sentinels": Obj({"source": Str(), "compare": Str(), "after_updates": ListOf(Int(lo=0), min_len=1),
                          "purpose": Str()}),
    }),
    "analysis": Obj({
        "scope": Str(), "pooling": Str(), "selection_rule": Str(),
        "criteria": ListOf(Obj(
            {"id": Str(), "metric": Str(), "measures": Str(),
             "pooling": Str(choices=("token_weighted_ratio", "pooled_quantile", "token_count_sum"))},
            {"min": Num(), "max": Num(), "min_exclusive": Num(), "applies_when": Str()},
            rule=_needs_bound,
        ), min_len=1),
        "engagement_exclusions": ListOf(Str()),
        "original_gate_report": Str(),
    }),
    "forbidden": ListOf(Str(), min_len=1),
    "outcomes": Obj({"inactive": Str(), "active": Str(), "verdict": Str()}),
    "unavailable_references": ListOf(Obj({"ref": Str(), "reason": Str()})),
    "deviations": ListOf(_DEVIATION),
}, rule=_diagnostic_rule)

SCHEMAS: dict[str, Obj] = {"experiment_spec": EXPERIMENT_SPEC_SCHEMA, "bounded_diagnostic": DIAGNOSTIC_SCHEMA}


# ----------------------------------------------------------------------------- Plan


@dataclass(frozen=True)
class Plan:
    raw: dict[str, Any]
    sha256: str  # of the exact file bytes
    kind: PlanKind
    path: Path | None = None
    data: bytes = field(default=b"", repr=False)

    @property
    def name(self) -> str:
        return self.path.name if self.path else f"plan-{self.sha256[:12]}.json"

    @property
    def spec(self) -> dict[str, Any]:
        """The experiment spec this plan runs: itself, or a rehearsal's inner spec."""
        if self.kind == "rehearsal":
            return self.raw["spec"]
        if self.kind != "experiment_spec":
            raise PlanError(f"kind: a {self.kind} plan has no experiment spec")
        return self.raw

    @property
    def base_model(self) -> str:
        if self.kind in ("experiment_spec", "rehearsal"):
            return self.spec["base_model"]
        return self.raw["fixed_settings"]["base_model"]

    @property
    def experiment_features(self) -> dict[str, bool]:
        return dict((self.spec if self.kind == "rehearsal" else self.raw)["experiment_features"])

    @property
    def budget(self) -> dict[str, float]:
        """{'gpu_hours', 'max_wall_minutes'} that this plan allows."""
        if self.kind in ("experiment_spec", "rehearsal"):
            return {"gpu_hours": float(self.spec["budget"]["gpu_hours"]),
                    "max_wall_minutes": float(self.spec["budget"]["max_wall_minutes"])}
        caps = self.raw["caps"]
        return {"gpu_hours": float(caps["gpu_hours_cap"]), "max_wall_minutes": float(caps["max_wall_minutes"])}

    @property
    def deviations(self) -> list[dict[str, str]]:
        if self.kind == "rehearsal":
            return rehearsal_deviations(self.raw)
        return [dict(d) for d in self.raw.get("deviations", [])]


def detect_kind(raw: Any) -> PlanKind:
    if not isinstance(raw, dict):
        raise _fail("", f"expected object, got {_type_name(raw)}")
    if "kind" in raw:
        kind = raw["kind"]
        if kind not in SCHEMAS or kind == "experiment_spec":
            raise _fail("kind", f"expected one of ['bounded_diagnostic', 'rehearsal'] (a saved experiment spec has no kind), got {kind!r}")
        return kind
    return "experiment_spec"


def validate_plan(raw: Any) -> PlanKind:
    """Validate a decoded plan against its kind's schema; returns the kind or raises PlanError."""
    kind = detect_kind(raw)
    SCHEMAS[kind].check(raw, "")
    return kind


def parse_plan(data: bytes, path: Path | None = None) -> Plan:
    where = f"{path}: " if path else ""
    try:
        raw = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise PlanError(f"{where}<root>: not UTF-8 ({exc})") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{where}<root>: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:
        raise PlanError(f"{where}<root>: {exc}") from None
    try:
        kind = validate_plan(raw)
        if kind == "rehearsal":
            check_rehearsal(raw, path)
    except PlanError as exc:
        raise PlanError(f"{where}{exc}") from None
    return Plan(raw=raw, sha256=hashlib.sha256(data).hexdigest(), kind=kind, path=path, data=data)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed")


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read plan file ({exc.strerror})") from None
    return parse_plan(data, path)


def check_original_plan(diagnostic: Plan, plans_dir: Path | None = None) -> Plan:
    """Load the original plan a diagnostic names, and require its sha256 to match the recorded one."""
    if diagnostic.kind != "bounded_diagnostic":
        raise PlanError("kind: check_original_plan needs a bounded_diagnostic plan")
    ref = diagnostic.raw["original_plan"]
    base = plans_dir or (diagnostic.path.parent if diagnostic.path else Path("plans"))
    original = load_plan(base / ref["file"])
    if original.sha256 != ref["sha256"]:
        raise PlanError(
            f"original_plan.sha256: recorded {ref['sha256']} but {ref['file']} hashes to {original.sha256}"
        )
    return original


# ----------------------------------------------------------------------------- backend + effective config


@dataclass(frozen=True)
class BackendInfo:
    """What actually serves the run. `served_model` is the model that really computes."""

    backend: Literal["local", "tinker"]
    requested_model: str
    served_model: str
    base_url: str | None = None
    sdk_versions: Mapping[str, str] = field(default_factory=dict)
    # Explicit size reductions of the run, each {field, original, effective, reason}.
    size_reductions: Sequence[Mapping[str, str]] = ()

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "BackendInfo":
        return cls(
            backend=m["backend"], requested_model=m["requested_model"], served_model=m["served_model"],
            base_url=m.get("base_url"), sdk_versions=dict(m.get("sdk_versions", {})),
            size_reductions=tuple(m.get("size_reductions", ())),
        )


def backend_deviations(plan: Plan, backend_info: BackendInfo | Mapping[str, Any]) -> list[dict[str, str]]:
    """Deviations that come from where the plan runs, not from the plan itself."""
    info = backend_info if isinstance(backend_info, BackendInfo) else BackendInfo.from_mapping(backend_info)
    out: list[dict[str, str]] = []
    if info.backend == "local":
        out.append({
            "field": "model",
            "original": plan.base_model,
            "effective": f"{info.served_model} (embedded local CPU server on loopback, answering to the name {info.requested_model})",
            "reason": "no Tinker/Spindle service is reachable from this machine; this run is a local rehearsal of the harness, not a measurement of the planned model",
        })
    elif info.served_model != plan.base_model:
        out.append({
            "field": "model", "original": plan.base_model, "effective": info.served_model,
            "reason": "the service reported a different model at client creation",
        })
    for red in info.size_reductions:
        d = {k: str(red[k]) for k in ("field", "original", "effective", "reason")}
        if d["field"] not in DEVIATION_FIELDS:
            raise PlanError(f"size_reductions.field: expected one of {list(DEVIATION_FIELDS)}, got {d['field']!r}")
        out.append(d)
    return out


def generation_audit_applicability(plan: Plan) -> dict[str, Any]:
    """Resolve whether the generation audit applies, from the plan's experiment_features.

    generated_training_data=true requires it (overriding a legacy required=false); false makes it
    not applicable unless an explicit contract (generation_audit.required=true) asks for it.
    """
    raw = plan.spec if plan.kind == "rehearsal" else plan.raw
    features = raw.get("experiment_features", {})
    explicit = raw.get("generation_audit", {}).get("required") if plan.kind in ("experiment_spec", "rehearsal") else None
    gen = features.get("generated_training_data")
    if gen is True:
        return {"applicable": True, "status": "required",
                "reason": "experiment_features.generated_training_data is true"}
    if explicit is True:
        return {"applicable": True, "status": "required", "reason": "generation_audit.required is true"}
    if gen is False:
        return {"applicable": False, "status": "not_applicable",
                "reason": "experiment_features.generated_training_data is false: no generated training data is used "
                          "(GSM8K train items only), and no explicit contract requires the audit"}
    return {"applicable": None, "status": "unknown",
            "reason": "experiment_features.generated_training_data is missing: applicability cannot be established"}


def effective_config(plan: Plan, backend_info: BackendInfo | Mapping[str, Any]) -> dict[str, Any]:
    """The configuration that will actually run, in the brief's feasibility.effective_config terms."""
    info = backend_info if isinstance(backend_info, BackendInfo) else BackendInfo.from_mapping(backend_info)
    raw = plan.spec if plan.kind == "rehearsal" else plan.raw
    if plan.kind in ("experiment_spec", "rehearsal"):
        body: dict[str, Any] = {
            "base_model": raw["base_model"],
            "lora_rank": raw["lora_rank"],
            "arms": [dict(a) for a in raw["arms"]],
            "steps": raw["steps"],
            "batch_size": raw["batch_size"],
            "max_seq_len": raw["max_seq_len"],
            "n_eval": raw["eval"]["n_examples"],
            "optimizer": dict(raw["optimizer"]),
            "seed": raw["arms"][0]["seed"],
        }
    else:
        fs, sch = raw["fixed_settings"], raw["schedule"]
        body = {
            "base_model": fs["base_model"],
            "lora_rank": fs["lora_rank"],
            "arms": [{"name": fs["treatment"]["arm"], "loss": fs["treatment"]["loss"], "trained": True},
                     {"name": "ppo_counterfactual", "loss": fs["counterfactual_baseline"]["loss"], "trained": False}],
            "steps": sch["max_optimizer_updates"],
            "batch_size": sch["groups_per_batch"] * sch["group_size"],
            "sequences_per_update": sch["groups_per_minibatch"] * sch["group_size"],
            "max_tokens": fs["sampling"]["max_tokens"],
            "n_eval": 0,
            "seed": fs["seed"],
            "optimizer": dict(fs["optimizer"]),
            "treatment": dict(fs["treatment"]),
            "counterfactual_baseline": dict(fs["counterfactual_baseline"]),
            "sampling": dict(fs["sampling"]),
            "loss_normalization": dict(fs["loss_normalization"]),
            "schedule": dict(sch),
            "caps": dict(raw["caps"]),
            "analysis_criteria": [dict(c) for c in raw["analysis"]["criteria"]],
        }
    return {
        "plan": {"name": plan.name, "kind": plan.kind, "sha256": plan.sha256},
        "backend": {
            "backend": info.backend,
            "requested_model": info.requested_model,
            "served_model": info.served_model,
            "sdk_versions": dict(info.sdk_versions),
        },
        "pinned": {
            "ppo_eps": constants.PPO_EPS, "dppo_delta": constants.DPPO_DELTA,
            "dppo_ratio_cap": constants.DPPO_RATIO_CAP, "renderer": constants.RENDERER_NAME,
            "reference_revision": constants.REFERENCE_REVISION, "baseline_revision": constants.BASELINE_REVISION,
        },
        "budget": plan.budget,
        "generation_audit": generation_audit_applicability(plan),
        "config": body,
        "deviations": plan.deviations + backend_deviations(plan, info),
    }


# ----------------------------------------------------------------------------- rehearsal plans (issue 9)
# A declared, offline-only derivative of an experiment spec (CONTRACTS.md "Rehearsal plans"): the
# inner `spec` runs like an experiment spec; every leaf that differs from the derived-from spec is
# listed with a reason, and the gates, thresholds and decision rule may not differ.

_DIFFERENCE = Obj({"field": Str(), "spec": AnyJson(), "rehearsal": AnyJson(), "reason": Str(pattern=r"(?s)\s*\S.*")})
REHEARSAL_SCHEMA = Obj({
    "kind": Str(choices=["rehearsal"]), "version": Int(lo=1, hi=1), "plan_id": Str(), "label": Str(choices=["rehearsal"]),
    "purpose": Str(), "derived_from": Obj({"path": Str(), "sha256": Str(pattern=r"^[0-9a-f]{64}$")}),
    "differences": ListOf(_DIFFERENCE), "spec": AnyJson(),
})
SCHEMAS["rehearsal"] = REHEARSAL_SCHEMA
# Subtrees that must stay as written (dotted prefixes); the listed exceptions follow other fields.
_FROZEN_PREFIXES = ("activation_gate", "decision_rule", "success_criterion", "correctness_preflight",
                    "restoration_preflight")
_FROZEN_ARM_KEYS = ("loss", "updates_per_batch")
# Spec field -> the brief's deviation field.
_DEVIATION_OF = {"base_model": "model", "activation_gate": "model", "steps": "steps", "batch_size": "effective_batch",
                 "method": "effective_batch", "eval": "evaluator", "optimizer": "objective", "arms": "objective",
                 "restoration_preflight": "objective", "dataset": "dataset"}


def leaf_differences(a: Any, b: Any, path: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted path -> (a value, b value) of every leaf where `a` and `b` differ (lists by index)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: dict[str, tuple[Any, Any]] = {}
        for k in sorted(set(a) | set(b)):
            out.update(leaf_differences(a.get(k), b.get(k), f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = {}
        for i, (x, y) in enumerate(zip(a, b)):
            out.update(leaf_differences(x, y, f"{path}[{i}]"))
        return out
    return {} if a == b and type(a) is type(b) else {path: (a, b)}


def _frozen_violation(field_path: str, spec: Mapping[str, Any]) -> bool:
    if field_path.startswith("activation_gate"):
        m = re.fullmatch(r"activation_gate\.checks\[(\d+)\]\.one_of(\[\d+\])?", field_path)
        checks = spec["activation_gate"]["checks"]
        return not (m and int(m.group(1)) < len(checks) and checks[int(m.group(1))]["metric"] == "executed_base_model")
    if field_path.startswith("restoration_preflight"):
        return not re.fullmatch(r"restoration_preflight\.groups\[\d+\]\.arms\[\d+\]\.optimizer_config\.learning_rate",
                                field_path)
    if re.fullmatch(r"arms\[\d+\]\.(" + "|".join(_FROZEN_ARM_KEYS) + ")", field_path):
        return True
    return field_path.split(".")[0].split("[")[0] in _FROZEN_PREFIXES


def check_rehearsal(raw: Mapping[str, Any], path: Path | None) -> None:
    """The contract's rules: valid inner spec, declared = actual differences, frozen subtrees."""
    try:
        EXPERIMENT_SPEC_SCHEMA.check(raw["spec"], "spec")
    except PlanError:
        raise
    root = _repo_root(path)
    src = root / raw["derived_from"]["path"]
    try:
        data = src.read_bytes()
    except OSError as exc:
        raise _fail("derived_from.path", f"cannot read {src} ({exc.strerror})") from None
    if hashlib.sha256(data).hexdigest() != raw["derived_from"]["sha256"]:
        raise _fail("derived_from.sha256", f"{raw['derived_from']['path']} hashes to {hashlib.sha256(data).hexdigest()}")
    actual = leaf_differences(json.loads(data), raw["spec"])
    declared = {d["field"]: d for d in raw["differences"]}
    if len(declared) != len(raw["differences"]):
        raise _fail("differences", "a field is listed twice")
    for f, (orig, new) in actual.items():
        if f not in declared:
            raise _fail(f"spec.{f}", f"differs from {raw['derived_from']['path']} ({orig!r} -> {new!r}) but is not declared")
        if declared[f]["spec"] != orig or declared[f]["rehearsal"] != new:
            raise _fail(f"differences[{f}]", "declared spec/rehearsal values do not match the files")
        if _frozen_violation(f, raw["spec"]):
            raise _fail(f"spec.{f}", "may not differ in a rehearsal (gates, thresholds and the decision rule stay as written)")
    for f in declared:
        if f not in actual:
            raise _fail(f"differences[{f}]", "listed but does not differ (phantom difference)")
    spec_lr = raw["spec"]["optimizer"]["lr"]
    for g in raw["spec"]["restoration_preflight"]["groups"]:
        for a in g["arms"]:
            if a["optimizer_config"]["learning_rate"] != spec_lr:
                raise _fail("spec.restoration_preflight", "optimizer_config.learning_rate must follow optimizer.lr")


def _repo_root(path: Path | None) -> Path:
    """The repository root above a plan file (the folder holding plans/), else the working dir."""
    if path is not None:
        for parent in Path(path).resolve().parents:
            if (parent / "plans").is_dir() and (parent / "pyproject.toml").exists():
                return parent
    return Path.cwd()


def rehearsal_deviations(raw: Mapping[str, Any]) -> list[dict[str, str]]:
    """Each declared difference as a deviation record (field mapped to the brief's names)."""
    out = []
    for d in raw["differences"]:
        top = d["field"].split(".")[0].split("[")[0]
        out.append({"field": _DEVIATION_OF.get(top, "objective"), "original": f"{d['field']}={json.dumps(d['spec'])}",
                    "effective": f"{d['field']}={json.dumps(d['rehearsal'])}", "reason": d["reason"]})
    return out

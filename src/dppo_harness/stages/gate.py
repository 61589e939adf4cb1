"""Activation gate of the plan's spec: its one treatment arm piloted at the spec's schedule for the
pilot length the gate states, as the comparison's arm-step (`arm_step.run_arm_step`). Each gate
metric is the loss-call statistic its registered loss names (`loss_registry.GateMetric`, which
also defines it for the report) on the last update of each pilot step; every check of the plan is
evaluated (`checks.Bounds`), and a value outside its range or missing fails the gate. Each step's
loss records are journaled as it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import tinker

from dppo_harness.data import dataset, tokenizer
from dppo_harness.evaluation import answer_yield
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.loss import loss_registry, losses
from dppo_harness.loss.terms import LossStats
from dppo_harness.stages.arm_step import ArmStepProgress, make_loss, rollout_config, run_arm_step
from dppo_harness.stages.checks import Bounds, BoundsJson, Measured
from dppo_harness.train.restore import restore

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ArmConfig, Plan, RunConfig
    from dppo_harness.plans.models import GateCheck

# One pilot step's row in the report: step, optimizer steps, whether its last update was recorded,
# that update's loss-call statistics and the step's rollout yield.
PilotStepRow = dict[str, float | int | bool]


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    return f"{n}{'th' if n % 100 in (11, 12, 13) else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class GateError(RuntimeError):
    """The pilot cannot be configured from the plan (the message names the field)."""


@dataclass(frozen=True)
class CheckResult:
    metric: str
    value: Measured
    passed: bool
    reason: str
    bounds: BoundsJson
    measures: str = ""


def evaluate_check(check: GateCheck, value: Measured) -> CheckResult:
    """One plan check against one measured value. Missing or non-numeric values fail."""
    bounds = Bounds.of(check)
    reason = "missing: not measured" if value is None else "; ".join(bounds.problems(value))
    reason = reason if bounds.declared else "check declares no min, max or one_of"
    passed = bounds.declared and value is not None and not reason
    return CheckResult(check.metric, value, passed, reason or "in range", bounds.as_json(), check.measures)


def evaluate_gate(checks: Sequence[GateCheck], values: Mapping[str, Measured]) -> list[CheckResult]:
    """Every plan check, in plan order; a metric with no measurement fails as missing."""
    return [evaluate_check(c, values.get(c.metric)) for c in checks]


def definition(metric: str, *, updates_per_batch: int, **thresholds: object) -> str:
    """How a gate metric is measured in the pilot (written into the report), in the pilot's own
    numbers: its updates per batch and the thresholds of its loss call (`LossConfig`'s names)."""
    source = loss_registry.gate_metric_sources().get(metric)
    if source is None:
        return loss_registry.HARNESS_GATE_METRICS.get(metric, "not measured by the pilot")
    return source.definition.format(stat=source.stat, last=ordinal(updates_per_batch), **thresholds)


def gate_values(
    records: Sequence[ins.LossCallRecord],
    optim_steps_per_batch: Sequence[int],
    executed_base_model: str | None,
    pilot_steps: int,
    *,
    updates_per_batch: int = 2,
    yields: Sequence[answer_yield.ResponseYield] = (),
) -> tuple[dict[str, Measured], list[PilotStepRow]]:
    """Gate metric values from the pilot's loss-call records, plus one row per pilot step (with the
    rollout yield of each step that sampled: `yields`, in step order). Every registered loss's gate
    metrics are measured on each step's last update; a step whose last update never ran makes the
    metric missing (None), not a mean over fewer steps."""
    sources = loss_registry.gate_metric_sources()
    second = {r.context["step"]: r for r in records if r.context.get("update_in_batch") == updates_per_batch}
    rows: list[PilotStepRow] = []
    for step in range(pilot_steps):
        rec = second.get(step)
        rows.append(
            {
                "step": step,
                "optim_steps": optim_steps_per_batch[step] if step < len(optim_steps_per_batch) else 0,
                "second_update_recorded": rec is not None,
                **({k: rec.stats[k] for k in LossStats.scalar_names()} if rec else {}),
            }
        )
        if step < len(yields):  # truncation at max_tokens, answers missing, mean response length
            y = yields[step]
            rows[-1].update(truncated_frac=y.truncated_frac, no_answer_frac=y.no_answer_frac)
            rows[-1].update(mean_response_tokens=y.mean_response_tokens, responses=y.n)
    complete = len(second) == pilot_steps

    def over_steps(key: str) -> float | None:  # None unless every step's last update ran
        return sum(r.stats[key] for r in second.values()) / pilot_steps if complete and pilot_steps else None

    counts = list(optim_steps_per_batch)
    same = len(counts) == pilot_steps and len(set(counts)) == 1
    updates: int | list[int] | None = counts[0] if same else (counts or None)
    values: dict[str, Measured] = {metric: over_steps(source.stat) for metric, source in sources.items()}
    values.update(executed_updates_per_batch=updates, executed_base_model=executed_base_model)
    return values, rows


def pilot_arm(plan_name: str, run: RunConfig) -> ArmConfig:
    """The treatment arm the gate pilots: the plan's one treatment (no plan has more, and a gate
    that decides for several treatments is not built)."""
    if len(run.treatments) != 1:
        names = ", ".join(a.name for a in run.treatments)
        raise GateError(
            f"plan {plan_name}: the activation gate pilots one treatment arm; this plan has {len(run.treatments)} ({names})"
        )
    return run.treatments[0]


@dataclass(frozen=True)
class GateReport:
    passed: bool
    checks: list[CheckResult]
    values: dict[str, Any]
    per_step: list[dict[str, Any]]
    pilot: dict[str, Any]
    plan: dict[str, Any]
    wall_seconds: float
    errors: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        return [
            f"{c.metric}: {c.reason} (value {c.value!r}, bounds {c.bounds})" for c in self.checks if not c.passed
        ] + self.errors

    def to_json(self) -> JsonObject:
        p = self.pilot  # the definitions state the thresholds the pilot's loss call counted at
        cfg = losses.LossConfig.for_loss(p["loss"], p["normalization"])
        return ins.nan_free(
            {
                "kind": "activation_gate_report",
                "passed": self.passed,
                "plan": self.plan,
                "pilot": self.pilot,
                "definitions": {
                    c.metric: definition(c.metric, updates_per_batch=p["updates_per_batch"], **vars(cfg))
                    for c in self.checks
                },
                "checks": [asdict(c) for c in self.checks],
                "values": self.values,
                "per_step": self.per_step,
                "errors": self.errors,
                "wall_seconds": self.wall_seconds,
                "note": "written once by the gate stage; later stages never rewrite it",
            }
        )


def run_activation_gate(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    initial_checkpoint: str,
    *,
    backend: str,
    progress: Callable[[str], None] | None = None,
) -> GateReport:
    """Pilot the plan's treatment arm on a client restored from the shared initial checkpoint and
    evaluate every check of the plan's gate. A pilot stopping early is recorded in `errors`, and
    the gate then fails on the missing values."""
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    run = plan.spec_plan.spec_run
    arm = pilot_arm(plan.name, run)
    steps = run.gate_pilot_steps
    rollout_cfg = rollout_config(run, arm.seed)  # every pilot step samples from the arm's seed
    loss = make_loss(arm, run)
    own = loss_registry.get_loss(arm.loss).decisions  # the pilot's log line shows its fraction
    reached: list[ArmStepProgress] = []  # how far each step got: what the pilot measured is kept when it stops early
    base_model, base_model_source, loaded_checkpoint = None, "not measured", None
    errors: list[str] = []
    try:
        restored = restore(service_client, initial_checkpoint, "gate pilot client")
        loaded_checkpoint = restored.loaded_path
        problem = restored.mismatch()
        if problem is not None:  # the pilot must train the shared initial state, shown loaded
            errors.append(f"pilot client: {problem}")
        base_model = restored.info.model_data.model_name  # the model that computes, as the service names it
        base_model_source = "get_info().model_data.model_name"
        if base_model is None:  # model_name is optional in the SDK's ModelData: never the requested name
            errors.append(
                f"executed_base_model unavailable: the service's get_info response names no model "
                f"(read from {base_model_source})"
            )
        renderer = tokenizer.make_renderer().renderer
        train = dataset.get(run.dataset).load_split("train", seed=arm.seed)
        for step in range(steps):  # the comparison's arm-step: sample from the current weights, then the updates
            reached.append(done := ArmStepProgress())
            name, items = f"gate-sampler-s{step}", train.batch(step, rollout_cfg.groups_per_batch)
            sampled_step, _ = run_arm_step(
                restored.client, arm, run, loss, step, items, renderer, seed=arm.seed, sampler_name=name, progress=done
            )
            bundle.journal.append("gate", "record", f"pilot step {step}", step, blob=ins.records_to_npz(done.records))
            last, y = (done.records[-1].stats if done.records else None), sampled_step.batch.response_yield()
            say(
                f"[gate] step {step + 1}/{steps}: {len(done.records)} updates, "
                + (f"{own.verb} frac {last[own.fraction()] if last else float('nan'):.4g}, " if own else "")
                + f"|p-q| q90 {last.drift_abs_p90 if last else float('nan'):.4g}, "
                f"truncated {y.truncated_frac:.2f}, no answer {y.no_answer_frac:.2f}, "
                f"elapsed {time.monotonic() - t0:.0f}s"
            )
    except Exception as exc:  # the pilot stopping early is recorded, and the gate fails on missing values
        errors.append(f"pilot stopped: {type(exc).__name__}: {exc}")
    sampled = [d.sampled for d in reached if d.sampled is not None]
    yields = [s.batch.response_yield() for s in sampled]
    optim_counts = [len(d.records) for d in reached if d.minibatches is not None]
    records = loss[1].records  # every loss call the pilot's recorder saw
    values, per_step = gate_values(
        records, optim_counts, base_model, steps, updates_per_batch=arm.updates_per_batch, yields=yields
    )
    results = evaluate_gate(run.gate_checks, values)
    pilot_block = {  # the schedule run (the plan's), what was loaded and sampled, where the model name came from
        "arm": arm.name,
        "loss": arm.loss,
        "steps": steps,
        **asdict(rollout_cfg),  # groups_per_batch, group_size, temperature, max_tokens, seed, max_seq_len
        "updates_per_batch": arm.updates_per_batch,
        "adam": as_object(arm.adam),
        "normalization": run.normalization,
        "steps_completed": sum(1 for c in optim_counts if c == arm.updates_per_batch),
        "sampler_checkpoints": [s.sampler_path for s in sampled],
        "initial_checkpoint": initial_checkpoint,
        "loaded_checkpoint": loaded_checkpoint,
        "backend": backend,
        "loss_calls": len(records),
        "executed_base_model_source": base_model_source,
        "rollout_yield": answer_yield.pooled(yields).as_dict() if yields else None,
    }
    return GateReport(
        passed=all(r.passed for r in results) and not errors,
        checks=results,
        values=values,
        per_step=per_step,
        pilot=pilot_block,
        plan={"file": plan.name, "sha256": plan.sha256},
        wall_seconds=time.monotonic() - t0,
        errors=errors,
    )

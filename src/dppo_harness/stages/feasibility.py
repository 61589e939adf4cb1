"""Feasibility: the timing pilot on the actual backend, then the projection of the whole plan
(`feasibility_projection`) written to the evidence.

The pilot measures, on the backend that will run the plan:
- setup: create a training client from the initial checkpoint with optimizer state;
- training: sample `pilot_groups` GSM8K train groups at the plan's sampling settings, then per
  arm `pilot_updates` recorded updates on a minibatch of the plan's size, through the arm-step's
  update phase (`arm_step.run_arm_updates`) as the comparison runs them;
- evaluation: greedy samples of a few GSM8K test items, submitted together like the evaluation.

A plan that does not fit fails the stage, which blocks later stages.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import tinker
import torch
from pydantic import JsonValue

from dppo_harness.data import dataset, tokenizer
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonObject
from dppo_harness.loss import losses
from dppo_harness.rollout import rollouts
from dppo_harness.stages.arm_step import ArmStepProgress, ArmStepRun, run_arm_updates
from dppo_harness.stages.feasibility_projection import (
    DEFAULT_RESERVE_FRACTION,
    ArmPilot,
    FeasibilityError,
    PilotSchedule,
    PilotTimings,
    Projection,
    arm_pilots,
    feasibility_block,
    feasibility_check,
    project,
    schedule_from_plan,
    stage_projections,
)

if TYPE_CHECKING:
    from tinker_cookbook import renderers

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import Plan


PILOT_FILE = "feasibility-pilot.json"


@dataclass
class FeasibilityResult:
    schedule: PilotSchedule
    timings: PilotTimings
    projection: Projection
    block: JsonObject
    check: JsonObject
    passed: bool
    failures: list[str]
    pilot_details: JsonObject = field(default_factory=dict)
    # Projected seconds with reserve: "plan" (the whole selected plan) and, for the spec, "gate"
    # (its 5-step pilot); for the budget ledger's per-stage check (evidence.budget_allows).
    stage_seconds: dict[str, float] = field(default_factory=dict)

    embedded_server: bool = False  # the embedded server computed the pilot (the hint below)

    def failure_message(self) -> str:
        msg = "feasibility: the plan does not fit its budget:\n  - " + "\n  - ".join(self.failures)
        if self.embedded_server:
            # The stages run a plan as written; a smaller run is a declared rehearsal plan.
            msg += (
                "\n  the embedded server runs a plan at its own size; rehearse it at a declared size: a "
                "rehearsal plan (kind rehearsal, docs/plans.md) with its resolution file, then --plan PLAN"
            )
        return msg


def _tiled_minibatch(n_datums: int, n: int) -> list[int]:
    """Datum indices of a minibatch of `n` sequences, the sampled ones repeated in order when the
    pilot sampled fewer (real sampled lengths at the plan's minibatch size)."""
    if not n_datums:
        raise FeasibilityError("pilot sampled no datums to build a minibatch from")
    return [i % n_datums for i in range(n)]


@dataclass(frozen=True)
class GreedyEvalTiming:
    """The pilot's greedy evaluation: items scored, greedy tokens, seconds from the first submit to
    the last result."""

    items: int
    greedy_tokens: int
    seconds: float


def _time_greedy_eval(
    client: tinker.TrainingClient, data: ModuleType, renderer: renderers.Renderer, max_tokens: int, eval_n: int
) -> GreedyEvalTiming:
    """Greedy samples of the first `eval_n` test items (none: nothing runs), submitted together
    like the evaluation."""
    if not eval_n:
        return GreedyEvalTiming(0, 0, 0.0)
    test = data.load_split("test").items[:eval_n]
    prompts = [data.build_prompt(it, renderer) for it in test]
    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=tokenizer.stop_list(prompts[0][1]))
    _, sampler = rollouts.save_sampler(client, "feasibility-eval")
    t2 = time.perf_counter()
    futures = [sampler.sample(ob, 1, params) for ob, _ in prompts]
    results = [f.result() for f in futures]
    eval_s = time.perf_counter() - t2
    return GreedyEvalTiming(eval_n, int(sum(len(r.sequences[0].tokens) for r in results)), eval_s)


def run_timing_pilot(
    service_client: tinker.ServiceClient,
    schedule: PilotSchedule,
    initial_checkpoint: str,
    *,
    pilot_groups: int = 2,
    pilot_updates: int = 2,
    pilot_eval_items: int = 4,
    arms: Sequence[ArmPilot],
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> tuple[PilotTimings, JsonObject]:
    """Time setup, sampling + updates, and greedy evaluation on `service_client`'s backend.

    The update minibatch has the plan's `sequences_per_update` sequences, tiled from the pilot's
    sampled sequences (real sampled lengths) when the pilot sampled fewer. Every arm's updates are
    timed with its own loss and optimizer config (`pilot_updates` each), through the arm-step's
    update phase (`arm_step.run_arm_updates`, recorded as the comparison records them), so the mean
    update time the projection uses weighs every arm equally, as the schedule trains them.
    """
    renderer = tokenizer.make_renderer().renderer
    t0 = time.perf_counter()
    say = _pilot_say(progress, t0)
    say("1/4: client from the initial checkpoint")
    client = service_client.create_training_client_from_state_with_optimizer(initial_checkpoint)
    setup_s = time.perf_counter() - t0
    say(f"2/4: sampling {pilot_groups} groups x {schedule.group_size} (max_tokens {schedule.max_tokens})")
    data = dataset.get(schedule.dataset)
    sampled = _sample_pilot_batch(client, data, renderer, schedule, pilot_groups, seed)
    minibatch = _tiled_minibatch(len(sampled.datums), schedule.sequences_per_update)
    ry = sampled.batch.response_yield()
    say(
        f"3/4: {pilot_updates} timed updates of {len(minibatch)} sequences for each of {len(arms)} arm(s) "
        f"({ry.truncated} of {ry.n} sampled responses truncated)"
    )
    by_arm = {arm.name: _time_arm_updates(client, sampled, minibatch, arm, pilot_updates) for arm in arms}
    update_s = [t for times in by_arm.values() for t in times]

    eval_n = pilot_eval_items if schedule.eval_items else 0
    say(f"4/4: greedy evaluation of {eval_n} test items" if eval_n else "4/4: no evaluation in this plan")
    evaluation = _time_greedy_eval(client, data, renderer, schedule.max_tokens, eval_n)

    timings = PilotTimings(
        setup_seconds=setup_s,
        sampling_seconds=sampled.seconds,  # includes saving sampler weights, as every real step does
        sampled_groups=pilot_groups,
        sampled_sequences=pilot_groups * schedule.group_size,
        update_seconds=tuple(update_s),
        sequences_per_update=len(minibatch),
        eval_seconds=evaluation.seconds,
        eval_items=evaluation.items,
    )
    minibatch_datums = [sampled.datums[i] for i in minibatch]
    details = _pilot_details(sampled, minibatch_datums, arms, by_arm, update_s, evaluation)
    return timings, details


def _pilot_say(progress: Callable[[str], None] | None, t0: float) -> Callable[[str], None]:
    """The pilot's progress line for one phase, with the seconds since `t0` (silent without `progress`)."""

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"[preflight] feasibility pilot {msg} ({time.perf_counter() - t0:.0f}s)")

    return say


def _sample_pilot_batch(
    client: tinker.TrainingClient,
    data: ModuleType,
    renderer: renderers.Renderer,
    schedule: PilotSchedule,
    pilot_groups: int,
    seed: int,
) -> rollouts.SampledStep:
    """The first `pilot_groups` train groups sampled at the plan's settings, as a real step samples."""
    items = data.load_split("train", seed=seed).items[:pilot_groups]
    cfg = rollouts.RolloutConfig(
        groups_per_batch=pilot_groups,
        group_size=schedule.group_size,
        temperature=schedule.temperature,
        max_tokens=schedule.max_tokens,
        seed=seed,
    )
    return rollouts.sample_rollout_batch(client, items, renderer, cfg, sampler_name="feasibility-pilot")


def _time_arm_updates(
    client: tinker.TrainingClient,
    sampled: rollouts.SampledStep,
    minibatch: list[int],
    arm: ArmPilot,
    pilot_updates: int,
) -> list[float]:
    """Seconds of each of `pilot_updates` updates of `arm` on the same minibatch, through the
    arm-step's update phase with the arm's own loss (token_mean), recorder and optimizer."""
    loss_cfg = losses.LossConfig.for_loss(arm.loss, "token_mean")
    adam = tinker.AdamParams(**{k: float(v) for k, v in arm.optimizer.items() if k in tinker.AdamParams.model_fields})
    run = ArmStepRun(client, losses.make_loss_fn(loss_cfg), adam, ins.LossCallRecorder(loss_cfg), pilot_updates)

    def context(u: int, sampler_path: str, idx: list[int]) -> dict[str, int | str]:
        return {"arm": arm.name, "update_in_batch": u, "sampler_checkpoint": sampler_path, "n_sequences": len(idx)}

    minibatches = [minibatch] * pilot_updates
    done = ArmStepProgress(sampled=sampled, minibatches=minibatches)
    run_arm_updates(run, sampled, minibatches, context=context, progress=done)
    return list(done.update_seconds)


def _pilot_details(
    sampled: rollouts.SampledStep,
    minibatch: Sequence[tinker.Datum],
    arms: Sequence[ArmPilot],
    by_arm: Mapping[str, list[float]],
    update_seconds: Sequence[float],
    evaluation: GreedyEvalTiming,
) -> JsonObject:
    """What the pilot sampled, trained on and timed (the pilot file's `pilot` entry)."""
    lengths = [len(d.model_input.to_ints()) + 1 for d in minibatch]
    return {
        "setup": "create_training_client_from_state_with_optimizer(initial checkpoint)",
        "sampling": sampled.batch.summary(),
        "minibatch": {
            "sequences": len(minibatch),
            "distinct_sampled_sequences": len(sampled.datums),
            "mean_tokens": float(np.mean(lengths)),
            "max_tokens": int(max(lengths)),
            "loss": "each arm's own registered loss, token_mean, via forward_backward_custom",
        },
        "update_seconds": list(update_seconds),
        "updates_by_arm": {
            a.name: {"loss": a.loss, "optimizer": dict(a.optimizer), "seconds": list(by_arm[a.name])} for a in arms
        },
        "evaluation": {
            "items": evaluation.items,
            "greedy_tokens": evaluation.greedy_tokens,
            "seconds": evaluation.seconds,
            "submitted_together": True,
        },
    }


def run_feasibility(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    *,
    initial_checkpoint: str,
    backend_kind: str,
    effective_config: Mapping[str, JsonValue] | None = None,
    pilot_groups: int = 2,
    pilot_updates: int = 2,
    pilot_eval_items: int = 4,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    elapsed_seconds: float = 0.0,
    timings: PilotTimings | None = None,
    measured_setup: Mapping[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
    embedded_server: bool = False,
) -> FeasibilityResult:
    """Pilot (unless `timings` is given), project `plan` at its own schedule (a smaller run is a
    smaller plan), write `feasibility` to the bundle. `measured_setup` adds other measured setup
    phases of this run ({"restoration_preflight": seconds, ...}) to the pilot's setup time.
    """
    schedule = schedule_from_plan(plan)
    details: JsonObject = {}
    t0 = time.perf_counter()
    if timings is None:
        timings, details = run_timing_pilot(
            service_client,
            schedule,
            initial_checkpoint,
            pilot_groups=pilot_groups,
            pilot_updates=pilot_updates,
            pilot_eval_items=pilot_eval_items,
            arms=arm_pilots(plan),
            seed=schedule.seed,
            progress=progress,
        )
    timings, setup_parts = _with_measured_setup(timings, measured_setup)
    gpu_count, alloc = gpu_allocation(backend_kind)
    proj = project(
        schedule,
        timings,
        plan.budget,
        gpu_count=gpu_count,
        reserve_fraction=reserve_fraction,
        elapsed_seconds=elapsed_seconds,
    )
    pilot_config = _pilot_config(
        backend_kind=backend_kind,
        plan=plan,
        initial_checkpoint=initial_checkpoint,
        schedule=schedule,
        timings=timings,
        pilot_groups=pilot_groups,
        pilot_updates=pilot_updates,
        reserve_fraction=reserve_fraction,
        elapsed_seconds=elapsed_seconds,
        setup_parts=setup_parts,
    )
    block = _plan_feasibility_block(plan, schedule, timings, proj, pilot_config, effective_config, alloc)
    check = feasibility_check(proj, known_gpu_hours=0.0 if gpu_count == 0 else None)
    failures = [p for p in proj.problems if not p.startswith("GPU-hours not projected")] if not proj.fits else []
    stages = {k: v * (1.0 + reserve_fraction) for k, v in stage_projections(schedule, timings).items()}
    result = FeasibilityResult(
        schedule, timings, proj, block, check, proj.fits, failures, details, stages, embedded_server=embedded_server
    )
    _write_feasibility(bundle, result, t0)
    return result


def _plan_feasibility_block(
    plan: Plan,
    schedule: PilotSchedule,
    timings: PilotTimings,
    proj: Projection,
    pilot_config: JsonObject,
    effective_config: Mapping[str, JsonValue] | None,
    allocation_source: str | None,
) -> JsonObject:
    """The `feasibility` block of `plan`: its effective config (the schedule when the caller gives
    none) and primary endpoint beside the projection, sourced to the pilot file."""
    eff = dict(effective_config) if effective_config is not None else {"schedule": asdict(schedule)}
    return feasibility_block(
        schedule=schedule,
        timings=timings,
        projection=proj,
        pilot_config=pilot_config,
        effective_config=eff,
        primary_endpoint=_primary_endpoint(plan),
        source=PILOT_FILE,
        allocation_source=allocation_source,
    )


def _primary_endpoint(plan: Plan) -> str:
    """What the plan's run answers: a diagnostic's question, else the experiment's primary endpoint
    (its evaluation metric when it names none)."""
    if plan.kind == "bounded_diagnostic":
        return plan.diagnostic.question
    return plan.experiment.primary_endpoint or plan.experiment.eval.metric


def _write_feasibility(bundle: EvidenceBundle, result: FeasibilityResult, t0: float) -> None:
    """The pilot file (schedule, timings, pilot, projection, the check), then the result's
    `feasibility` block and metrics, the pilot's wall seconds counted from `t0` to here."""
    record = {
        "schedule": asdict(result.schedule),
        "timings": asdict(result.timings),
        "pilot": result.pilot_details,
        "projection": result.projection.as_dict(),
        "stage_projections_with_reserve": result.stage_seconds,
        "feasibility_check": result.check,
    }
    bundle.register_json(PILOT_FILE, "metrics", record)
    metrics = _feasibility_metrics(result.projection, time.perf_counter() - t0)
    bundle.update_result(feasibility=result.block, metrics=metrics)


def _with_measured_setup(
    timings: PilotTimings, measured_setup: Mapping[str, float] | None
) -> tuple[PilotTimings, dict[str, float]]:
    """The pilot's setup time plus the run's other measured setup phases, and the parts by name."""
    setup_parts = {"create_client_from_initial_checkpoint": timings.setup_seconds}
    for name, secs in (measured_setup or {}).items():
        if not (isinstance(secs, (int, float)) and math.isfinite(secs) and secs >= 0):
            raise FeasibilityError(f"measured_setup[{name!r}] must be finite seconds >= 0, got {secs!r}")
        setup_parts[name] = float(secs)
    return replace(timings, setup_seconds=sum(setup_parts.values())), setup_parts


def _pilot_config(
    *,
    backend_kind: str,
    plan: Plan,
    initial_checkpoint: str,
    schedule: PilotSchedule,
    timings: PilotTimings,
    pilot_groups: int,
    pilot_updates: int,
    reserve_fraction: float,
    elapsed_seconds: float,
    setup_parts: Mapping[str, float],
) -> JsonObject:
    """What the pilot ran and how the projection extrapolates it (the feasibility block's config)."""
    return {
        "backend": backend_kind,
        "plan": plan.name,
        "plan_sha256": plan.sha256,
        "initial_checkpoint": initial_checkpoint,
        "pilot_groups": pilot_groups,
        "group_size": schedule.group_size,
        "temperature": schedule.temperature,
        "max_tokens": schedule.max_tokens,
        "pilot_updates": pilot_updates,
        "sequences_per_update": schedule.sequences_per_update,
        "pilot_eval_items": timings.eval_items,
        "eval_decoding": {"temperature": 0.0, "max_tokens": schedule.max_tokens},
        "reserve_fraction": reserve_fraction,
        "elapsed_seconds_taken_off_budget": elapsed_seconds,
        "setup_components_seconds": dict(setup_parts),
        "extrapolation": "sampling seconds per group x groups_per_batch, mean update seconds x "
        "updates_per_batch, per arm-step; eval seconds per item x eval items",
    }


def _feasibility_metrics(proj: Projection, pilot_wall_seconds: float) -> dict[str, float]:
    metrics = {
        "feasibility/pilot_wall_seconds": pilot_wall_seconds,
        "feasibility/projected_wall_seconds": proj.total_seconds,
        "feasibility/remaining_wall_budget_seconds": proj.budget_seconds,
        "feasibility/fits": 1.0 if proj.fits else 0.0,
    }
    if proj.gpu_hours is not None:
        metrics["feasibility/projected_gpu_hours"] = proj.gpu_hours
    return metrics


def gpu_allocation(backend_kind: str) -> tuple[int | None, str | None]:
    """GPU count only from explicit evidence: the local server runs on this host's CPU."""
    if backend_kind != "local":
        return None, None  # shared service: allocation unknown
    try:
        n = torch.cuda.device_count()
    except Exception:
        return None, None
    if n == 0:
        return 0, "local embedded server on this host: torch.cuda.device_count() == 0 (CPU only)"
    return None, None  # a GPU exists but the CPU server's use of it is not evidenced

"""Feasibility: the timing pilot on the backend that will run the plan (setup from the initial
checkpoint; PILOT_GROUPS train groups sampled at the plan's settings, then each arm's PILOT_UPDATES
updates through the arm-step's update phase; greedy samples of a few test items, submitted
together), then the projection of the whole plan: the pilot's figures applied to the plan's own
`RunConfig`, scaled by nothing else and with no concurrency assumed, plus a recovery reserve. A
plan that does not fit fails the stage. A bounded diagnostic runs no pilot
(`runs_feasibility_pilot`): its feasibility block is its own measured setup.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import tinker
import torch
from pydantic import JsonValue

from dppo_harness.data import dataset, tokenizer
from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.rollout import rollouts
from dppo_harness.stages.arm_step import ArmStepProgress, make_loss, rollout_config, run_arm_updates
from dppo_harness.stages.write import PILOT_FILE

if TYPE_CHECKING:
    from dppo_harness.plans import Plan, RunConfig

PILOT_GROUPS, PILOT_UPDATES, PILOT_EVAL_ITEMS = 2, 2, 4  # train groups sampled, updates per arm, test items

RESERVE_FRACTION = 0.25


class FeasibilityError(RuntimeError):
    """The pilot could not run or the plan lacks what the projection needs."""


def runs_feasibility_pilot(plan: Plan) -> bool:
    """Under a bounded diagnostic plan no extra pilot samples or trains (its budget is fixed)."""
    return plan.kind != "bounded_diagnostic"


def arm_steps(run: RunConfig) -> int:
    """Rollout batches over all arms: the units the training projection counts."""
    return len(run.arms) * run.rollout_steps


def planned_eval_items(run: RunConfig) -> int:
    """Greedy items over all arms."""
    return len(run.arms) * run.eval_items


def schedule_json(plan_kind: str, run: RunConfig) -> JsonObject:
    """The schedule the projection counted, in its units (the pilot file's `schedule`)."""
    return {
        "plan_kind": plan_kind,
        "trained_arms": len(run.arms),
        "batches_per_arm": run.rollout_steps,
        "groups_per_batch": run.groups_per_batch,
        "group_size": run.group_size,
        "updates_per_batch": run.updates_per_batch,
        "sequences_per_update": run.batch_size // run.updates_per_batch,
        "max_tokens": run.max_tokens,
        "eval_items": planned_eval_items(run),
        "temperature": run.temperature,
        "dataset": run.dataset,
        "arm_losses": [a.loss for a in run.arms],
        "seed": run.seed,
    }


@dataclass(frozen=True)
class PilotTimings:
    setup_seconds: float
    sampling_seconds: float  # first submit -> last result, all pilot groups in flight together
    sampled_groups: int
    sampled_sequences: int
    update_seconds: tuple[float, ...]  # each: forward_backward_custom + optim_step
    sequences_per_update: int
    eval_seconds: float
    eval_items: int

    def validate(self) -> None:
        for name in ("setup_seconds", "sampling_seconds", "eval_seconds"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise FeasibilityError(f"pilot {name} must be a finite non-negative number, got {v!r}")
        if self.sampled_groups < 1:
            raise FeasibilityError("pilot sampled no groups")
        if not self.update_seconds or any(not (math.isfinite(s) and s > 0) for s in self.update_seconds):
            raise FeasibilityError(f"pilot update timings must be positive: {self.update_seconds}")


@dataclass(frozen=True)
class Projection:
    setup_seconds: float
    arm_step_seconds: float
    training_seconds: float
    evaluation_seconds: float
    recovery_seconds: float
    total_seconds: float
    budget_seconds: float  # remaining wall budget the total is compared with
    gpu_count: int | None
    gpu_hours: float | None
    gpu_hours_budget: float
    fits: bool
    problems: tuple[str, ...]


def project(
    run: RunConfig,
    timings: PilotTimings,
    budget: Mapping[str, float],
    *,
    gpu_count: int | None,
) -> Projection:
    """Whole-plan wall time, (setup + arm_steps x arm-step + eval_items x seconds_per_item) x (1 +
    reserve), and GPU-hours when the GPU count is known, against the budget. Time already spent in
    the session is the budget ledger's (`evidence.budget_allows`)."""
    timings.validate()
    problems: list[str] = []
    per_group, per_update = timings.sampling_seconds / timings.sampled_groups, statistics.fmean(timings.update_seconds)
    arm_step = per_group * run.groups_per_batch + run.updates_per_batch * per_update  # one rollout batch
    training = arm_steps(run) * arm_step
    evaluation = 0.0
    if planned_eval_items(run):
        if not timings.eval_items:
            raise FeasibilityError("the plan evaluates items but the pilot timed no evaluation")
        evaluation = planned_eval_items(run) * timings.eval_seconds / timings.eval_items
    work = timings.setup_seconds + training + evaluation
    recovery = RESERVE_FRACTION * work
    total = work + recovery
    budget_s = float(budget["max_wall_minutes"]) * 60.0
    fits = total <= budget_s
    if not fits:
        problems.append(
            f"projected wall time {total:.0f}s (setup {timings.setup_seconds:.0f}s + training "
            f"{training:.0f}s + evaluation {evaluation:.0f}s + reserve {recovery:.0f}s) exceeds the "
            f"remaining wall budget {budget_s:.0f}s ({budget['max_wall_minutes']} min)"
        )
    gpu_budget = float(budget["gpu_hours"])
    gpu_hours = None if gpu_count is None else total / 3600.0 * gpu_count
    if gpu_hours is None:
        problems.append("GPU-hours not projected: no allocation evidence for the GPU count")
    elif gpu_hours > gpu_budget:
        fits = False
        problems.append(f"projected {gpu_hours:.2f} GPU-hours exceeds the budget {gpu_budget}")
    parts = (timings.setup_seconds, arm_step, training, evaluation, recovery, total, budget_s)
    return Projection(*parts, gpu_count, gpu_hours, gpu_budget, fits, tuple(problems))


def feasibility_block(
    run: RunConfig,
    timings: PilotTimings,
    projection: Projection,
    *,
    pilot_config: Mapping[str, JsonValue],
    effective_config: Mapping[str, JsonValue],
    primary_endpoint: str,
    allocation_source: str | None,
) -> JsonObject:
    """The result's `feasibility` block, in its fixed shape (config, measurements per phase, recovery).

    training.units is arm-step equivalents timed: the pilot's measured training seconds divided by
    the projected seconds of one arm-step, so seconds / units x planned_units is the projection.
    """
    gpu = projection.gpu_count
    where = {"gpu_count": gpu, "allocation_source": allocation_source if gpu is not None else None}
    trained = timings.sampled_sequences + timings.sequences_per_update * len(timings.update_seconds)
    trained_s = timings.sampling_seconds + sum(timings.update_seconds)
    return {
        "config": dict(pilot_config),
        "effective_config": dict(effective_config),
        "primary_endpoint": primary_endpoint,
        "source": PILOT_FILE,
        "measurements": {
            "setup": {"seconds": timings.setup_seconds, "units": 1, "planned_units": 1, "samples": 0, **where},
            "training": {
                "seconds": trained_s,
                "units": trained_s / projection.arm_step_seconds,
                "planned_units": arm_steps(run),
                "samples": trained,
                **where,
            },
            "evaluation": {
                "seconds": timings.eval_seconds,
                "units": timings.eval_items,
                "planned_units": planned_eval_items(run),
                "samples": timings.eval_items,
                **where,
            },
        },
        "generation": None,
        "recovery": {"seconds": projection.recovery_seconds, **where},
    }


def feasibility_check(projection: Projection, known_gpu_hours: float | None) -> JsonObject:
    """The spec's `feasibility_check` shape, filled from the projection (projected, not observed)."""
    return {
        "status": "fits" if projection.fits else "exceeds_budget",
        "problems": list(projection.problems),
        "wall_seconds": projection.total_seconds,
        "gpu_hours": projection.gpu_hours,
        "known_gpu_hours": known_gpu_hours,
        "phases": {
            "setup": projection.setup_seconds,
            "training": projection.training_seconds,
            "evaluation": projection.evaluation_seconds,
            "recovery": projection.recovery_seconds,
        },
    }


@dataclass
class FeasibilityResult:
    timings: PilotTimings
    projection: Projection
    block: JsonObject  # the result's `feasibility` block
    passed: bool
    failures: list[str]
    pilot: JsonObject  # the pilot file: schedule, timings, what was piloted, projection, checks
    wall_seconds: float
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


def run_timing_pilot(
    service_client: tinker.ServiceClient,
    run: RunConfig,
    initial_checkpoint: str,
    progress: Callable[[str], None] | None = None,
) -> tuple[PilotTimings, JsonObject]:
    """The timings and what the pilot sampled, trained on and timed (the pilot file's `pilot`).

    The update minibatch has the plan's sequences per update, tiled from the pilot's sampled
    sequences (real lengths). Every arm's updates are timed with its own loss and optimizer, so the
    mean update time weighs every arm equally, as the schedule trains them."""
    renderer = tokenizer.make_renderer().renderer
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"[preflight] feasibility pilot {msg} ({time.perf_counter() - t0:.0f}s)")

    say("1/4: client from the initial checkpoint")
    client = service_client.create_training_client_from_state_with_optimizer(initial_checkpoint)
    setup_s = time.perf_counter() - t0
    cfg = replace(rollout_config(run, run.seed), groups_per_batch=PILOT_GROUPS)  # the arms' settings, fewer groups
    say(f"2/4: sampling {PILOT_GROUPS} groups x {cfg.group_size} (max_tokens {cfg.max_tokens})")
    data = dataset.get(run.dataset)
    items = data.load_split("train", seed=run.seed).items[:PILOT_GROUPS]
    sampled = rollouts.sample_rollout_batch(client, items, renderer, cfg, sampler_name="feasibility-pilot")
    if not sampled.datums:
        raise FeasibilityError("pilot sampled no datums to build a minibatch from")
    minibatch = [i % len(sampled.datums) for i in range(run.batch_size // run.updates_per_batch)]
    ry = sampled.batch.response_yield()
    say(
        f"3/4: {PILOT_UPDATES} timed updates of {len(minibatch)} sequences for each of {len(run.arms)} arm(s) "
        f"({ry.truncated} of {ry.n} sampled responses truncated)"
    )
    by_arm: dict[str, list[float]] = {}
    for arm in run.arms:  # each arm's own loss, recorder and optimizer, through the arm-step's update phase
        done = ArmStepProgress(sampled=sampled)
        run_arm_updates(client, arm, make_loss(arm, run), sampled, [minibatch] * PILOT_UPDATES, step=0, progress=done)
        by_arm[arm.name] = done.update_seconds
    update_s = [t for times in by_arm.values() for t in times]

    eval_n = PILOT_EVAL_ITEMS if run.eval_items else 0
    say(f"4/4: greedy evaluation of {eval_n} test items" if eval_n else "4/4: no evaluation in this plan")
    eval_tokens, eval_s = 0, 0.0
    if eval_n:  # greedy samples of the first test items, submitted together like the evaluation
        prompts = [data.build_prompt(it, renderer) for it in data.load_split("test").items[:eval_n]]
        params = tinker.SamplingParams(
            max_tokens=cfg.max_tokens, temperature=0.0, stop=tokenizer.stop_list(prompts[0][1])
        )
        _, sampler = rollouts.save_sampler(client, "feasibility-eval")
        t2 = time.perf_counter()
        results = [f.result() for f in [sampler.sample(ob, 1, params) for ob, _ in prompts]]
        eval_s = time.perf_counter() - t2
        eval_tokens = int(sum(len(r.sequences[0].tokens) for r in results))

    timings = PilotTimings(
        setup_seconds=setup_s,
        sampling_seconds=sampled.seconds,  # includes saving sampler weights, as every real step does
        sampled_groups=PILOT_GROUPS,
        sampled_sequences=PILOT_GROUPS * cfg.group_size,
        update_seconds=tuple(update_s),
        sequences_per_update=len(minibatch),
        eval_seconds=eval_s,
        eval_items=eval_n,
    )
    lengths = [len(sampled.datums[i].model_input.to_ints()) + 1 for i in minibatch]
    details: JsonObject = {
        "setup": "create_training_client_from_state_with_optimizer(initial checkpoint)",
        "sampling": sampled.batch.summary(),
        "minibatch": {
            "sequences": len(minibatch),
            "distinct_sampled_sequences": len(sampled.datums),
            "mean_tokens": float(np.mean(lengths)),
            "max_tokens": int(max(lengths)),
            "loss": "each arm's own registered loss, token_mean, via forward_backward_custom",
        },
        "update_seconds": list(update_s),
        "updates_by_arm": {
            a.name: {"loss": a.loss, "optimizer": as_object(a.adam_config_requested()), "seconds": list(by_arm[a.name])}
            for a in run.arms
        },
        "evaluation": {"items": eval_n, "greedy_tokens": eval_tokens, "seconds": eval_s, "submitted_together": True},
    }
    return timings, details


def run_feasibility(
    service_client: tinker.ServiceClient,
    plan: Plan,
    *,
    initial_checkpoint: str,
    backend_kind: str,
    effective_config: Mapping[str, JsonValue] | None = None,
    timings: PilotTimings | None = None,
    measured_setup: Mapping[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
    embedded_server: bool = False,
) -> FeasibilityResult:
    """Pilot (unless `timings` is given) and project `plan` at its own schedule (a smaller run is a
    smaller plan).
    `measured_setup` adds other measured setup phases ({"restoration_preflight": seconds})."""
    run = plan.run
    if run is None:
        raise FeasibilityError(f"plan {plan.name}: a {plan.kind} plan is not piloted (it has no run config)")
    details: JsonObject = {}
    t0 = time.perf_counter()
    if timings is None:
        timings, details = run_timing_pilot(service_client, run, initial_checkpoint, progress)
    setup_parts = {"create_client_from_initial_checkpoint": timings.setup_seconds}
    for name, secs in (measured_setup or {}).items():
        if not (isinstance(secs, (int, float)) and math.isfinite(secs) and secs >= 0):
            raise FeasibilityError(f"measured_setup[{name!r}] must be finite seconds >= 0, got {secs!r}")
        setup_parts[name] = float(secs)
    timings = replace(timings, setup_seconds=sum(setup_parts.values()))
    gpu_count, alloc = gpu_allocation(backend_kind)
    proj = project(run, timings, plan.budget, gpu_count=gpu_count)
    schedule = schedule_json(plan.kind, run)
    pilot_config: JsonObject = {
        "backend": backend_kind,
        "plan": plan.name,
        "plan_sha256": plan.sha256,
        "initial_checkpoint": initial_checkpoint,
        "pilot_groups": PILOT_GROUPS,
        **{k: schedule[k] for k in ("group_size", "temperature", "max_tokens")},
        "pilot_updates": PILOT_UPDATES,
        "sequences_per_update": schedule["sequences_per_update"],
        "pilot_eval_items": timings.eval_items,
        "eval_decoding": {"temperature": 0.0, "max_tokens": schedule["max_tokens"]},
        "reserve_fraction": RESERVE_FRACTION,
        "elapsed_seconds_taken_off_budget": 0.0,  # time spent in the session is the budget ledger's
        "setup_components_seconds": dict(setup_parts),
        "extrapolation": "sampling seconds per group x groups_per_batch, mean update seconds x "
        "updates_per_batch, per arm-step; eval seconds per item x eval items",
    }
    block = feasibility_block(
        run,
        timings,
        proj,
        pilot_config=pilot_config,
        effective_config=dict(effective_config) if effective_config is not None else {"schedule": schedule},
        primary_endpoint=plan.experiment.primary_endpoint or plan.experiment.eval.metric,
        allocation_source=alloc,
    )
    # For the budget ledger's per-stage check: the whole plan and the gate's pilot (its steps of
    # sampling + updates_per_batch updates), with the reserve.
    gate_s = (timings.setup_seconds + run.gate_pilot_steps * proj.arm_step_seconds) * (1 + RESERVE_FRACTION)
    record: JsonObject = {
        "schedule": schedule,
        "timings": asdict(timings),
        "pilot": details,
        "projection": asdict(proj),
        "stage_projections_with_reserve": {"plan": proj.total_seconds, "gate": gate_s},
        "feasibility_check": feasibility_check(proj, known_gpu_hours=0.0 if gpu_count == 0 else None),
    }
    failures = [p for p in proj.problems if not p.startswith("GPU-hours not projected")] if not proj.fits else []
    return FeasibilityResult(
        timings, proj, block, proj.fits, failures, record, time.perf_counter() - t0, embedded_server
    )


def gpu_allocation(backend_kind: str) -> tuple[int | None, str | None]:
    """GPU count only from explicit evidence: the local server runs on this host's CPU (a shared
    service's allocation is unknown; so is the CPU server's use of a GPU this host has)."""
    if backend_kind != "local" or torch.cuda.device_count() != 0:  # reports 0 when CUDA is unusable
        return None, None
    return 0, "local embedded server on this host: torch.cuda.device_count() == 0 (CPU only)"

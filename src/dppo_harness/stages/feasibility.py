"""Feasibility: a timing pilot on the actual backend and a projection of the whole plan.

The pilot measures, on the backend that will run the plan:
- setup: create a training client from the initial checkpoint with optimizer state;
- training: sample `pilot_groups` GSM8K train groups at the plan's sampling settings, then
  `pilot_updates` forward_backward_custom + optim_step calls on a minibatch of the plan's size;
- evaluation: greedy samples of a few GSM8K test items, submitted together like the evaluation.

The projection applies the measured per-unit times to the plan's schedule (no scaling by model
size, no assumed concurrency: sampling time per group is what the pilot measured with its groups
in flight together), adds a recovery reserve, and compares with the plan's budget. A plan that
does not fit fails the stage, which blocks later stages.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import Plan

DEFAULT_RESERVE_FRACTION = 0.25
PILOT_FILE = "feasibility-pilot.json"


class FeasibilityError(RuntimeError):
    """The pilot could not run or the plan lacks what the projection needs."""


# --------------------------------------------------------------------------------------------
# Schedule of a plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    plan_kind: str
    trained_arms: int
    batches_per_arm: int  # rollout batches sampled per arm
    groups_per_batch: int
    group_size: int
    updates_per_batch: int  # optimizer updates on each rollout batch
    sequences_per_update: int
    max_tokens: int
    eval_items: int  # greedy items over all arms and checkpoints
    temperature: float
    dataset: str = "gsm8k"  # a registered dataset (dataset.DATASETS)
    arm_losses: tuple[str, ...] = ("dppo_divergence_mask",)  # every trained arm's registered loss, in plan order
    seed: int = 0

    @property
    def arm_steps(self) -> int:
        return self.trained_arms * self.batches_per_arm

    @property
    def sequences_per_batch(self) -> int:
        return self.groups_per_batch * self.group_size


def schedule_from_plan(plan: Any) -> Schedule:
    """The executed schedule of an experiment spec (its typed run config; a rehearsal at its
    declared size) or of a bounded-diagnostic plan."""
    if plan.kind in ("experiment_spec", "rehearsal"):
        run = plan.run
        return Schedule(
            plan_kind=plan.kind, trained_arms=len(run.arms), batches_per_arm=run.rollout_steps,
            groups_per_batch=int(run.groups_per_batch.value), group_size=int(run.group_size.value),
            updates_per_batch=run.updates_per_batch, sequences_per_update=run.batch_size // run.updates_per_batch,
            max_tokens=int(run.max_tokens.value), eval_items=len(run.arms) * run.eval_items,
            temperature=float(run.temperature.value), dataset=run.dataset, arm_losses=tuple(a.loss for a in run.arms),
            seed=run.seed,
        )
    if plan.kind == "bounded_diagnostic":
        from dppo_harness.loss.losses import DPPO_LOSS

        d = plan.diagnostic
        sch, fs = d.schedule, d.fixed_settings
        return Schedule(
            plan_kind=plan.kind, trained_arms=1, batches_per_arm=sch.sampling_batches,
            groups_per_batch=sch.groups_per_batch, group_size=sch.group_size,
            updates_per_batch=sch.max_optimizer_updates,
            sequences_per_update=sch.groups_per_minibatch * sch.group_size,
            max_tokens=fs.sampling.max_tokens, eval_items=0, temperature=float(fs.sampling.temperature),
            dataset=fs.sampling.dataset, arm_losses=(DPPO_LOSS,), seed=fs.seed,
        )
    raise FeasibilityError(f"unknown plan kind {plan.kind!r}")


# --------------------------------------------------------------------------------------------
# Pilot timings and projection (pure)
# --------------------------------------------------------------------------------------------


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

    @property
    def seconds_per_group(self) -> float:
        return self.sampling_seconds / self.sampled_groups

    @property
    def seconds_per_update(self) -> float:
        return statistics.fmean(self.update_seconds)

    @property
    def seconds_per_eval_item(self) -> float | None:
        return self.eval_seconds / self.eval_items if self.eval_items else None

    @property
    def training_seconds(self) -> float:
        return self.sampling_seconds + sum(self.update_seconds)


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

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["problems"] = list(self.problems)
        return d


def project(
    schedule: Schedule,
    timings: PilotTimings,
    budget: Mapping[str, float],
    *,
    gpu_count: int | None,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    elapsed_seconds: float = 0.0,
) -> Projection:
    """Whole-plan wall time (and GPU-hours when the GPU count is known) against the budget.

    arm-step = seconds_per_group x groups_per_batch + updates_per_batch x seconds_per_update;
    total = (setup + arm_steps x arm-step + eval_items x seconds_per_item) x (1 + reserve).
    `elapsed_seconds` (already spent on this run) is taken off the wall budget first.
    """
    timings.validate()
    if not (0.0 <= reserve_fraction < 10.0):
        raise FeasibilityError(f"reserve_fraction must be in [0, 10), got {reserve_fraction}")
    problems: list[str] = []
    arm_step = (timings.seconds_per_group * schedule.groups_per_batch
                + schedule.updates_per_batch * timings.seconds_per_update)
    training = schedule.arm_steps * arm_step
    if schedule.eval_items:
        per_item = timings.seconds_per_eval_item
        if per_item is None:
            raise FeasibilityError("the plan evaluates items but the pilot timed no evaluation")
        evaluation = schedule.eval_items * per_item
    else:
        evaluation = 0.0
    work = timings.setup_seconds + training + evaluation
    recovery = reserve_fraction * work
    total = work + recovery
    budget_s = float(budget["max_wall_minutes"]) * 60.0 - float(elapsed_seconds)
    fits = total <= budget_s
    if not fits:
        problems.append(
            f"projected wall time {total:.0f}s (setup {timings.setup_seconds:.0f}s + training "
            f"{training:.0f}s + evaluation {evaluation:.0f}s + reserve {recovery:.0f}s) exceeds the "
            f"remaining wall budget {budget_s:.0f}s ({budget['max_wall_minutes']} min"
            + (f" minus {elapsed_seconds:.0f}s spent" if elapsed_seconds else "") + ")")
    gpu_budget = float(budget["gpu_hours"])
    if gpu_count is None:
        gpu_hours = None
        problems.append("GPU-hours not projected: no allocation evidence for the GPU count")
    else:
        gpu_hours = total / 3600.0 * gpu_count
        if gpu_hours > gpu_budget:
            fits = False
            problems.append(f"projected {gpu_hours:.2f} GPU-hours exceeds the budget {gpu_budget}")
    return Projection(
        setup_seconds=timings.setup_seconds, arm_step_seconds=arm_step, training_seconds=training,
        evaluation_seconds=evaluation, recovery_seconds=recovery, total_seconds=total,
        budget_seconds=budget_s, gpu_count=gpu_count, gpu_hours=gpu_hours,
        gpu_hours_budget=gpu_budget, fits=fits, problems=tuple(problems))


def feasibility_block(
    *,
    schedule: Schedule,
    timings: PilotTimings,
    projection: Projection,
    pilot_config: Mapping[str, Any],
    effective_config: Mapping[str, Any],
    primary_endpoint: str,
    source: str,
    allocation_source: str | None,
) -> dict[str, Any]:
    """`feasibility` in the brief's exact shape.

    training.units is arm-step equivalents timed: the pilot's measured training seconds divided by
    the projected seconds of one arm-step, so seconds / units x planned_units is the projection.
    """
    gpu, alloc = projection.gpu_count, allocation_source if projection.gpu_count is not None else None
    eval_block = {"seconds": timings.eval_seconds, "units": timings.eval_items,
                  "planned_units": schedule.eval_items, "samples": timings.eval_items,
                  "gpu_count": gpu, "allocation_source": alloc}
    return {
        "config": dict(pilot_config),
        "effective_config": dict(effective_config),
        "primary_endpoint": primary_endpoint,
        "source": source,
        "measurements": {
            "setup": {"seconds": timings.setup_seconds, "units": 1, "planned_units": 1, "samples": 0,
                      "gpu_count": gpu, "allocation_source": alloc},
            "training": {"seconds": timings.training_seconds,
                         "units": timings.training_seconds / projection.arm_step_seconds,
                         "planned_units": schedule.arm_steps,
                         "samples": timings.sampled_sequences + timings.sequences_per_update * len(timings.update_seconds),
                         "gpu_count": gpu, "allocation_source": alloc},
            "evaluation": eval_block,
        },
        "generation": None,
        "recovery": {"seconds": projection.recovery_seconds, "gpu_count": gpu, "allocation_source": alloc},
    }


def feasibility_check(projection: Projection, known_gpu_hours: float | None) -> dict[str, Any]:
    """The spec's `feasibility_check` shape, filled from the projection (projected, not observed)."""
    return {
        "status": "fits" if projection.fits else "exceeds_budget",
        "problems": list(projection.problems),
        "wall_seconds": projection.total_seconds,
        "gpu_hours": projection.gpu_hours,
        "known_gpu_hours": known_gpu_hours,
        "phases": {"setup": projection.setup_seconds, "training": projection.training_seconds,
                   "evaluation": projection.evaluation_seconds, "recovery": projection.recovery_seconds},
    }


def stage_projections(schedule: Schedule, timings: PilotTimings, *, gate_steps: int = 5) -> dict[str, float]:
    """Projected seconds of later stages (before the reserve), for the budget ledger.

    "plan": the whole selected plan. "gate" (experiment spec only, whose minibatch size the pilot
    timed): the spec's 5-step treatment-arm pilot, sampling + updates_per_batch updates per step.
    """
    group_s, update_s = timings.seconds_per_group, timings.seconds_per_update
    step_s = group_s * schedule.groups_per_batch + schedule.updates_per_batch * update_s
    out = {"plan": timings.setup_seconds + schedule.arm_steps * step_s
           + schedule.eval_items * (timings.seconds_per_eval_item or 0.0)}
    if schedule.plan_kind in ("experiment_spec", "rehearsal"):
        out["gate"] = timings.setup_seconds + gate_steps * step_s
    return out


# --------------------------------------------------------------------------------------------
# The pilot on the backend
# --------------------------------------------------------------------------------------------


@dataclass
class FeasibilityResult:
    schedule: Schedule
    timings: PilotTimings
    projection: Projection
    block: dict[str, Any]
    check: dict[str, Any]
    passed: bool
    failures: list[str]
    pilot_details: dict[str, Any] = field(default_factory=dict)
    # Projected seconds with reserve: "plan" (the whole selected plan) and, for the spec, "gate"
    # (its 5-step pilot); for the budget ledger's per-stage check (evidence.budget_allows).
    stage_seconds: dict[str, float] = field(default_factory=dict)

    embedded_server: bool = False  # the embedded server computed the pilot (the hint below)

    def failure_message(self) -> str:
        msg = "feasibility: the plan does not fit its budget:\n  - " + "\n  - ".join(self.failures)
        if self.embedded_server:
            # The stages run a plan as written; a smaller run is a declared rehearsal plan.
            msg += ("\n  the embedded server runs a plan at its own size; rehearse it at a declared size: "
                    "python -m dppo_harness.plans rehearse SPEC --out PLAN, then --plan PLAN")
        return msg


def _tile(datums: Sequence[Any], n: int) -> list[Any]:
    if not datums:
        raise FeasibilityError("pilot sampled no datums to build a minibatch from")
    return [datums[i % len(datums)] for i in range(n)]


def _time_greedy_eval(client: Any, data: Any, renderer: Any, max_tokens: int, eval_n: int) -> tuple[float, int]:
    """Greedy samples of the first `eval_n` test items, submitted together like the evaluation:
    (seconds from the first submit to the last result, greedy tokens)."""
    import tinker

    from dppo_harness.rollout import rollout_batch

    test = data.load_split("test").items[:eval_n]
    prompts = [data.build_prompt(it, renderer) for it in test]
    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                   stop=list(prompts[0][1]))
    _, sampler = rollout_batch.save_sampler(client, "feasibility-eval")
    t2 = time.perf_counter()
    futures = [sampler.sample(ob, 1, params) for ob, _ in prompts]
    results = [f.result() for f in futures]
    eval_s = time.perf_counter() - t2
    return eval_s, int(sum(len(r.sequences[0].tokens) for r in results))


def run_timing_pilot(
    service_client: Any,
    schedule: Schedule,
    initial_checkpoint: str,
    *,
    pilot_groups: int = 2,
    pilot_updates: int = 2,
    pilot_eval_items: int = 4,
    arms: Sequence[ArmPilot],
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> tuple[PilotTimings, dict[str, Any]]:
    """Time setup, sampling + updates, and greedy evaluation on `service_client`'s backend.

    The update minibatch has the plan's `sequences_per_update` sequences, tiled from the pilot's
    sampled sequences (real sampled lengths) when the pilot sampled fewer. Every arm's updates are
    timed with its own loss and optimizer config (`pilot_updates` each), so the mean update time
    the projection uses weighs every arm equally, as the schedule trains them.
    """
    import numpy as np
    import tinker

    from dppo_harness.data import dataset, tokenizer
    from dppo_harness.loss import losses
    from dppo_harness.rollout import rollout_batch, rollouts
    from dppo_harness.train import train_step

    bundle = tokenizer.make_renderer()
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"[preflight] feasibility pilot {msg} ({time.perf_counter() - t0:.0f}s)")

    say("1/4: client from the initial checkpoint")
    client = service_client.create_training_client_from_state_with_optimizer(initial_checkpoint).result()
    setup_s = time.perf_counter() - t0
    say(f"2/4: sampling {pilot_groups} groups x {schedule.group_size} (max_tokens {schedule.max_tokens})")

    data = dataset.get(schedule.dataset)
    train = data.load_split("train", seed=seed)
    items = train.items[:pilot_groups]
    cfg = rollouts.RolloutConfig(groups_per_batch=pilot_groups, group_size=schedule.group_size,
                                 temperature=schedule.temperature, max_tokens=schedule.max_tokens, seed=seed)
    sampled = rollout_batch.sample_rollout_batch(client, items, bundle.renderer, cfg, sampler_name="feasibility-pilot")
    sampling_s = sampled.seconds  # includes saving sampler weights, as every real step does
    batch, datums = sampled.batch, list(sampled.datums)
    minibatch = _tile(datums, schedule.sequences_per_update)
    say(f"3/4: {pilot_updates} timed updates of {len(minibatch)} sequences for each of {len(arms)} arm(s) "
        f"({batch.response_yield().truncated} of {batch.response_yield().n} sampled responses truncated)")
    by_arm: dict[str, list[float]] = {}
    for arm in arms:
        loss_fn = losses.make_loss_fn(losses.LossConfig.for_loss(arm.loss, "token_mean"))
        adam = tinker.AdamParams(**{k: float(v) for k, v in arm.optimizer.items() if k in tinker.AdamParams.model_fields})
        by_arm[arm.name] = list(train_step.timed_updates(client, minibatch, loss_fn, adam, pilot_updates))
    update_s = [t for times in by_arm.values() for t in times]

    eval_n = pilot_eval_items if schedule.eval_items else 0
    say(f"4/4: greedy evaluation of {eval_n} test items" if eval_n else "4/4: no evaluation in this plan")
    eval_s, eval_tokens = (_time_greedy_eval(client, data, bundle.renderer, schedule.max_tokens, eval_n)
                           if eval_n else (0.0, 0))

    lengths = [len(d.model_input.to_ints()) + 1 for d in minibatch]
    timings = PilotTimings(
        setup_seconds=setup_s, sampling_seconds=sampling_s, sampled_groups=pilot_groups,
        sampled_sequences=pilot_groups * schedule.group_size, update_seconds=tuple(update_s),
        sequences_per_update=len(minibatch), eval_seconds=eval_s, eval_items=eval_n)
    details = {
        "setup": "create_training_client_from_state_with_optimizer(initial checkpoint)",
        "sampling": batch.summary(),
        "minibatch": {"sequences": len(minibatch), "distinct_sampled_sequences": len(datums),
                      "mean_tokens": float(np.mean(lengths)), "max_tokens": int(max(lengths)),
                      "loss": "each arm's own registered loss, token_mean, via forward_backward_custom"},
        "update_seconds": update_s,
        "updates_by_arm": {a.name: {"loss": a.loss, "optimizer": dict(a.optimizer), "seconds": by_arm[a.name]}
                           for a in arms},
        "evaluation": {"items": eval_n, "greedy_tokens": eval_tokens, "seconds": eval_s,
                       "submitted_together": True},
    }
    return timings, details


def run_feasibility(
    service_client: Any,
    plan: Plan,
    bundle: EvidenceBundle,
    *,
    initial_checkpoint: str,
    backend_kind: str,
    effective_config: Mapping[str, Any] | None = None,
    pilot_groups: int = 2,
    pilot_updates: int = 2,
    pilot_eval_items: int = 4,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    elapsed_seconds: float = 0.0,
    timings: PilotTimings | None = None,
    schedule_overrides: Mapping[str, Any] | None = None,
    measured_setup: Mapping[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
    embedded_server: bool = False,
) -> FeasibilityResult:
    """Pilot (unless `timings` is given), project `plan`, write `feasibility` to the bundle.

    `schedule_overrides` applies explicit size reductions (Schedule field -> value, e.g.
    {"batches_per_arm": 5}); they are recorded in the pilot config and the caller must record
    them as deviations. Unknown fields are an error. `measured_setup` adds other measured setup
    phases of this run ({"restoration_preflight": seconds, ...}) to the pilot's setup time.
    """
    schedule = _reduced_schedule(plan, schedule_overrides)
    details: dict[str, Any] = {}
    t0 = time.perf_counter()
    if timings is None:
        timings, details = run_timing_pilot(
            service_client, schedule, initial_checkpoint, pilot_groups=pilot_groups,
            pilot_updates=pilot_updates, pilot_eval_items=pilot_eval_items,
            arms=arm_pilots(plan), seed=schedule.seed, progress=progress)
    timings, setup_parts = _with_measured_setup(timings, measured_setup)
    gpu_count, alloc = gpu_allocation(backend_kind)
    proj = project(schedule, timings, plan.budget, gpu_count=gpu_count,
                   reserve_fraction=reserve_fraction, elapsed_seconds=elapsed_seconds)
    pilot_config = _pilot_config(
        backend_kind=backend_kind, plan=plan, initial_checkpoint=initial_checkpoint, schedule=schedule,
        timings=timings, pilot_groups=pilot_groups, pilot_updates=pilot_updates, reserve_fraction=reserve_fraction,
        elapsed_seconds=elapsed_seconds, schedule_overrides=schedule_overrides, setup_parts=setup_parts)
    eff = dict(effective_config) if effective_config is not None else {"schedule": asdict(schedule)}
    endpoint = (plan.diagnostic.question if plan.kind == "bounded_diagnostic"
                else plan.experiment.primary_endpoint or plan.experiment.eval.metric)
    block = feasibility_block(schedule=schedule, timings=timings, projection=proj,
                              pilot_config=pilot_config, effective_config=eff,
                              primary_endpoint=endpoint, source=PILOT_FILE, allocation_source=alloc)
    check = feasibility_check(proj, known_gpu_hours=0.0 if gpu_count == 0 else None)
    failures = [p for p in proj.problems if not p.startswith("GPU-hours not projected")] if not proj.fits else []
    stages = {k: v * (1.0 + reserve_fraction) for k, v in stage_projections(schedule, timings).items()}
    record = {"schedule": asdict(schedule), "timings": asdict(timings), "pilot": details,
              "projection": proj.as_dict(), "stage_projections_with_reserve": stages,
              "feasibility_check": check}
    bundle.register_json(PILOT_FILE, "metrics", record)
    bundle.update_result(feasibility=block, metrics=_feasibility_metrics(proj, time.perf_counter() - t0))
    return FeasibilityResult(schedule, timings, proj, block, check, proj.fits, failures, details, stages,
                             embedded_server=embedded_server)


def _reduced_schedule(plan: Plan, schedule_overrides: Mapping[str, Any] | None) -> Schedule:
    """The plan's schedule with the explicit size reductions applied (unknown fields: an error)."""
    schedule = schedule_from_plan(plan)
    if schedule_overrides:
        unknown = set(schedule_overrides) - set(Schedule.__dataclass_fields__)
        if unknown:
            raise FeasibilityError(f"schedule_overrides: unknown Schedule fields {sorted(unknown)}")
        schedule = replace(schedule, **dict(schedule_overrides))
    return schedule


def _with_measured_setup(timings: PilotTimings, measured_setup: Mapping[str, float] | None
                         ) -> tuple[PilotTimings, dict[str, float]]:
    """The pilot's setup time plus the run's other measured setup phases, and the parts by name."""
    setup_parts = {"create_client_from_initial_checkpoint": timings.setup_seconds}
    for name, secs in (measured_setup or {}).items():
        if not (isinstance(secs, (int, float)) and math.isfinite(secs) and secs >= 0):
            raise FeasibilityError(f"measured_setup[{name!r}] must be finite seconds >= 0, got {secs!r}")
        setup_parts[name] = float(secs)
    return replace(timings, setup_seconds=sum(setup_parts.values())), setup_parts


def _pilot_config(*, backend_kind: str, plan: Plan, initial_checkpoint: str, schedule: Schedule,
                  timings: PilotTimings, pilot_groups: int, pilot_updates: int, reserve_fraction: float,
                  elapsed_seconds: float, schedule_overrides: Mapping[str, Any] | None,
                  setup_parts: Mapping[str, float]) -> dict[str, Any]:
    """What the pilot ran and how the projection extrapolates it (the feasibility block's config)."""
    return {
        "backend": backend_kind, "plan": plan.name, "plan_sha256": plan.sha256,
        "initial_checkpoint": initial_checkpoint, "pilot_groups": pilot_groups,
        "group_size": schedule.group_size, "temperature": schedule.temperature,
        "max_tokens": schedule.max_tokens, "pilot_updates": pilot_updates,
        "sequences_per_update": schedule.sequences_per_update, "pilot_eval_items": timings.eval_items,
        "eval_decoding": {"temperature": 0.0, "max_tokens": schedule.max_tokens},
        "reserve_fraction": reserve_fraction, "elapsed_seconds_taken_off_budget": elapsed_seconds,
        "size_reductions": dict(schedule_overrides or {}),
        "setup_components_seconds": setup_parts,
        "extrapolation": "sampling seconds per group x groups_per_batch, mean update seconds x "
                         "updates_per_batch, per arm-step; eval seconds per item x eval items",
    }


def _feasibility_metrics(proj: Projection, pilot_wall_seconds: float) -> dict[str, float]:
    metrics = {"feasibility/pilot_wall_seconds": pilot_wall_seconds,
               "feasibility/projected_wall_seconds": proj.total_seconds,
               "feasibility/remaining_wall_budget_seconds": proj.budget_seconds,
               "feasibility/fits": 1.0 if proj.fits else 0.0}
    if proj.gpu_hours is not None:
        metrics["feasibility/projected_gpu_hours"] = proj.gpu_hours
    return metrics


@dataclass(frozen=True)
class ArmPilot:
    """One arm's update as the timing pilot runs it: its registered loss and its own optimizer config."""

    name: str
    loss: str
    optimizer: dict[str, float]


def arm_pilots(plan: Any) -> tuple[ArmPilot, ...]:
    """Every arm the plan trains, each with its own loss and optimizer config (a diagnostic: its one arm)."""
    if plan.kind == "bounded_diagnostic":
        from dppo_harness.loss.losses import DPPO_LOSS

        o = plan.diagnostic.fixed_settings.optimizer
        return (ArmPilot("diagnostic", DPPO_LOSS, {k: getattr(o, k) for k in (
            "learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}),)
    return tuple(ArmPilot(a.name, a.loss, dict(a.adam_config_requested())) for a in plan.run.arms)


def gpu_allocation(backend_kind: str) -> tuple[int | None, str | None]:
    """GPU count only from explicit evidence: the local server runs on this host's CPU."""
    if backend_kind != "local":
        return None, None  # shared service: allocation unknown
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        return None, None
    if n == 0:
        return 0, "local embedded server on this host: torch.cuda.device_count() == 0 (CPU only)"
    return None, None  # a GPU exists but the CPU server's use of it is not evidenced

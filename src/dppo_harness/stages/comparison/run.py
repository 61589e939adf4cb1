"""The comparison stage's run: `run_comparison`, the named steps of `run_steps` in order.

prepare (config, frozen evaluator, resume state) -> open arms (the preflight's loaded clients, or
each arm's saved state on resume) -> train both arms step by step (JSONL + metrics.arms as they
go, state saved every `save_every` steps, capacity retry) -> finalize each arm (checkpoint,
completed_arms, metrics) -> evaluate base and both final checkpoints -> decision -> report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dppo_harness.evaluation import greedy as evaluation
from dppo_harness.evidence import report
from dppo_harness.evidence.backend import backend_of
from dppo_harness.evidence.progress import Watchdog
from dppo_harness.instrument import cookbook_metrics
from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.service.release import ClientRegistry
from dppo_harness.service.wait.policy import CapacityPolicy
from dppo_harness.stages.comparison import run_steps
from dppo_harness.stages.comparison.arms import TrainingOutcome
from dppo_harness.stages.comparison.config import (
    ArmOrder,
    ComparisonConfig,
    ComparisonError,
    comparison_config,
)
from dppo_harness.stages.comparison.evaluate import evaluate_and_decide, freeze_for
from dppo_harness.stages.comparison.state import RunState
from dppo_harness.stages.comparison.step_rows import StepRowJson
from dppo_harness.stages.comparison.wall_guard import WallGuard

if TYPE_CHECKING:
    import tinker

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import Plan
    from dppo_harness.stages.restoration import RestorationResult

PROGRESS_EVERY_S = 15.0  # a line at least this often in every phase: arm steps and evaluation take minutes
EVAL_SUBSET_REASON = (
    "declared rehearsal size: the plan evaluates its first {n} {dataset} test items (see the plan's differences)"
)
EVAL_SUBSET_EMBEDDED = ", a size the embedded server's stand-in evaluates on this host's CPU"
# A spec (not a rehearsal plan) that itself asks for fewer items: its own words, no rehearsal claimed.
EVAL_STATED_REASON = "the plan states eval.n_examples = {n}: its first {n} {dataset} test items are evaluated"


def eval_subset_reason(plan: Plan, *, embedded: bool, n: int) -> str:
    """Why the evaluator scores a subset, in words that fit the run: a rehearsal plan's declared
    size (the CPU named only when the embedded server computes), else the spec's own n_examples."""
    if plan.run is None:
        raise ComparisonError(f"plan {plan.name}: a {plan.kind} plan has no paired comparison")
    if plan.kind != "rehearsal":
        return EVAL_STATED_REASON.format(n=n, dataset=plan.run.dataset)
    return EVAL_SUBSET_REASON.format(n=n, dataset=plan.run.dataset) + (EVAL_SUBSET_EMBEDDED if embedded else "")


@dataclass(frozen=True)
class ComparisonResult:
    config: ComparisonConfig
    run_id: str  # the run whose state this continues (== this bundle's run id unless resumed)
    rows: tuple[StepRowJson, ...]
    steps_completed: int
    training_seconds: float
    schedule: str
    stopped: str | None
    capacity_block: JsonObject | None
    scores: tuple[JsonObject, ...] = ()
    decision: JsonObject | None = None
    final: JsonObject = field(default_factory=dict)  # status, verdict, outcome_reason
    files: tuple[str, ...] = ()


def _frozen_evaluator(
    cfg: ComparisonConfig, bundle: EvidenceBundle, plan: Plan, *, embedded: bool
) -> evaluation.FrozenEvaluator:
    """The run's evaluator, frozen before training; its subset is a deviation, with the reason the
    plan gives (a rehearsal plan's declared size, or the spec's own n_examples)."""
    evaluator = freeze_for(cfg, eval_subset_reason(plan, embedded=embedded, n=cfg.eval_items))
    if evaluator.deviation:
        d = evaluator.deviation
        bundle.add_deviation(d["field"], d["original"], d["effective"], d["reason"])
    return evaluator


def served_by_embedded_server(backend: str, result: Mapping[str, Any]) -> bool:
    """The embedded server computed this run: the local backend, or its marker seen behind
    `--backend tinker`."""
    block = backend_of(result)
    return backend == "local" or (block is not None and block.embedded_server is not None)


def is_rehearsal(plan: Plan, backend: str, result: Mapping[str, Any]) -> bool:
    """A rehearsal by what served the run, not by the flag that chose the client: a rehearsal plan,
    the local backend, or the embedded server's marker seen behind `--backend tinker`."""
    return plan.kind == "rehearsal" or served_by_embedded_server(backend, result)


def run_comparison(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    restoration: RestorationResult | None,
    *,
    backend: str,
    state_root: Path,
    resume_run_id: str | None = None,
    schedule: ArmOrder = "interleaved",
    save_every: int = 1,
    capacity_policy: CapacityPolicy | None = None,
    registry: ClientRegistry | None = None,
    stop_after: Callable[[int], None] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    tag: str = "cmp",
    base_model: str | None = None,
    schedule_source: str = "given",
    guard: WallGuard | None = None,
    wandb: cookbook_metrics.WandbRequest | None = None,
) -> ComparisonResult:
    """Run (or continue) the paired comparison and write its evidence; see the module docstring.

    Any stop before every arm finished (wall-clock guard, optimizer mismatch on a restore, a
    response the run cannot use, capacity) leaves the evidence written so far and returns a final
    failed / inconclusive / incomplete_execution with the reason. Each arm's steps are also written
    through the cookbook's `ml_log` (`metrics-<arm>.jsonl` in the bundle, live under
    `<state_root>/<run_id>/cookbook-metrics/<arm>/metrics.jsonl`), and to W&B only when `wandb`
    asks for a project."""
    if plan.run is None:
        raise ComparisonError(f"plan {plan.name}: a {plan.kind} plan has no paired comparison")
    with Watchdog(progress, every_s=PROGRESS_EVERY_S) as dog:  # no phase is silent for longer
        progress = dog.say
        cfg = comparison_config(plan.run, save_every=save_every)
        prepared = prepare_run(
            plan, bundle, cfg, restoration, backend=backend, state_root=Path(state_root), resume_run_id=resume_run_id
        )
        session = run_steps.open_session(
            service_client,
            plan,
            bundle,
            cfg,
            prepared.state,
            Path(state_root),
            tag=tag,
            progress=progress,
            capacity_policy=capacity_policy,
            registry=registry,
            wandb=wandb,
        )
        run_steps.register_run_manifest(
            session,
            plan,
            schedule=schedule,
            schedule_source=schedule_source,
            rehearsal=prepared.rehearsal,
            evaluator_id=prepared.evaluator.evaluator_id,
        )
        progress(f"[comparison] schedule {schedule} ({schedule_source})")
        trained = train_run(
            session, restoration, schedule=schedule, schedule_source=schedule_source, stop_after=stop_after, guard=guard
        )
        if trained.outcome.stopped is not None:
            final = run_steps.stopped_final(plan, bundle, cfg, trained.outcome, trained.capacity_block)
            return trained.comparison_result(final)
        return close_with_evaluation(
            service_client,
            plan,
            bundle,
            prepared,
            trained,
            backend=backend,
            base_model=base_model or cfg.base_model,
            progress=progress,
        )


@dataclass(frozen=True)
class PreparedRun:
    """What the run is fixed to before training: its config, whether it is a rehearsal, the frozen
    evaluator and the run state (new, or the resumed run's)."""

    cfg: ComparisonConfig
    rehearsal: bool
    evaluator: evaluation.FrozenEvaluator
    state: RunState


def prepare_run(
    plan: Plan,
    bundle: EvidenceBundle,
    cfg: ComparisonConfig,
    restoration: RestorationResult | None,
    *,
    backend: str,
    state_root: Path,
    resume_run_id: str | None,
) -> PreparedRun:
    """Freeze the evaluator, then the run state it is named in (a resume also posts the reused
    preflight and gate)."""
    rehearsal = is_rehearsal(plan, backend, bundle.result)
    evaluator = _frozen_evaluator(cfg, bundle, plan, embedded=served_by_embedded_server(backend, bundle.result))
    state = run_steps.prepare_state(plan, bundle, cfg, evaluator.evaluator_id, restoration, state_root, resume_run_id)
    if state.resumed:
        run_steps.post_reused_setup(bundle, state)
    return PreparedRun(cfg, rehearsal, evaluator, state)


@dataclass(frozen=True)
class TrainedRun:
    """How training ended, with what every closing path reports: the run's config and state, the
    schedule it ran, the capacity block and the files written so far."""

    cfg: ComparisonConfig
    state: RunState
    schedule: ArmOrder
    outcome: TrainingOutcome
    capacity_block: JsonObject | None
    files: tuple[str, ...]

    def comparison_result(
        self,
        final: JsonObject,
        scores: tuple[JsonObject, ...] = (),
        decision: JsonObject | None = None,
        later_files: Sequence[str] = (),
    ) -> ComparisonResult:
        """The stage's result, `later_files` (evaluation, report) after training's own."""
        return ComparisonResult(
            self.cfg,
            self.state.run_id,
            tuple(self.state.rows),
            self.outcome.steps_completed,
            self.outcome.wall_seconds,
            self.schedule,
            self.outcome.stopped,
            self.capacity_block,
            scores,
            decision,
            final,
            (*self.files, *later_files),
        )


def train_run(
    session: run_steps.RunSession,
    restoration: RestorationResult | None,
    *,
    schedule: ArmOrder,
    schedule_source: str,
    stop_after: Callable[[int], None] | None,
    guard: WallGuard | None,
) -> TrainedRun:
    """Train every arm to the end or a stop, then register what training wrote (stopped or not)."""
    outcome, capacity_block = run_steps.train_session(
        session, restoration, schedule=schedule, stop_after=stop_after, guard=guard
    )
    files = run_steps.register_training_end(
        session, outcome, schedule=schedule, schedule_source=schedule_source, guard=guard
    )
    return TrainedRun(session.cfg, session.state, schedule, outcome, capacity_block, tuple(files))


def close_with_evaluation(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    prepared: PreparedRun,
    trained: TrainedRun,
    *,
    backend: str,
    base_model: str,
    progress: Callable[[str], None],
) -> ComparisonResult:
    """Every arm finished: evaluate base and arms, decide, write the report, then the final."""
    cfg, state = prepared.cfg, prepared.state
    scores, decision, eval_files = evaluate_and_decide(
        service_client, cfg, state, prepared.evaluator, bundle, prepared.rehearsal, progress, base_model
    )
    resume = (bundle.result.get("initialization_provenance") or {}).get("resume") if state.resumed else None
    rows = [as_object(r) for r in state.rows]
    report_files = report.write_comparison_report(
        bundle, rows, list(scores), decision, backend, max_tokens=cfg.max_tokens, resume=resume
    ).values()
    final = run_steps.succeeded_final(
        plan, bundle, cfg, trained.outcome, scores, decision, rehearsal=prepared.rehearsal
    )
    return trained.comparison_result(final, tuple(scores), decision, [*eval_files, *report_files])

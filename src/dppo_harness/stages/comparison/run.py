"""The paired comparison, one loop that reads top to bottom (`run_comparison`).

restore the arms (the preflight's loaded clients, or each arm's last common save on a resume) ->
for each rollout step: the wall guard, then for each arm its step (capacity retry from the step's
start), its row, its state saved every `save_every` steps -> finalize each arm after its last
step -> evaluate base and both final checkpoints with one frozen evaluator -> the paired decision.
A model the service loses is replaced once from its arm's last save inside the loop. Any stop
before every arm finished returns the training so far and a failed final; `write.write_comparison`
turns the result into files.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import tinker

import dppo_harness
from dppo_harness.data import dataset, tokenizer
from dppo_harness.evidence.backend import backend_of, session_served
from dppo_harness.evidence.journal import Journal
from dppo_harness.evidence.progress import Watchdog
from dppo_harness.evidence.provenance import package_files_sha256
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonObject, as_value
from dppo_harness.loss import losses
from dppo_harness.service.observed import ClientRegistry
from dppo_harness.service.wait.policy import (
    CapacityExhausted,
    CapacityTracker,
    ModelLost,
    ServiceStopped,
    WaitPolicy,
    call_with_capacity_retry,
    error_text,
)
from dppo_harness.stages import arm_step
from dppo_harness.stages.arm_step import ArmStepProgress, make_loss
from dppo_harness.stages.comparison.config import (
    ArmOrder,
    ComparisonError,
    OptimizerMismatch,
    step_seed,
)
from dppo_harness.stages.comparison.evaluate import evaluate_and_decide, frozen_evaluator
from dppo_harness.stages.comparison.resume import open_resumed, reuse_setup, snapshot_ref
from dppo_harness.stages.comparison.state import (
    ArmState,
    RunState,
    StepRetry,
    hold_run_lock,
    state_path,
)
from dppo_harness.stages.comparison.step_rows import (
    StepRowJson,
    arm_summary,
    kl_sample_train,
    step_line,
    step_metrics,
    trajectory_metrics,
)
from dppo_harness.stages.comparison.wall_guard import WallGuard
from dppo_harness.stages.write import write_comparison
from dppo_harness.train.clients import dump_response, server_info
from dppo_harness.train.optimizer_checks import optimizer_check
from dppo_harness.train.restore import restore

if TYPE_CHECKING:
    from tinker_cookbook import renderers

    from dppo_harness.data.gsm8k import Gsm8kItem
    from dppo_harness.evaluation.greedy import EvalResult, FrozenEvaluator
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ArmConfig, CriterionConfig, Plan, RunConfig
    from dppo_harness.stages.restoration import RestorationResult

T = TypeVar("T")

PROGRESS_EVERY_S = 15.0  # a line at least this often in every phase: arm steps and evaluation take minutes


class StopRequested(Exception):
    """Raised by a `stop_after` hook to end the run at a step boundary (tests: a kill)."""


@dataclass(frozen=True)
class ComparisonResult:
    run_id: str  # the run whose state this continues (== this bundle's run id unless resumed)
    rows: tuple[StepRowJson, ...]
    steps_completed: int  # min over arms
    schedule: str
    stopped: str | None  # None when every arm finished
    capacity_block: JsonObject | None
    manifest: Mapping[str, object]  # the run's: sessions, schedule, evaluator, plan, config
    end_state: Mapping[str, object]  # the run state after training, with its `training` block
    final: JsonObject = field(default_factory=dict)  # status, verdict, outcome_reason
    evaluator: FrozenEvaluator | None = None  # None when it stopped before evaluating
    evaluated: tuple[EvalResult, ...] = ()  # the base model first, then each arm, as scored
    decision: JsonObject | None = None  # once every model is scored
    decision_metrics: dict[str, float] = field(default_factory=dict)
    criteria: Sequence[CriterionConfig] = ()  # the plan's: the result's `evaluation.comparisons`
    backend: str = ""  # for the report's title


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
    capacity_policy: WaitPolicy | None = None,
    registry: ClientRegistry | None = None,
    stop_after: Callable[[int], None] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    tag: str = "cmp",
    base_model: str | None = None,
    schedule_source: str = "given",
    guard: WallGuard | None = None,
) -> ComparisonResult:
    """Run (or continue, `resume_run_id`) the paired comparison. A stop (wall
    guard, optimizer mismatch, an unusable response, capacity, a service stop, StopRequested)
    returns a failed / inconclusive / incomplete_execution final with the reason."""
    if plan.run is None:
        raise ComparisonError(f"plan {plan.name}: a {plan.kind} plan has no paired comparison")
    run, state_root = plan.run, Path(state_root)
    with Watchdog(progress, every_s=PROGRESS_EVERY_S) as dog:  # no phase is silent for longer
        progress = dog.say
        # a rehearsal plan, or a served model that is not the plan's (evidence.backend.ServedModel)
        rehearsal = plan.kind == "rehearsal" or session_served(bundle.result, plan.planned_model).rehearsal
        block = backend_of(bundle.result)  # kind `local`: the embedded server answered, whatever --backend said
        evaluator = frozen_evaluator(
            plan, bundle, embedded=backend == "local" or (block is not None and block.kind == "local")
        )
        state = _run_state(plan, bundle, evaluator.evaluator_id, restoration, state_root, resume_run_id)
        if state.resumed:  # the preflight and gate of the run, hash-verified, and where this session starts
            reuse_setup(bundle, state)
        spath = state_path(state_root, state.run_id)
        if rehearsal:  # the pipeline is rehearsed on a stand-in; the hypothesis is not tested
            bundle.update_result(
                original_hypothesis_tested=False,
                tested_instead=(
                    f"offline rehearsal of the paired-comparison pipeline under {plan.name} on the embedded server's "
                    f"stand-in model ({run.base_model}); declared differences from the spec are recorded as deviations"
                ),
            )
        progress(f"[comparison] schedule {schedule} ({schedule_source})")

        waiter = getattr(service_client, "waiter", None)
        tracker = waiter.tracker if waiter is not None else CapacityTracker()  # the session's: its window widens
        tracker.comparison_steps_completed = min(s.steps_done for s in state.arms.values())

        def call(fn: Callable[[], T]) -> T:
            return call_with_capacity_retry(
                fn,
                policy=capacity_policy or WaitPolicy(),
                steps_completed=tracker,
                registry=registry,
            )

        arms = Arms(service_client, bundle, run, state, spath, save_every, tag, progress)
        train = dataset.get(run.dataset).load_split("train", seed=run.seed)
        renderer = tokenizer.make_renderer().renderer
        stopped: str | None = None
        capacity_block: JsonObject | None = None
        try:
            arms.open(restoration, call)
            state.save(spath)
            if waiter is not None:  # a lost arm is replaced once from its last save, not the end of the run
                waiter.replaces_lost = lambda lost: arms.arm_of(lost) is not None
            step = min(s.steps_done for s in state.arms.values())
            while step < run.rollout_steps:
                try:
                    stopped = guard.check(step) if guard is not None else None
                    if stopped is not None:
                        progress(f"[comparison] {stopped}")
                        break
                    t_step = guard.clock() if guard is not None else 0.0
                    progress(
                        f"[comparison] training rollout step {step + 1} of {run.rollout_steps} ({', '.join(a.name for a in run.arms)})"
                    )
                    items = train.batch(step, run.groups_per_batch)
                    # arm after arm, each committed before the next starts (after a stop, one may be a step ahead)
                    for name in [a.name for a in run.arms if state.arms[a.name].steps_done <= step]:
                        arms.commit(name, arms.step_with_retry(name, step, items, renderer, call), tracker)
                    if guard is not None:
                        guard.step_seconds.append(guard.clock() - t_step)
                    if stop_after is not None:
                        stop_after(step + 1)
                    step += 1
                except ModelLost as lost:
                    if arms.arm_of(lost) is None:
                        if waiter is not None:
                            waiter.stop(lost)  # recorded as the run's stop, clients released
                        raise
                    arms.replace_lost(lost)
                    step = min(s.steps_done for s in state.arms.values())
        except StopRequested as stop:
            stopped = str(stop) or "stop requested"
        except CapacityExhausted as exc:
            capacity_block = exc.block.as_dict()
            stopped = f"capacity: {exc}"
        except ServiceStopped as exc:  # a hang (or any other stop): the training so far is registered all the same
            progress(f"[comparison] stopped: {exc.line}")
            stopped = f"{exc.kind}: {exc.line}"
        except Exception as exc:  # never a crash mid-run: stop with the evidence so far and the reason
            if isinstance(exc, OptimizerMismatch):  # the check that stopped it, posted
                bundle.update_result(initialization_provenance={"arms": {exc.arm: exc.provenance}})
            stopped = f"{type(exc).__name__}: {error_text(exc)}"[:500]
            progress(f"[comparison] stopped: {stopped}")
        finally:
            if waiter is not None:
                waiter.replaces_lost = None
        steps_completed = min(s.steps_done for s in state.arms.values())

        state.save(spath)
        manifest = {
            "run_id": state.run_id,
            "resumed_sessions": state.resumed,
            "sessions": state.sessions,
            "resumes": state.resumes,
            "save_every": save_every,
            "schedule": schedule,
            "schedule_source": schedule_source,
            "rehearsal": rehearsal,
            "state_file": str(spath),
            "evaluator_id": evaluator.evaluator_id,
            "code_revision": state.code_revision,
            "plan": {"name": plan.name, "kind": plan.kind, "sha256": plan.sha256},
            "config": {**run.as_json(), "save_every": save_every},
        }
        training: JsonObject = {
            "schedule": schedule,
            "schedule_source": schedule_source,
            "stopped": stopped,
            "steps_completed": steps_completed,
            "wall_guard": guard.as_dict() if guard is not None else None,
        }
        end_state = {**state.to_json(), "training": training}
        trained = ComparisonResult(
            state.run_id, tuple(state.rows), steps_completed, schedule, stopped, capacity_block, manifest, end_state
        )
        if stopped is not None:
            final = _final(plan, bundle, steps_completed, stopped=stopped, capacity_block=capacity_block)
            return replace(trained, final=final)

        results: list[EvalResult] = []
        trained = replace(trained, evaluator=evaluator, criteria=run.criteria, backend=backend)
        try:
            decision, metrics = evaluate_and_decide(
                service_client, run, state, evaluator, bundle, rehearsal, progress, base_model, results
            )
        except BaseException:  # a stop while evaluating: the training and the models scored so far are written still
            write_comparison(bundle, replace(trained, evaluated=tuple(results)))
            raise
        final = _final(plan, bundle, steps_completed, results=results, decision=decision, rehearsal=rehearsal)
        return replace(trained, final=final, evaluated=tuple(results), decision=decision, decision_metrics=metrics)


# ---- the arms ---------------------------------------------------------------------------------


@dataclass
class Arms:
    """The arms' live training clients, replaced by a restore (a retry from a step's start, a lost
    model), and each arm's loss and recorder."""

    service_client: tinker.ServiceClient
    bundle: EvidenceBundle
    run: RunConfig
    state: RunState
    spath: Path  # the run state file, saved after every row
    save_every: int  # each arm's state is saved every this many steps, and after its last
    tag: str  # the names this run gives its saves on the service (immutable there)
    progress: Callable[[str], None]
    clients: dict[str, tinker.TrainingClient] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.losses = {a.name: make_loss(a, self.run) for a in self.run.arms}

    def open(self, restoration: RestorationResult | None, call: Callable[[Callable[[], Any]], Any]) -> None:
        """The arms' clients: the preflight's, loaded from the shared initial checkpoint, or on a
        resume each arm's from the state every arm saved last (step 0: the initial checkpoint)."""
        state = self.state
        if not state.resumed:
            assert restoration is not None
            self.clients.update({a.name: restoration.clients[a.name] for a in self.run.arms})
        else:
            prov_arms = {}
            for a in self.run.arms:
                path = state.arms[a.name].state_path or state.initial_checkpoint
                restore_one = partial(
                    restore_arm, self.service_client, state, self.run, a.name, path, self.bundle.journal
                )
                self.clients[a.name], prov_arms[a.name] = call(restore_one)
            self.bundle.update_result(initialization_provenance={"arms": prov_arms})

    def step_with_retry(
        self,
        name: str,
        step: int,
        items: Sequence[Gsm8kItem],
        renderer: renderers.Renderer,
        call: Callable[[Callable[[], StepRowJson]], StepRowJson],
    ) -> StepRowJson:
        """One arm-step through the capacity retry, which never applies an update twice.

        An attempt refused after it sent a minibatch update leaves the arm part-way through the
        step: before the next attempt the arm is restored (a new client) from its saved state at
        the step's start, weights + optimizer, so the redo samples from the same weights with the
        same seeds and applies exactly `updates_per_batch` updates. An attempt refused before any
        update is retried as is. Every refused attempt is kept in the arm's `step_retries`."""
        arm = self.state.arms[name]
        start_state = (  # the tinker:// state the step starts from (None: none saved there)
            arm.state_path
            if arm.state_path is not None and arm.state_step == arm.steps_done
            else (self.state.initial_checkpoint if arm.steps_done == 0 else None)
        )
        failures: list[StepRetry] = []

        def attempt() -> StepRowJson:
            if failures and failures[-1]["updates_sent_before_failure"] and failures[-1]["restored_from"] is None:
                if start_state is None:
                    raise ComparisonError(
                        f"{name} step {step}: refused after it sent updates, and no state was saved at the step's "
                        f"start (save_every > 1), so a retry would apply updates twice; continue with --resume "
                        f"from the last saved state"
                    )
                self.restore_mid_step(name, start_state, failures[-1])
                failures[-1]["restored_from"] = start_state
            sent = ArmStepProgress()
            try:
                client, arm_config, loss = self.clients[name], self.run.arm(name), self.losses[name]
                return run_arm_step(
                    client,
                    arm_config,
                    self.run,
                    step,
                    items,
                    renderer,
                    loss,
                    f"{self.tag}-{self.state.run_id}-r{self.state.resumed}",  # the names of its samplers
                    attempt=len(failures),
                    progress=sent,
                )
            except Exception as exc:
                failures.append(
                    {
                        "step": step,
                        "attempt": len(failures),
                        "error": f"{type(exc).__name__}: {exc}"[:500],
                        "updates_sent_before_failure": sent.updates_submitted,
                        "restored_from": None,
                    }
                )
                raise

        try:
            row = call(attempt).copy()
        finally:
            arm.step_retries.extend(failures)
        row["retries"] = len(failures)
        return row

    def restore_mid_step(self, name: str, path: str, failure: StepRetry) -> None:
        """A refused attempt sent updates: back to the step's start before the retry."""
        self.progress(
            f"[comparison] {name} step {failure['step'] + 1}: refused after "
            f"{failure['updates_sent_before_failure']} update(s) ({failure['error'][:120]}); restoring "
            f"{path} (weights + optimizer) before the retry"
        )
        self._restore(name, path)

    def arm_of(self, lost: ModelLost) -> str | None:
        """The arm whose current client is the lost model, if it has not lost one before (the one
        replacement an arm gets); None otherwise: the loss stops the run."""
        for name, client in self.clients.items():
            if str(client.model_id) == lost.model_id and not self.state.arms[name].lost_models:
                return name
        return None

    def replace_lost(self, lost: ModelLost) -> None:
        """The service lost an arm's model: a new client loaded from the arm's last save (its initial
        checkpoint before any), the load observed and counted like any restore; the arm's steps after
        that save are trained again, their rows dropped so each step is kept once."""
        name = self.arm_of(lost)
        if name is None:
            raise lost
        arm = self.state.arms[name]
        path, at = (
            (arm.state_path, arm.state_step) if arm.state_path is not None else (self.state.initial_checkpoint, 0)
        )
        self.progress(f"[comparison] {lost.line}; replacing {name} from {path} (step {at}), trained again from there")
        arm.lost_models.append({"model_id": lost.model_id, "call": lost.call, "error": lost.text,
                                "at_steps_done": arm.steps_done, "replaced_from": path, "replaced_from_step": at})  # fmt: skip
        self.state.rows = [r for r in self.state.rows if r["arm"] != name or r["step"] < at]
        arm.steps_done = at  # the loaded state's step: the restore is recorded there
        self._restore(name, path)
        self.state.save(self.spath)

    def _restore(self, name: str, path: str) -> None:
        self.clients[name], prov = restore_arm(
            self.service_client, self.state, self.run, name, path, self.bundle.journal
        )
        self.bundle.update_result(initialization_provenance={"arms": {name: prov}})

    def commit(self, name: str, row: StepRowJson, tracker: CapacityTracker) -> None:
        """A finished arm-step: steps done, the state saved at a save step, the row kept, journaled and
        posted; at a save every arm made, the run state journaled with a snapshot; the capacity window
        widened once per step; the arm finalized after its last step (final sampler weights + state,
        checkpoint URIs, metrics)."""
        state, run, bundle = self.state, self.run, self.bundle
        arm = state.arms[name]
        arm.steps_done = row["step"] + 1
        if arm.steps_done % self.save_every == 0 or arm.steps_done == run.rollout_steps:
            saved = self.clients[name].save_state(
                f"{self.tag}-{state.run_id}-{name}-step{arm.steps_done}-r{state.resumed}"
            )
            arm.record_save(state.run_id, arm.steps_done, saved.result().path)
        state.rows.append(row)
        bundle.journal.append("comparison", "row", f"{name}-s{row['step']}", ins.nan_free(row))  # NaN as null
        state.save(self.spath)
        done = arm.steps_done
        if all(str(done) in s.saves and s.steps_done == done for s in state.arms.values()):
            # Every arm saved this step: the resume point, journaled as it is saved, and a snapshot.
            bundle.journal.append("comparison", "state", f"s{done}", state.to_json())
            bundle.journal.snapshot("comparison", f"comparison step {done} saved")
        arm_rows = [r for r in state.rows if r["arm"] == name]
        bundle.post_arm_metrics(name, arm_summary(arm_rows))
        if all(s.steps_done > row["step"] for s in state.arms.values()) and tracker() <= row["step"]:
            tracker.step_done()  # once per step, a step an arm trained again included
        if arm.steps_done == run.rollout_steps:
            sampler = self.clients[name].save_weights_for_sampler(f"{self.tag}-{state.run_id}-{name}-final")
            arm.final_sampler, arm.final_state = sampler.result().path, arm.state_path
            if arm.final_state:
                bundle.add_checkpoint(name, arm.steps_done, arm.final_state)
            bundle.add_checkpoint(name, arm.steps_done, arm.final_sampler)
            bundle.post_arm_metrics(name, arm_summary(arm_rows), completed=True)
            state.save(self.spath)
        self.progress(step_line(row, run.rollout_steps))


def restore_arm(
    service_client: tinker.ServiceClient, state: RunState, run: RunConfig, name: str, path: str, journal: Journal
) -> tuple[tinker.TrainingClient, JsonObject]:
    """A new training client for arm `name` from its saved state `path` (`train.restore.restore`,
    weights + optimizer, the load observed), counted: one more restore_count and optimizer check on
    top of the preflight's. The run state with the load's response is journaled first, and the check
    names that entry. Returns (client, provenance entry). A check that finds the server's optimizer
    differs from the request stops the run (OptimizerMismatch, after the check is recorded in the state)."""
    arm = state.arms[name]
    restored = restore(service_client, path, name)
    mismatch = restored.mismatch()
    if mismatch is not None:
        raise ComparisonError(f"{name}: {mismatch}")
    client, loaded = restored.client, restored.loaded_path
    # raw: tinker 0.25's parsed get_info (`restored.info`) drops the server's optimizer_config
    info = server_info(service_client, client)
    arm.restore_count += 1
    load = {
        "loaded_checkpoint_uri": loaded,
        "at_step": arm.steps_done,
        "load_response": dump_response(restored.response),
    }
    arm.optimizer_checks.append(load)
    entry = journal.append("comparison", "state", f"{name}-restore{arm.restore_count}", state.to_json())
    prior = state.setup_provenance[name]  # every arm's, from the preflight
    check = optimizer_check(
        after_restore=prior["restore_count"] + arm.restore_count,
        requested_optimizer="adam",
        requested_config=run.arm(name).adam_config_requested(),
        info=info,
        info_ref=entry.ref,
        echoed=None,
        echo_ref=None,
        echo_observed_on=None,
    )
    arm.optimizer_checks[-1] = {**check, **load}
    prov: JsonObject = {
        "restore_count": prior["restore_count"] + arm.restore_count,
        # The checkpoint this session's arm actually loaded (the server's own load response).
        "loaded_checkpoint_uri": loaded,
        "loaded_at_step": arm.steps_done,
        "optimizer_checks": list(prior["optimizer_checks"])
        + [{k: v for k, v in c.items() if k != "load_response"} for c in arm.optimizer_checks],
    }
    if check["mismatches"]:  # a restored optimizer that differs from the request stops the run
        raise OptimizerMismatch(
            f"{name}: optimizer mismatch after restore {check['after_restore']} "
            f"({path}): " + "; ".join(check["mismatches"]),
            name,
            prov,
        )
    return client, prov


def run_arm_step(
    client: tinker.TrainingClient,
    arm: ArmConfig,
    run: RunConfig,
    step: int,
    items: Sequence[Gsm8kItem],
    renderer: renderers.Renderer,
    loss: tuple[losses.CustomLossFn, ins.LossCallRecorder],
    tag: str,
    *,
    attempt: int = 0,
    progress: ArmStepProgress | None = None,
) -> StepRowJson:
    """One rollout step of one arm (`arm_step.run_arm_step`, the gate pilot's too) from the step's
    seed, and its row. `progress.updates_submitted` counts updates sent (so a failed attempt says
    whether it moved the arm)."""
    t0 = time.perf_counter()
    retry = f"-retry{attempt}" if attempt else ""  # sampler names are immutable on the service
    sampled, records = arm_step.run_arm_step(
        client,
        arm,
        run,
        loss,
        step,
        items,
        renderer,
        seed=step_seed(run, step),
        sampler_name=f"{tag}-{arm.name}-s{step}{retry}",
        progress=progress,
    )
    return step_metrics(
        arm.name,
        step,
        sampled.batch.summary(),
        records,
        loss=arm.loss,
        seconds=time.perf_counter() - t0,
        sample_seconds=sampled.seconds,
        sampler_checkpoint=sampled.sampler_path,
        kl=kl_sample_train(records),
        cookbook_env=trajectory_metrics(sampled.batch),
        rollout_seconds=sampled.batch.sampling_seconds + sampled.batch.grading_seconds,
    )


# ---- the run state, new or resumed --------------------------------------------------------------


def _run_state(
    plan: Plan,
    bundle: EvidenceBundle,
    evaluator_id: str,
    restoration: RestorationResult | None,
    state_root: Path,
    resume_run_id: str | None,
) -> RunState:
    """A new run's state (locked to this session, its setup the result snapshot journaled as it
    starts), or the resumed run's, checked and rewound to the last step every arm saved."""
    assert plan.run is not None
    # the package's sources and the data it carries (vendored GSM8K, the stand-in's assets): what a resume must match
    run, code_rev = plan.run, package_files_sha256(Path(dppo_harness.__file__).parent)
    session = {"run_id": bundle.run_id, "dir": str(bundle.dir.resolve())}
    if resume_run_id is not None:
        return open_resumed(
            state_root,
            resume_run_id,
            plan_sha256=plan.sha256,
            evaluator_id=evaluator_id,
            code_rev=code_rev,
            steps=run.rollout_steps,
            session=session,
        )
    if restoration is None:
        raise ComparisonError("a new comparison starts from the restoration preflight's result (none given)")
    hold_run_lock(state_root, bundle.run_id, what=f"comparison run {bundle.run_id}")
    prov = restoration.provenance["arms"]  # what the preflight's load counted (later restores count on from it)
    return RunState(
        run_id=bundle.run_id,
        plan_sha256=plan.sha256,
        evaluator_id=evaluator_id,
        code_revision=code_rev,
        initial_checkpoint=restoration.initial_checkpoint,
        arms={a.name: ArmState(a.name) for a in run.arms},
        sessions=[session],
        setup_snapshot=snapshot_ref(bundle.run_id, bundle.journal.snapshot("comparison", "comparison setup")),
        setup_provenance={
            a.name: {k: as_value(prov[a.name][k]) for k in ("restore_count", "optimizer_checks")} for a in run.arms
        },
    )


# ---- the result's final ---------------------------------------------------------------------


def _final(
    plan: Plan,
    bundle: EvidenceBundle,
    steps_completed: int,
    *,
    stopped: str | None = None,
    capacity_block: JsonObject | None = None,
    results: Sequence[EvalResult] = (),
    decision: Mapping[str, Any] | None = None,
    rehearsal: bool = False,
) -> JsonObject:
    """The result's `final`, at most two plain sentences (the details are in report.md): a run that
    stopped before every arm finished failed with nothing compared; a finished one has the verdict."""
    run = plan.spec_run
    if stopped is not None or decision is None:
        final: JsonObject = {
            "status": "failed",
            "verdict": "inconclusive",
            "outcome_reason": "incomplete_execution",
            "summary": (
                f"The paired comparison under {plan.name} stopped after {steps_completed} of "
                f"{run.rollout_steps} rollout steps per arm, before evaluation, so nothing was compared: "
                + str(stopped).replace(". ", "; ").rstrip(".")
                + "."
            ),
        }
        if bundle.result.get("original_hypothesis_tested") is None:
            final.update(
                original_hypothesis_tested=False,
                tested_instead="nothing: the paired comparison stopped before any evaluation",
            )
        if capacity_block is not None:
            final["capacity_block"] = capacity_block
        return final
    acc = ", ".join(f"{res.arm} {res.accuracy:.3f}" for res in results)
    diffs = "; ".join(
        f"{c['treatment']} minus {c['baseline']} {c['mean_difference']:.4g} with "
        f"{100 * (1 - c['alpha']):g}% paired Hoeffding CI [{c['lower']:.4g}, {c['upper']:.4g}]"
        for c in decision["criteria"]
    )
    block = backend_of(bundle.result)
    served = (block.served_model if block is not None else None) or run.base_model
    return {
        "status": "succeeded",
        "verdict": decision["verdict"],
        "outcome_reason": decision["outcome_reason"],
        "summary": (
            f"Paired comparison under {plan.name} ({steps_completed}/{run.rollout_steps} rollout steps per "
            f"arm): greedy accuracy on {run.eval_items} test items {acc}, {diffs}, verdict {decision['verdict']} "
            f"({decision['outcome_reason']})."
            + (
                f" It is a rehearsal on the stand-in model {served}, not a test of the hypothesis on "
                f"{plan.planned_model}."
                if rehearsal
                else ""
            )
        ),
    }

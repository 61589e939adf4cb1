"""The comparison run's named steps, in the order `run.run_comparison` takes them.

prepare the run state (new, or a resume checked and rewound to the last common save) -> post
the setup a resume takes over -> open the session (capacity tracker, cookbook metrics log) and
register the run manifest -> train both arms (each committed row logged, state saved, the arm
finalized after its last step; any stop leaves the evidence so far) -> register the training's
end (steps JSONL, metrics logs, end state) -> the final result of a stopped or a finished run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dppo_harness.data import dataset, tokenizer
from dppo_harness.evidence import budget
from dppo_harness.evidence.backend import backend_of
from dppo_harness.evidence.snapshots import post_snapshot
from dppo_harness.instrument import cookbook_metrics
from dppo_harness.json_types import JsonObject, as_value
from dppo_harness.service.capacity import call_with_capacity_retry, error_text
from dppo_harness.service.release import ClientRegistry
from dppo_harness.service.wait.policy import (
    CapacityExhausted,
    CapacityPolicy,
    CapacityTracker,
    ModelLost,
    ServiceStopped,
)
from dppo_harness.stages.comparison.arms import ArmRunner, TrainingOutcome, make_runners, train_arms
from dppo_harness.stages.comparison.config import (
    ArmOrder,
    ComparisonConfig,
    ComparisonError,
    OptimizerMismatch,
)
from dppo_harness.stages.comparison.restore import open_arms, restore_arm
from dppo_harness.stages.comparison.resume import checkpoint_problems, latest_snapshot, reuse_setup
from dppo_harness.stages.comparison.state import (
    STEPS_FILE,
    ArmState,
    RunState,
    StepRetry,
    code_revision,
    hold_run_lock,
    load_owned_state,
    resume_problems,
    rewind_to_common_save,
    state_file_name,
    state_path,
)
from dppo_harness.stages.comparison.step_rows import StepRowJson, arm_summary, jsonl
from dppo_harness.stages.comparison.wall_guard import WallGuard

if TYPE_CHECKING:
    import tinker

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import Plan
    from dppo_harness.stages.restoration import RestorationResult

T = TypeVar("T")


def prepare_state(
    plan: Plan,
    bundle: EvidenceBundle,
    cfg: ComparisonConfig,
    evaluator_id: str,
    restoration: RestorationResult | None,
    state_root: Path,
    resume_run_id: str | None,
) -> RunState:
    code_rev = code_revision()
    session = {"run_id": bundle.run_id, "dir": str(bundle.dir.resolve())}
    if resume_run_id is None:
        if restoration is None:
            raise ComparisonError("a new comparison starts from the restoration preflight's result (none given)")
        hold_run_lock(state_root, bundle.run_id, what=f"comparison run {bundle.run_id}")
        return RunState(
            run_id=bundle.run_id,
            plan_sha256=plan.sha256,
            evaluator_id=evaluator_id,
            code_revision=code_rev,
            initial_checkpoint=restoration.initial_checkpoint,
            arms={a.name: ArmState(a.name) for a in cfg.arms},
            sessions=[session],
            setup_snapshot=latest_snapshot(bundle),
            setup_provenance=setup_provenance(restoration, cfg),
        )
    path = state_path(state_root, resume_run_id)
    if not path.is_file():
        raise ComparisonError(f"--resume {resume_run_id}: no saved comparison state at {path}")
    hold_run_lock(state_root, resume_run_id, what=f"--resume {resume_run_id}")
    state = load_owned_state(state_root, resume_run_id)
    problems = resume_problems(state, plan_sha256=plan.sha256, evaluator_id=evaluator_id, code_rev=code_rev)
    problems += checkpoint_problems(state)  # before the rewind picks a checkpoint to reuse
    if problems:
        raise ComparisonError(f"--resume {resume_run_id} refused: " + "; ".join(problems))
    if not state.setup_provenance and restoration is not None:  # a state saved before it was kept
        state.setup_provenance = setup_provenance(restoration, cfg)
    continued = state.sessions[-1]["run_id"] if state.sessions else state.run_id
    from_step = rewind_to_common_save(state, cfg.steps)
    state.resumed += 1
    state.resumes.append({"session": bundle.run_id, "continues_session": continued, "from_step": from_step})
    state.sessions.append(session)
    return state


def setup_provenance(restoration: RestorationResult, cfg: ComparisonConfig) -> JsonObject:
    """Per arm, what the preflight's load counted (later restores count on from it)."""
    return {
        a.name: {k: as_value(restoration.provenance["arms"][a.name][k]) for k in ("restore_count", "optimizer_checks")}
        for a in cfg.arms
    }


def kept_slots(cfg: ComparisonConfig, restores_left: int) -> int:
    """File slots the comparison keeps free beyond the closing records' (budget.comparison_reserve)."""
    return budget.comparison_reserve(len(cfg.arms), restores_left)


def register_saved_state(bundle: EvidenceBundle, state: RunState, step: int, kept: int) -> str | None:
    """The run state at a save every arm made, as an evidence file, unless only the `kept` slots
    for the evaluation, report and restores are left (then the ledger says so; the state file itself is kept)."""
    name = state_file_name(state, f"s{step}")
    if bundle.free_slots() - 1 < kept:
        skipped = list(bundle.ledger().get("comparison_states_not_registered", []))
        bundle.note_ledger(
            comparison_states_not_registered=[
                *skipped,
                {
                    "name": name,
                    "reason": f"file limit: {len(bundle.files())} files used, {bundle.free_slots()} free, "
                    f"{kept} kept for the evaluation, report and restores",
                },
            ]
        )
        return None
    bundle.register_json(name, "manifest", state.to_json())
    return name


def register_steps(bundle: EvidenceBundle, state: RunState) -> str:
    name = f"{STEPS_FILE.removesuffix('.jsonl')}-{state.resumed}.jsonl" if state.resumed else STEPS_FILE
    bundle.register_bytes(name, "metrics", jsonl(state.rows))
    return name


def metrics_name(arm: str, state: RunState) -> str:
    """The bundle name of an arm's cookbook `metrics.jsonl` (a resumed session's own copy gets -rN)."""
    return f"metrics-{arm}-r{state.resumed}.jsonl" if state.resumed else f"metrics-{arm}.jsonl"


def register_cookbook_metrics(
    bundle: EvidenceBundle, state: RunState, mlog: cookbook_metrics.ArmMetricsLog
) -> list[str]:
    """Each arm's ml_log `metrics.jsonl`, as written (every step of the run so far, resumed sessions
    included), registered as kind metrics."""
    names = []
    for arm in state.arms:
        path = mlog.path(arm)
        if path.is_file():
            name = metrics_name(arm, state)
            bundle.register_file(name, "metrics", path)
            names.append(name)
    return names


def finalize_arm(
    client: tinker.TrainingClient,
    arm: str,
    state: RunState,
    bundle: EvidenceBundle,
    by_arm: Mapping[str, list[StepRowJson]],
    tag: str,
) -> None:
    """After an arm's last step: final sampler weights + state, checkpoint URI, completed_arms, metrics."""
    s = state.arms[arm]
    s.final_sampler = client.save_weights_for_sampler(f"{tag}-{state.run_id}-{arm}-final").result().path
    s.final_state = s.state_path
    if s.final_state:
        bundle.add_checkpoint(arm, s.steps_done, s.final_state)
    bundle.add_checkpoint(arm, s.steps_done, s.final_sampler)
    bundle.post_arm_metrics(arm, arm_summary(by_arm[arm]), completed=True)


def post_reused_setup(bundle: EvidenceBundle, state: RunState) -> None:
    """A resume: the preflight and gate of the run, hash-verified, and where this session starts."""
    reused = reuse_setup(bundle, state)
    bundle.update_result(**reused.blocks)
    bundle.update_result(
        initialization_provenance={
            "resume": {
                "comparison_run": state.run_id,
                "resumed_times": state.resumed,
                "from_step": state.resumes[-1]["from_step"],
                "continues_session": reused.continued,
                "evidence_ref": reused.manifest,
            }
        }
    )


@dataclass
class RunSession:
    """One session's work on the run: its clients, capacity retry, metrics log and evidence; its
    methods are what `train_arms` calls back (capacity retry, save, restore mid-step, each row)."""

    service_client: tinker.ServiceClient
    bundle: EvidenceBundle
    cfg: ComparisonConfig
    state: RunState
    spath: Path  # the run state file, saved after every row
    tracker: CapacityTracker
    mlog: cookbook_metrics.ArmMetricsLog
    tag: str
    progress: Callable[[str], None]
    capacity_policy: CapacityPolicy | None = None
    registry: ClientRegistry | None = None
    clients: dict[str, tinker.TrainingClient] = field(default_factory=dict)
    by_arm: dict[str, list[StepRowJson]] = field(default_factory=dict)
    restores_left: int = -1  # mid-step restore states the budget keeps slots for (-1: per arm, set on first use)

    def _take_restore_slot(self, what: str) -> None:
        """One evidence slot for the run state of a restore in the run (kept per arm in the budget)."""
        reserved = self._restore_slots_left()
        if reserved == 0 and self.bundle.free_slots() - 1 < kept_slots(self.cfg, 0):
            raise ComparisonError(
                f"{what}: no evidence file slot left for the run state of another restore "
                f"({budget.MID_STEP_RESTORES_PER_ARM} per arm were kept); "
                "resume the run (--resume) to continue from its last save"
            )
        self.restores_left = max(0, reserved - 1)

    def _restore_slots_left(self) -> int:
        if self.restores_left < 0:
            self.restores_left = budget.MID_STEP_RESTORES_PER_ARM * len(self.cfg.arms)
        return self.restores_left

    def call(self, fn: Callable[[], T]) -> T:
        return call_with_capacity_retry(
            fn,
            policy=self.capacity_policy or CapacityPolicy(),
            steps_completed=self.tracker,
            registry=self.registry,
            on_retry=self.tracker.events.append,
        )

    def restore_mid_step(self, runner: ArmRunner, path: str, failure: StepRetry) -> ArmRunner:
        """A refused attempt sent updates: back to the step's start before the retry (inside `call`)."""
        name = runner.spec.name
        self.progress(
            f"[comparison] {name} step {failure['step'] + 1}: refused after "
            f"{failure['updates_sent_before_failure']} update(s) ({failure['error'][:120]}); restoring "
            f"{path} (weights + optimizer) before the retry"
        )
        ref = state_file_name(self.state, f"{name}-s{failure['step']}-a{failure['attempt']}")
        self._take_restore_slot(f"{name} step {failure['step'] + 1}")
        client, prov = restore_arm(self.service_client, self.state, self.cfg, name, path, ref)
        self.clients[name] = client
        self.bundle.register_json(ref, "manifest", self.state.to_json())
        self.bundle.update_result(initialization_provenance={"arms": {name: prov}})
        return dataclasses.replace(runner, client=client)

    def arm_of(self, lost: ModelLost) -> str | None:
        """The arm whose current client is the lost model, if it has not lost one before (the one
        replacement an arm gets); None otherwise: the loss stops the run."""
        for name, client in self.clients.items():
            if str(getattr(client, "model_id", "")) == lost.model_id and not self.state.arms[name].lost_models:
                return name
        return None

    def replace_lost_arm(self, lost: ModelLost) -> None:
        """The service lost an arm's model: a new client loaded from the arm's last save (its initial
        checkpoint before any), the load observed and counted like any restore; the arm's steps after
        that save are trained again, their rows and logged metrics dropped so each step is kept once."""
        name = self.arm_of(lost)
        if name is None:
            raise lost
        arm = self.state.arms[name]
        path, at = (
            (arm.state_path, arm.state_step) if arm.state_path is not None else (self.state.initial_checkpoint, 0)
        )
        self._take_restore_slot(f"{name}: replacing the lost model")  # before anything changes
        self.progress(f"[comparison] {lost.line}; replacing {name} from {path} (step {at}), trained again from there")
        ref = state_file_name(self.state, f"{name}-lost-s{arm.steps_done}")
        arm.lost_models.append({"model_id": lost.model_id, "call": lost.call, "error": lost.text,
                                "at_steps_done": arm.steps_done, "replaced_from": path, "replaced_from_step": at})  # fmt: skip
        self.state.rows = [r for r in self.state.rows if r["arm"] != name or r["step"] < at]
        self.by_arm[name] = [r for r in self.by_arm[name] if r["step"] < at]
        cookbook_metrics.drop_logged_steps(self.mlog.path(name), at)
        arm.steps_done = at  # the loaded state's step: the restore is recorded there
        client, prov = restore_arm(self.service_client, self.state, self.cfg, name, path, ref)
        self.clients[name] = client
        self.state.save(self.spath)
        self.bundle.register_json(ref, "manifest", self.state.to_json())
        self.bundle.update_result(initialization_provenance={"arms": {name: prov}})

    def save_arm_state(self, runner: ArmRunner, steps_done: int) -> str:
        state = self.state
        return (
            runner.client.save_state(f"{self.tag}-{state.run_id}-{runner.spec.name}-step{steps_done}-r{state.resumed}")
            .result()
            .path
        )

    def on_row(self, row: StepRowJson) -> None:
        """A committed arm-step: state saved, metrics logged and posted, a common save registered
        with a snapshot, the capacity window widened, the arm finalized after its last step."""
        state, cfg, bundle = self.state, self.cfg, self.bundle
        self.by_arm[row["arm"]].append(row)
        state.save(self.spath)
        self.mlog.log(
            row["arm"],
            cookbook_metrics.step_record(row, steps=cfg.steps, learning_rate=cfg.arm(row["arm"]).adam["learning_rate"]),
            row["step"],
        )
        done = row["step"] + 1
        if all(str(done) in s.saves and s.steps_done == done for s in state.arms.values()):
            # Every arm saved this step: the resume point, registered as it is saved, and a snapshot.
            kept = kept_slots(cfg, self._restore_slots_left())
            register_saved_state(bundle, state, done, kept)
            post_snapshot(bundle, f"comparison step {done} saved", reserve=kept + len(budget.CLOSING_RECORDS))
        bundle.post_arm_metrics(row["arm"], arm_summary(self.by_arm[row["arm"]]))
        if all(s.steps_done > row["step"] for s in state.arms.values()) and self.tracker() <= row["step"]:
            self.tracker.step_done()  # once per step, a step an arm trained again included
        arm = state.arms[row["arm"]]
        if arm.steps_done == cfg.steps:
            finalize_arm(self.clients[row["arm"]], row["arm"], state, bundle, self.by_arm, self.tag)
            state.save(self.spath)


def open_session(
    service_client: tinker.ServiceClient,
    plan: Plan,
    bundle: EvidenceBundle,
    cfg: ComparisonConfig,
    state: RunState,
    state_root: Path,
    *,
    tag: str,
    progress: Callable[[str], None],
    capacity_policy: CapacityPolicy | None,
    registry: ClientRegistry | None,
    wandb: cookbook_metrics.WandbRequest | None,
) -> RunSession:
    """The session's capacity tracker (the session waiter's when there is one: its capacity window
    widens after the first step too) and its cookbook metrics log."""
    waiter = getattr(service_client, "waiter", None)
    tracker = waiter.tracker if waiter is not None else CapacityTracker()
    tracker.comparison_steps_completed = min(s.steps_done for s in state.arms.values())
    mlog = cookbook_metrics.ArmMetricsLog(
        state_root / state.run_id / "cookbook-metrics",
        [a.name for a in cfg.arms],
        run_name=state.run_id,
        wandb=wandb or cookbook_metrics.WandbRequest(None, "not requested"),
        config={"plan": plan.name, "plan_sha256": plan.sha256, "run_id": state.run_id, **asdict(cfg)},
    )
    if state.resumed:  # the steps after the common save are trained again: logged once, as without the kill
        mlog.drop_steps_from(int(state.resumes[-1]["from_step"]))
    for problem in mlog.status["wandb"]["problems"]:
        progress(f"[comparison] W&B not used: {problem} (the metrics.jsonl logs go on)")
    return RunSession(
        service_client,
        bundle,
        cfg,
        state,
        state_path(state_root, state.run_id),
        tracker,
        mlog,
        tag,
        progress,
        capacity_policy,
        registry,
    )


def register_run_manifest(
    session: RunSession, plan: Plan, *, schedule: ArmOrder, schedule_source: str, rehearsal: bool, evaluator_id: str
) -> None:
    """`comparison-run-N.json`: the run, its sessions and resumes, schedule, state file, evaluator,
    code revision, plan, config and where the cookbook metrics are; a rehearsal says what it tests."""
    state, cfg, mlog, bundle = session.state, session.cfg, session.mlog, session.bundle
    bundle.register_json(
        f"comparison-run-{state.resumed}.json",
        "manifest",
        {
            "run_id": state.run_id,
            "resumed_sessions": state.resumed,
            "sessions": state.sessions,
            "resumes": state.resumes,
            "save_every": cfg.save_every,
            "schedule": schedule,
            "schedule_source": schedule_source,
            "rehearsal": rehearsal,
            "state_file": str(session.spath),
            "evaluator_id": evaluator_id,
            "code_revision": state.code_revision,
            "plan": {"name": plan.name, "kind": plan.kind, "sha256": plan.sha256},
            "config": asdict(cfg),
            "cookbook_metrics": {
                **mlog.status,
                "live_files": {a.name: str(mlog.path(a.name)) for a in cfg.arms},
                "evidence_files": {a.name: metrics_name(a.name, state) for a in cfg.arms},
            },
        },
    )
    if rehearsal:  # the pipeline is rehearsed on a stand-in; the hypothesis is not tested
        bundle.update_result(
            original_hypothesis_tested=False,
            tested_instead=(
                f"offline rehearsal of the paired-comparison pipeline under {plan.name} on the embedded server's stand-in "
                f"model ({cfg.base_model}); declared differences from the spec are recorded as deviations"
            ),
        )


def _stopped(session: RunSession, schedule: ArmOrder, exc: Exception) -> TrainingOutcome:
    """Never a crash mid-run: the stop's reason, with the check that stopped it posted when it is
    an optimizer mismatch (and the run state its check references registered)."""
    bundle, state = session.bundle, session.state
    if isinstance(exc, OptimizerMismatch) and exc.provenance:
        if exc.state_file and bundle.entry(exc.state_file) is None:
            bundle.register_json(exc.state_file, "manifest", state.to_json())
        bundle.update_result(initialization_provenance={"arms": {exc.arm: exc.provenance}})
    reason = f"{type(exc).__name__}: {error_text(exc)}"[:500]
    session.progress(f"[comparison] stopped: {reason}")
    return TrainingOutcome(tuple(state.rows), min(s.steps_done for s in state.arms.values()), 0.0, schedule, reason)


def train_session(
    session: RunSession,
    restoration: RestorationResult | None,
    *,
    schedule: ArmOrder,
    stop_after: Callable[[int], None] | None,
    guard: WallGuard | None,
) -> tuple[TrainingOutcome, JsonObject | None]:
    """Open the arms and train them to the end or a stop: (outcome, capacity block if capacity
    stopped it). The metrics log is closed either way."""
    state, cfg = session.state, session.cfg
    train = dataset.get(cfg.dataset).load_split("train", seed=cfg.arms[0].seed)
    renderer = tokenizer.make_renderer().renderer
    session.by_arm = {a.name: [r for r in state.rows if r["arm"] == a.name] for a in cfg.arms}
    capacity_block: JsonObject | None = None
    waiter = getattr(session.service_client, "waiter", None)
    try:
        session.clients.update(open_arms(session.service_client, state, cfg, restoration, session.bundle, session.call))
        state.save(session.spath)
        if waiter is not None:  # a lost arm is replaced once from its last save, not the end of the run
            waiter.replaces_lost = lambda lost: session.arm_of(lost) is not None
        runners = make_runners(session.clients, cfg)
        while True:
            try:
                outcome = train_arms(
                    [dataclasses.replace(r, client=session.clients[r.spec.name]) for r in runners],
                    cfg,
                    state,
                    items_for_step=lambda s: train.batch(s, cfg.groups_per_batch),
                    renderer=renderer,
                    tag=f"{session.tag}-{state.run_id}-r{state.resumed}",
                    schedule=schedule,
                    on_row=session.on_row,
                    save_state=session.save_arm_state,
                    restore=session.restore_mid_step,
                    call=session.call,
                    stop_after=stop_after,
                    progress=session.progress,
                    guard=guard,
                )
                break
            except ModelLost as lost:
                if session.arm_of(lost) is None and waiter is not None:
                    waiter.stop(lost)  # recorded as the run's stop, clients released
                session.replace_lost_arm(lost)
    except CapacityExhausted as exc:
        capacity_block = exc.block.as_dict()
        outcome = TrainingOutcome(
            tuple(state.rows), min(s.steps_done for s in state.arms.values()), 0.0, schedule, f"capacity: {exc}"
        )
    except ServiceStopped as exc:  # a hang (or any other stop): the training so far is registered all the same
        session.progress(f"[comparison] stopped: {exc.line}")
        outcome = TrainingOutcome(
            tuple(state.rows), min(s.steps_done for s in state.arms.values()), 0.0, schedule, f"{exc.kind}: {exc.line}"
        )
    except Exception as exc:  # never a crash mid-run: stop with the evidence so far and the reason
        outcome = _stopped(session, schedule, exc)
    finally:
        if waiter is not None:
            waiter.replaces_lost = None
        session.mlog.close()
    return outcome, capacity_block


def register_training_end(
    session: RunSession, outcome: TrainingOutcome, *, schedule: ArmOrder, schedule_source: str, guard: WallGuard | None
) -> list[str]:
    """After training, stopped or not: state saved, steps JSONL, the arms' metrics logs and the
    end state (with the training's schedule, stop and wall guard) registered; their names."""
    state, bundle = session.state, session.bundle
    state.save(session.spath)
    files = [register_steps(bundle, state)]
    files += register_cookbook_metrics(bundle, state, session.mlog)
    bundle.register_json(
        state_file_name(state, "end"),
        "manifest",
        {
            **state.to_json(),
            "training": {
                "schedule": schedule,
                "schedule_source": schedule_source,
                "stopped": outcome.stopped,
                "steps_completed": outcome.steps_completed,
                "wall_guard": guard.as_dict() if guard is not None else None,
            },
        },
    )
    files.append(state_file_name(state, "end"))
    return files


def stopped_final(
    plan: Plan,
    bundle: EvidenceBundle,
    cfg: ComparisonConfig,
    outcome: TrainingOutcome,
    capacity_block: JsonObject | None,
) -> JsonObject:
    """The final of a run that stopped before every arm finished: failed, nothing compared."""
    stopped = outcome.stopped or ""
    final: JsonObject = {
        "status": "failed",
        "verdict": "inconclusive",
        "outcome_reason": "incomplete_execution",
        "summary": (
            f"The paired comparison under {plan.name} stopped after {outcome.steps_completed} of "
            f"{cfg.steps} rollout steps per arm, before evaluation, so nothing was compared: "
            + stopped.replace(". ", "; ").rstrip(".")
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


def succeeded_final(
    plan: Plan,
    bundle: EvidenceBundle,
    cfg: ComparisonConfig,
    outcome: TrainingOutcome,
    scores: list[JsonObject],
    decision: Mapping[str, Any],
    *,
    rehearsal: bool,
) -> JsonObject:
    """The final of a finished run: at most two plain sentences (the result's `final` shape); the
    details are in report.md."""
    acc = ", ".join(f"{sc['arm']} {sc['value']:.3f}" for sc in scores)
    diffs = "; ".join(
        f"{c['treatment']} minus {c['baseline']} {c['mean_difference']:.4g} with "
        f"{100 * (1 - c['alpha']):g}% paired Hoeffding CI [{c['lower']:.4g}, {c['upper']:.4g}]"
        for c in decision["criteria"]
    )
    block = backend_of(bundle.result)
    served = (block.served_model if block is not None else None) or cfg.base_model
    return {
        "status": "succeeded",
        "verdict": decision["verdict"],
        "outcome_reason": decision["outcome_reason"],
        "summary": (
            f"Paired comparison under {plan.name} ({outcome.steps_completed}/{cfg.steps} rollout steps per "
            f"arm): greedy accuracy on {cfg.eval_items} test items {acc}, {diffs}, verdict {decision['verdict']} "
            f"({decision['outcome_reason']})."
            + (
                f" It is a rehearsal on the stand-in model {served}, not a test of the hypothesis on "
                f"{plan.planned_model}."
                if rehearsal
                else ""
            )
        ),
    }

"""Training the arms: one arm-step (`arm_step.run_arm_step`, the gate pilot's too: sample from the
arm's current weights, then its minibatch updates) and its row, the guard that keeps a capacity retry from applying an update twice, and `train_arms`,
which advances every arm step by step (interleaved on one thread, or concurrently on their own
clients), saving state every `save_every` steps, so a stop leaves the arms at equal or adjacent
step counts."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tinker

from dppo_harness.instrument import cookbook_metrics
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss import losses
from dppo_harness.loss.losses import CustomLossFn
from dppo_harness.rollout import rollouts
from dppo_harness.service.wait.policy import ServiceStopped
from dppo_harness.stages import arm_step
from dppo_harness.stages.arm_step import ArmStepProgress, ArmStepRun
from dppo_harness.stages.comparison.config import ArmOrder, ArmSpec, ComparisonConfig, ComparisonError, step_seed
from dppo_harness.stages.comparison.state import ArmState, RunState, StepRetry
from dppo_harness.stages.comparison.step_rows import StepRowJson, step_line, step_metrics
from dppo_harness.stages.comparison.wall_guard import WallGuard

if TYPE_CHECKING:
    from tinker_cookbook import renderers

    from dppo_harness.data.gsm8k import Gsm8kItem


@dataclass(frozen=True)
class ArmRunner:
    """Everything one arm needs for a step; its client is its own."""

    spec: ArmSpec
    client: tinker.TrainingClient
    loss_fn: CustomLossFn
    recorder: ins.LossCallRecorder


def run_arm_step(
    runner: ArmRunner,
    step: int,
    cfg: ComparisonConfig,
    items: Sequence[Gsm8kItem],
    renderer: renderers.Renderer,
    adam: tinker.AdamParams,
    tag: str,
    *,
    attempt: int = 0,
    progress: ArmStepProgress | None = None,
) -> tuple[StepRowJson, list[ins.LossCallRecord]]:
    """One rollout step of one arm (`arm_step.run_arm_step`): sample from its current weights, then
    its minibatch updates. `progress.updates_submitted` counts updates sent (so a failed attempt says
    whether it moved the arm)."""
    t0 = time.perf_counter()
    rcfg = rollouts.RolloutConfig(
        cfg.groups_per_batch,
        cfg.group_size,
        cfg.temperature,
        cfg.max_tokens,
        seed=step_seed(cfg, step),
        max_seq_len=cfg.max_seq_len,
    )
    retry = f"-retry{attempt}" if attempt else ""  # sampler names are immutable on the service

    def context(u: int, sampler_path: str, _idx: list[int]) -> dict[str, int | str]:
        return {
            "arm": runner.spec.name,
            "step": step,
            "update_in_batch": u,
            "update_index": step * runner.spec.updates_per_batch + u,
            "sampler_checkpoint": sampler_path,
        }

    arm = ArmStepRun(runner.client, runner.loss_fn, adam, runner.recorder, runner.spec.updates_per_batch)
    done = arm_step.run_arm_step(
        arm,
        items,
        renderer,
        rcfg,
        sampler_name=f"{tag}-{runner.spec.name}-s{step}{retry}",
        context=context,
        progress=progress,
    )
    sampled, records = done.sampled, done.records
    row = step_metrics(
        runner.spec.name,
        step,
        sampled.batch.summary(),
        records,
        loss=runner.spec.loss,
        seconds=time.perf_counter() - t0,
        sample_seconds=sampled.seconds,
        sampler_checkpoint=sampled.sampler_path,
        kl=cookbook_metrics.kl_sample_train(records),
        cookbook_env=cookbook_metrics.trajectory_metrics(sampled.batch),
        rollout_seconds=sampled.batch.sampling_seconds + sampled.batch.grading_seconds,
    )
    return row.as_row(), records


RestoreFn = Callable[[ArmRunner, str, StepRetry], ArmRunner]


@dataclass
class GuardedArmStep:
    """One arm-step as the capacity retry calls it: a retry never applies an update twice.

    An attempt refused after it sent a minibatch update leaves the arm's weights and optimizer
    part-way through the step. Before the next attempt the arm is restored (a new training client)
    from its saved state at the step's start, weights + optimizer, so every step applies exactly
    its `updates_per_batch` updates to the state it started from, and the redo samples from the
    same weights with the same seeds. An attempt refused before any update is retried as is.
    Every refused attempt is kept in `failures` (the arm's `step_retries` in the evidence).
    """

    runner: ArmRunner
    step: int
    start_state: str | None  # tinker:// state at the step's start (None: none saved there)
    restore: RestoreFn
    run: Callable[[ArmRunner, int, ArmStepProgress], StepRowJson]
    attempts: int = 0
    failures: list[StepRetry] = field(default_factory=list)
    dirty: bool = False  # the last attempt sent updates: the arm is not at the step's start

    def __call__(self) -> StepRowJson:
        if self.dirty:
            if self.start_state is None:
                raise ComparisonError(
                    f"{self.runner.spec.name} step {self.step}: refused after it sent updates, and no state was saved "
                    f"at the step's start (save_every > 1), so a retry would apply updates twice; continue with "
                    f"--resume from the last saved state"
                )
            self.runner = self.restore(self.runner, self.start_state, self.failures[-1])
            self.failures[-1]["restored_from"] = self.start_state
            self.dirty = False
        progress = ArmStepProgress()
        attempt, self.attempts = self.attempts, self.attempts + 1
        try:
            return self.run(self.runner, attempt, progress)
        except Exception as exc:
            self.failures.append(
                {
                    "step": self.step,
                    "attempt": attempt,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                    "updates_sent_before_failure": progress.updates_submitted,
                    "restored_from": None,
                }
            )
            self.dirty = progress.updates_submitted > 0
            raise


@dataclass(frozen=True)
class TrainingOutcome:
    rows: tuple[StepRowJson, ...]
    steps_completed: int  # min over arms
    wall_seconds: float
    schedule: str
    stopped: str | None  # None when every arm finished


class StopRequested(Exception):
    """Raised by a `stop_after` hook to end the run at a step boundary (tests: a kill)."""


def _no_restore(runner: ArmRunner, path: str, failure: StepRetry) -> ArmRunner:
    raise ComparisonError(
        f"{runner.spec.name} step {failure['step']}: refused after it sent updates and no "
        "restore is configured; a retry would apply updates twice"
    )


def _step_start_state(state: RunState, arm: ArmState) -> str | None:
    """The tinker:// state an arm's next step starts from (None: none saved there)."""
    if arm.state_path is not None and arm.state_step == arm.steps_done:
        return arm.state_path
    return state.initial_checkpoint if arm.steps_done == 0 else None


@dataclass
class _ArmSteps:
    """The arm-steps of one `train_arms` call: each run through `call` as a `GuardedArmStep`, then
    committed (steps_done, saved state, row). A restore replaces an arm's runner in `current`."""

    cfg: ComparisonConfig
    state: RunState
    current: dict[str, ArmRunner]
    adams: Mapping[str, tinker.AdamParams]  # by arm name
    items_for_step: Callable[[int], Sequence[Gsm8kItem]]
    renderer: renderers.Renderer
    tag: str
    on_row: Callable[[StepRowJson], None]
    save_state: Callable[[ArmRunner, int], str] | None
    restore: RestoreFn
    call: Callable[[GuardedArmStep], StepRowJson]
    progress: Callable[[str], None]

    def run(self, name: str, step: int) -> tuple[StepRowJson | None, GuardedArmStep | None]:
        """Arm `name`'s step `step` (no row when the arm already finished it before a stop)."""
        arm = self.state.arms[name]
        if arm.steps_done > step:
            return None, None
        items = self.items_for_step(step)
        attempt_guard = GuardedArmStep(
            self.current[name],
            step,
            _step_start_state(self.state, arm),
            self.restore,
            run=lambda r, attempt, prog: run_arm_step(
                r,
                step,
                self.cfg,
                items,
                self.renderer,
                self.adams[r.spec.name],
                self.tag,
                attempt=attempt,
                progress=prog,
            )[0],
        )
        try:
            return self.call(attempt_guard), attempt_guard
        finally:
            self.current[name] = attempt_guard.runner
            arm.step_retries.extend(attempt_guard.failures)

    def commit(
        self,
        name: str,
        step: int,
        step_row: StepRowJson | None,
        attempt_guard: GuardedArmStep | None,
        *,
        save: bool = True,
    ) -> None:
        """Record a finished arm-step: steps done, the state saved at a save step (`save`), the row."""
        if step_row is None:
            return
        arm = self.state.arms[name]
        arm.steps_done = step + 1
        row = step_row.copy()
        row["retries"] = len(attempt_guard.failures) if attempt_guard else 0
        due = arm.steps_done % self.cfg.save_every == 0 or arm.steps_done == self.cfg.steps
        if save and self.save_state is not None and due:
            arm.record_save(self.state.run_id, arm.steps_done, self.save_state(self.current[name], arm.steps_done))
        self.state.rows.append(row)
        self.on_row(row)
        self.progress(step_line(row, self.cfg.steps))

    def advance(self, step: int, names: Sequence[str], pool: ThreadPoolExecutor | None) -> None:
        """Step `step` of every arm: arm after arm, or all at once on the pool, joined before any commit.

        On the pool every arm is joined first: an arm that finished keeps its row even when
        another failed (unsaved: its clients may be gone), and the failure raised is the service's
        stop when there is one, not what it caused in the other arm (a closed session)."""
        if pool is None:
            for n in names:
                self.commit(n, step, *self.run(n, step))
            return
        futures = [(n, pool.submit(self.run, n, step)) for n in names]
        wait([f for _, f in futures])
        failures = [exc for _, f in futures if (exc := f.exception()) is not None]
        for n, f in futures:
            if f.exception() is None:
                self.commit(n, step, *f.result(), save=not failures)
        if failures:
            raise next((e for e in failures if isinstance(e, ServiceStopped)), failures[0])


def _paired_steps(
    arm_steps: _ArmSteps,
    names: Sequence[str],
    start: int,
    pool: ThreadPoolExecutor | None,
    guard: WallGuard | None,
    stop_after: Callable[[int], None] | None,
) -> str | None:
    """Steps `start` .. `cfg.steps - 1` of every arm; the wall guard's reason if it stopped them."""
    for step in range(start, arm_steps.cfg.steps):
        halt = guard.check(step) if guard is not None else None
        if halt is not None:
            arm_steps.progress(f"[comparison] {halt}")
            return halt
        t_step = guard.clock() if guard is not None else 0.0
        arm_steps.progress(
            f"[comparison] training rollout step {step + 1} of {arm_steps.cfg.steps} ({', '.join(names)})"
        )
        arm_steps.advance(step, names, pool)
        if guard is not None:
            guard.step_seconds.append(guard.clock() - t_step)
        if stop_after is not None:
            stop_after(step + 1)
    return None


def train_arms(
    runners: Sequence[ArmRunner],
    cfg: ComparisonConfig,
    state: RunState,
    *,
    items_for_step: Callable[[int], Sequence[Gsm8kItem]],
    renderer: renderers.Renderer,
    tag: str,
    schedule: ArmOrder = "interleaved",
    on_row: Callable[[StepRowJson], None] = lambda _r: None,
    save_state: Callable[[ArmRunner, int], str] | None = None,
    restore: RestoreFn | None = None,
    call: Callable[[GuardedArmStep], StepRowJson] = lambda fn: fn(),
    stop_after: Callable[[int], None] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    guard: WallGuard | None = None,
) -> TrainingOutcome:
    """Advance every arm from its saved step to `cfg.steps`, step by step.

    `interleaved`: arm after arm on this thread. `concurrent`: both arms' step at once on their
    own clients, joined before the next step. Either way the arms never drift apart by more than
    one step. `call` wraps each arm-step (capacity retry) as a `GuardedArmStep`, whose retries
    `restore(runner, state_path, failure)` from the step's start (a new runner; None: refuse to
    retry an attempt that sent updates); `save_state(runner, step)` returns the tinker:// path
    saved after `step` steps; `stop_after(step)` may raise StopRequested; `guard` stops before a
    step that would not end inside the wall budget.
    """
    t0 = time.perf_counter()
    start = min(state.arms[r.spec.name].steps_done for r in runners)
    arm_steps = _ArmSteps(
        cfg,
        state,
        {r.spec.name: r for r in runners},
        {a.name: tinker.AdamParams(**a.adam) for a in cfg.arms},
        items_for_step,
        renderer,
        tag,
        on_row,
        save_state,
        restore or _no_restore,
        call,
        progress,
    )
    pool = ThreadPoolExecutor(max_workers=len(runners)) if schedule == "concurrent" else None
    try:
        stopped = _paired_steps(arm_steps, [r.spec.name for r in runners], start, pool, guard, stop_after)
    except StopRequested as stop:
        stopped = str(stop) or "stop requested"
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    done = min(state.arms[r.spec.name].steps_done for r in runners)
    return TrainingOutcome(tuple(state.rows), done, time.perf_counter() - t0, schedule, stopped)


def make_runners(clients: Mapping[str, tinker.TrainingClient], cfg: ComparisonConfig) -> list[ArmRunner]:
    out = []
    for a in cfg.arms:
        lc = losses.LossConfig.for_loss(a.loss, cfg.normalization)  # type: ignore[arg-type]
        out.append(ArmRunner(a, clients[a.name], losses.make_loss_fn(lc), ins.LossCallRecorder(lc)))
    return out

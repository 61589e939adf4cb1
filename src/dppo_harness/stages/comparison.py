"""The paired comparison: both arms trained step by step from one shared initial state.

Per rollout step and arm (cookbook `rl/train.py` shape): `rollout_batch.sample_rollout_batch`
(the same prompts and sampling seeds for both arms, each arm sampling from its own current
weights), then one `train_step.train_step` per complete-group minibatch; the single
`LossConfig.arm` switch is the only difference between the arms. The arms advance together
(interleaved on one thread, or concurrently on their own clients), so a stop at any moment leaves
them at equal or adjacent step counts.

Every arm-step appends a row to a JSONL log and posts `metrics.arms`; each arm saves its state
(with optimizer) every `save_every` steps into a resume file, so `--resume RUN_ID` continues at
the last step boundary. Evaluation and the decision live in `comparison_eval`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dppo_harness import constants
from dppo_harness.instrument import cookbook_metrics
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss import losses
from dppo_harness.rollout import rollout_batch, rollouts
from dppo_harness.train import train_step

if TYPE_CHECKING:
    import tinker

    from dppo_harness.plans import CriterionConfig, RunConfig


STEPS_FILE = "comparison-steps.jsonl"
STATE_FILE = "comparison-state.json"
MAX_SAVE_EVERY = constants.MAX_SAVE_EVERY  # the brief: state saved at least every 10 steps per arm
Schedule = Literal["interleaved", "concurrent"]


class ComparisonError(RuntimeError):
    """The comparison cannot be configured or resumed as asked (the message names the field)."""


class OptimizerMismatch(ComparisonError):
    """A restore's optimizer check found the server's optimizer differs from the request: the run
    stops. Carries the arm's provenance entry with that check and the run-state file the check's
    get_info reference names (to be registered before the provenance is posted), for the evidence."""

    def __init__(self, message: str, arm: str = "", provenance: Mapping[str, Any] | None = None,
                 state_file: str | None = None):
        super().__init__(message)
        self.arm, self.provenance, self.state_file = arm, dict(provenance or {}), state_file


def default_schedule(embedded: bool) -> Schedule:
    """How the arms advance unless asked: concurrently on a real service (faster once each request
    pays a round trip, measured by benchmarks/comparison_schedule.py at 300 ms), interleaved on the
    embedded server (two arms on 2 CPU cores gain nothing from overlap)."""
    return "interleaved" if embedded else "concurrent"


# ---- wall-clock guard (pure) -------------------------------------------------------------------

FINALIZE_RESERVE_S = 30.0  # final sampler weights + state per arm, evidence files


@dataclass
class WallGuard:
    """Stops the training loop before the plan's wall budget is passed.

    Before each step: the projected step time (the longest step measured in this session, else
    `first_step_estimate_s`) plus `reserve_s` (what must still run after training: finalizing and
    evaluating, from measured figures) must fit in `remaining()` (the budget ledger's seconds left).
    With no measurement yet and no estimate, the step runs unless the budget is already spent.
    """

    remaining: Callable[[], float | None]
    reserve_s: float = FINALIZE_RESERVE_S
    first_step_estimate_s: float | None = None
    basis: str = ""
    clock: Callable[[], float] = time.perf_counter  # times each step
    step_seconds: list[float] = field(default_factory=list)
    last_check: dict[str, Any] = field(default_factory=dict)

    def check(self, step: int) -> str | None:
        """None if step `step` (0-based) may start, else the one-line stop reason."""
        left = self.remaining()
        measured = max(self.step_seconds) if self.step_seconds else None
        est = measured if measured is not None else self.first_step_estimate_s
        self.last_check = {"step": step, "seconds_left": left, "projected_step_seconds": est,
                           "projection_source": "longest measured step" if measured is not None else
                           ("estimate: " + self.basis) if est is not None else "none yet",
                           "reserve_seconds": self.reserve_s}
        if left is None:
            return None
        need = (est or 0.0) + self.reserve_s
        if left <= 0 or (est is not None and need > left):
            return (f"wall clock: step {step + 1} projected {est or 0.0:.0f} s + {self.reserve_s:.0f} s to finish "
                    f"and evaluate > {max(left, 0.0):.0f} s left of the plan's wall budget; stopped before it")
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"reserve_seconds": self.reserve_s, "first_step_estimate_seconds": self.first_step_estimate_s,
                "basis": self.basis, "step_seconds": list(self.step_seconds), "last_check": dict(self.last_check)}


def wall_guard_from_feasibility(remaining: Callable[[], float | None], feasibility: Mapping[str, Any] | None,
                                *, arms: int, eval_items: int) -> WallGuard:
    """A WallGuard whose first-step estimate and evaluation reserve come from the feasibility
    pilot's measured figures (an arm-step's seconds x arms, never assuming overlap is free; seconds
    per evaluation item x items x (arms + base model)); without them, only the finalize reserve."""
    m = (feasibility or {}).get("measurements") or {}
    tr, ev = m.get("training") or {}, m.get("evaluation") or {}

    def per_unit(block: Mapping[str, Any]) -> float | None:
        secs, units = block.get("seconds"), block.get("units")
        if isinstance(secs, (int, float)) and isinstance(units, (int, float)) and units > 0 and math.isfinite(secs):
            return float(secs) / float(units)
        return None

    arm_step, per_item = per_unit(tr), per_unit(ev)
    reserve = FINALIZE_RESERVE_S + (per_item * eval_items * (arms + 1) if per_item is not None else 0.0)
    basis = ("feasibility pilot: " + (f"{arm_step:.1f} s per arm-step x {arms} arms" if arm_step else "no arm-step timing")
             + (f"; evaluation {per_item:.2f} s per item x {eval_items} items x {arms + 1} checkpoints"
                if per_item is not None else "; no evaluation timing (reserve: finalize only)"))
    return WallGuard(remaining, reserve_s=reserve, first_step_estimate_s=arm_step * arms if arm_step else None,
                     basis=basis)


# ---- configuration (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class ArmSpec:
    name: str
    loss: str  # a registered loss name (loss_registry.LOSSES)
    role: str  # "baseline" or "treatment"
    seed: int
    lr: float
    updates_per_batch: int
    adam: dict[str, float] = field(default_factory=dict)  # this arm's AdamParams
    adam_requested: dict[str, float] = field(default_factory=dict)  # the spec's optimizer_config keys


@dataclass(frozen=True)
class ComparisonConfig:
    arms: tuple[ArmSpec, ...]  # the baseline first, then the treatments
    steps: int  # rollout steps per arm
    groups_per_batch: int
    group_size: int
    temperature: float
    max_tokens: int
    eval_items: int
    base_model: str
    lora_rank: int
    dataset: str
    max_seq_len: int
    criteria: tuple[CriterionConfig, ...]
    alpha: float
    save_every: int = 1
    normalization: str = "token_mean"

    def arm(self, name: str) -> ArmSpec:
        return next(a for a in self.arms if a.name == name)

    def role(self, role: str) -> ArmSpec:
        """The first arm with this role (the baseline is unique; see `treatments` for all)."""
        return next(a for a in self.arms if a.role == role)

    @property
    def treatments(self) -> tuple[ArmSpec, ...]:
        return tuple(a for a in self.arms if a.role == "treatment")


def comparison_config(run: RunConfig, *, save_every: int = 1) -> ComparisonConfig:
    """The paired schedule of a plan's typed run config (`Plan.run`)."""
    if not 1 <= save_every <= MAX_SAVE_EVERY:
        raise ComparisonError(f"save_every: {save_every} not in [1, {MAX_SAVE_EVERY}]")
    arms = tuple(ArmSpec(a.name, a.loss, a.role, a.seed, a.lr, a.updates_per_batch, a.adam, a.adam_config_requested())
                 for a in run.arms)
    return ComparisonConfig(
        arms=arms, steps=run.rollout_steps, groups_per_batch=int(run.groups_per_batch.value),
        group_size=int(run.group_size.value), temperature=float(run.temperature.value),
        max_tokens=int(run.max_tokens.value), eval_items=run.eval_items, base_model=run.base_model,
        lora_rank=run.lora_rank, dataset=run.dataset, max_seq_len=run.max_seq_len, criteria=run.criteria, alpha=run.alpha, save_every=save_every,
        normalization=run.normalization,
    )


def step_seed(cfg: ComparisonConfig, step: int) -> int:
    """Sampling seed base of a rollout step: the same for both arms, distinct across steps."""
    return cfg.arms[0].seed + step * cfg.groups_per_batch


# ---- per-step metrics (pure) -------------------------------------------------------------------


def fraction_label(name: str, *, trained: bool) -> str:
    """A loss-rule metric's name in an arm's rows: the rule the arm does not train with is counted
    counterfactually on the arm's own tensors, and its name says so."""
    return name if trained else f"counterfactual_{name}"


# A row's loss-rule fractions -> the loss-call statistic each is computed from (every loss call
# counts both rules on its tensors, whichever loss it trains with).
FRACTION_SOURCES = {"dppo_masked_frac": "dppo/removed", "last_update_masked_frac": "dppo/masked_frac_loss_tokens",
                    "ppo_clip_frac": "ppo/clipped", "last_update_clip_frac": "ppo/clip_frac_loss_tokens"}


def fraction_names(loss: str) -> dict[str, str]:
    """Base name -> label in the rows of an arm training with the registered `loss`: a fraction is
    the arm's own when its statistic is one of the loss's `metric_names`, else counterfactual."""
    own = set(losses.get_loss(loss).metric_names)
    return {base: fraction_label(base, trained=source in own) for base, source in FRACTION_SOURCES.items()}


def labelled(row: Mapping[str, Any], base: str) -> tuple[str, Any]:
    """(key, value) of a loss-rule fraction in a row, whichever label it carries."""
    for key in (base, f"counterfactual_{base}"):
        if key in row:
            return key, row[key]
    raise KeyError(base)


def step_metrics(arm: str, step: int, summary: Mapping[str, Any], records: Sequence[ins.LossCallRecord],
                 *, loss: str, seconds: float, sample_seconds: float, sampler_checkpoint: str,
                 kl: Mapping[str, float] | None = None, cookbook_env: Mapping[str, float] | None = None,
                 rollout_seconds: float | None = None) -> dict[str, Any]:
    """One arm-step row: reward/format/truncation from the batch, loss metrics of the step's minibatch
    updates pooled by loss tokens (fractions) and of its last update (drift tails, as the gate).

    `loss` is the arm's registered loss name. A rule the loss does not train with (the GRPO arm's
    DPPO mask, the DPPO arm's PPO clip) is a counterfactual count on the same tensors: its keys
    start with `counterfactual_` (`fraction_names`). `kl` is the
    cookbook's `compute_kl_sample_train` of the step (`cookbook_metrics.kl_sample_train`)."""
    sums = {k: int(sum(r.stats[k] for r in records)) for k in ("tokens/loss", "dppo/removed", "ppo/clipped")}
    last = records[-1].stats if records else {}
    den = sums["tokens/loss"]
    names = fraction_names(loss)
    row: dict[str, Any] = {
        "arm": arm, "step": step, "loss": loss,
        "reward_mean": float(summary["mean_reward"]), "format_rate": float(summary["frac_format"]),
        "correct_rate": float(summary["frac_correct"]),
        "truncated_frac": float(summary["frac_truncated"]), "no_answer_frac": float(summary["frac_no_answer"]),
        "mean_response_tokens": float(summary["mean_response_tokens"]), "responses": int(summary["n_sequences"]),
        "max_tokens": int(summary["config"]["max_tokens"]),
        names["dppo_masked_frac"]: sums["dppo/removed"] / den if den else 0.0,
        names["ppo_clip_frac"]: sums["ppo/clipped"] / den if den else 0.0,
        names["last_update_masked_frac"]: float(last.get("dppo/masked_frac_loss_tokens", 0.0)),
        names["last_update_clip_frac"]: float(last.get("ppo/clip_frac_loss_tokens", 0.0)),
        "drift_abs_p90": float(last.get("drift/abs_p90", 0.0)), "drift_abs_p99": float(last.get("drift/abs_p99", 0.0)),
        "drift_abs_max": float(last.get("drift/abs_max", 0.0)),
        "loss_tokens": den, "response_tokens": int(summary["response_tokens"]), "updates": len(records),
        "seconds": float(seconds), "sample_seconds": float(sample_seconds), "sampler_checkpoint": sampler_checkpoint,
    }
    row.update({cookbook_metrics.ROW_KL_KEYS[k]: float(v) for k, v in (kl or {}).items() if k in cookbook_metrics.ROW_KL_KEYS})
    if rollout_seconds is not None:
        row["rollout_seconds"] = float(rollout_seconds)
    if cookbook_env is not None:
        row["cookbook_env"] = {k: float(v) for k, v in cookbook_env.items()}
    return row


TIMING_KEYS = ("seconds", "sample_seconds", "rollout_seconds", "sampler_checkpoint", "retries")


def comparable(row: Mapping[str, Any]) -> dict[str, Any]:
    """A step row without wall times and paths (what must match between a resumed and an
    uninterrupted run)."""
    return {k: v for k, v in row.items() if k not in TIMING_KEYS}


# What the sampled tokens decide must match exactly between a resumed and an uninterrupted run;
# logprob-derived floats only to the embedded server's run-to-run float noise (its batched CPU
# kernels are not bitwise reproducible between two runs, resumed or not).
TOKEN_FIELDS = ("reward_mean", "format_rate", "correct_rate", "response_tokens", "loss_tokens", "updates", "loss",
                "truncated_frac", "no_answer_frac", "mean_response_tokens", "responses", "max_tokens", "cookbook_env")
RESUME_FLOAT_ATOL = 2e-3


def row_differences(got: Mapping[str, Any], want: Mapping[str, Any], atol: float = RESUME_FLOAT_ATOL) -> list[str]:
    """Why two comparable step rows of the same arm and step differ (empty: they match)."""
    where = f"{got['arm']} step {got['step']}"
    out = [f"{where}: {k} {got.get(k)!r} != {want.get(k)!r}" for k in TOKEN_FIELDS if got.get(k) != want.get(k)]
    out += [f"{where}: {k} {got[k]!r} vs {want[k]!r}" for k in sorted(set(want) - set(TOKEN_FIELDS) - {"arm", "step"})
            if abs(float(got[k]) - float(want[k])) > atol]
    return out


def arm_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """`metrics.arms[arm]`: plain floats over the steps so far (loss-rule fractions keep their
    counterfactual label)."""
    if not rows:
        return {}
    last = rows[-1]
    out = {
        "steps_completed": float(len(rows)),
        "reward_mean_last": float(last["reward_mean"]),
        "reward_mean_over_steps": float(np.mean([r["reward_mean"] for r in rows])),
        "format_rate_last": float(last["format_rate"]),
    }
    for base in ("dppo_masked_frac", "ppo_clip_frac"):
        key, _ = labelled(last, base)
        out[f"{key}_mean"] = float(np.mean([labelled(r, base)[1] for r in rows]))
    out["drift_abs_p90_last"] = float(last["drift_abs_p90"])
    for key in ("truncated_frac", "no_answer_frac", "mean_response_tokens"):
        if all(key in r for r in rows):
            out[f"{key}_last"] = float(last[key])
            out[f"{key}_mean"] = float(np.mean([r[key] for r in rows]))
    for key in ("kl_sample_train_v1", "kl_sample_train_v2", "entropy"):
        if key in last:
            out[f"{key}_last"] = float(last[key])
    out["loss_tokens_total"] = float(sum(r["loss_tokens"] for r in rows))
    out["train_seconds_total"] = float(sum(r["seconds"] for r in rows))
    return out


# ---- resumable state ---------------------------------------------------------------------------


def code_revision(package_dir: Path | None = None) -> str:
    """sha256 over the package's Python sources (path + bytes): what the resume must match."""
    root = package_dir or Path(__file__).parent
    h = hashlib.sha256(b"dppo-harness/code/v1")
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@dataclass
class ArmState:
    """One arm's resumable position: its last saved state (weights + optimizer) at a step boundary."""

    name: str
    steps_done: int = 0
    state_path: str | None = None  # tinker:// save_state path (weights + optimizer) at `state_step`
    state_step: int = 0  # steps_done when `state_path` was saved
    saves: dict[str, str] = field(default_factory=dict)  # str(steps_done) -> save_state path, every save
    restore_count: int = 0
    optimizer_checks: list[dict[str, Any]] = field(default_factory=list)
    final_sampler: str | None = None
    final_state: str | None = None
    step_retries: list[dict[str, Any]] = field(default_factory=list)  # refused attempts, see GuardedArmStep


@dataclass
class RunState:
    run_id: str
    plan_sha256: str
    evaluator_id: str
    code_revision: str
    initial_checkpoint: str
    arms: dict[str, ArmState]
    rows: list[dict[str, Any]] = field(default_factory=list)  # every completed arm-step, in order
    resumed: int = 0
    # Every session that worked on this run, in order: {"run_id", "dir"} of its evidence bundle.
    sessions: list[dict[str, str]] = field(default_factory=list)
    # The hashed result snapshot holding the setup (preflight + gate) evidence the run started from.
    setup_snapshot: dict[str, str] | None = None
    # Per arm, the preflight's restore_count and optimizer checks (what later restores count on).
    setup_provenance: dict[str, Any] = field(default_factory=dict)
    resumes: list[dict[str, Any]] = field(default_factory=list)  # per resume: session, from_step, continued

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "arms"},
                "arms": {a: asdict(s) for a, s in self.arms.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunState:
        arms = {a: ArmState(**s) for a, s in d["arms"].items()}
        return cls(**{**{k: v for k, v in d.items() if k != "arms"}, "arms": arms})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> RunState:
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ComparisonError(f"resume state {path}: unreadable ({exc})") from None


def resume_problems(state: RunState, *, plan_sha256: str, evaluator_id: str, code_rev: str) -> list[str]:
    """Why a saved run may not be continued: plan, evaluator or code changed."""
    out = []
    for what, saved, now in (("plan sha256", state.plan_sha256, plan_sha256),
                             ("evaluator id", state.evaluator_id, evaluator_id),
                             ("code revision", state.code_revision, code_rev)):
        if saved != now:
            out.append(f"{what} changed since run {state.run_id}: saved {saved[:16]}, now {now[:16]}")
    steps = [s.steps_done for s in state.arms.values()]
    if steps and max(steps) - min(steps) > 1:
        out.append(f"arms are {max(steps) - min(steps)} steps apart ({steps}): not a paired step boundary")
    return out


def rewind_to_common_save(state: RunState, steps: int) -> int:
    """Before a resume: every arm back to the last step that all arms saved (0: the shared initial
    checkpoint, `state.initial_checkpoint`), so the arms continue paired; the rows after it are
    dropped and recomputed (same prompts and seeds). Returns that step."""
    for a in state.arms.values():
        if a.state_path is not None and not a.saves:  # a state written before saves were kept
            a.saves[str(a.state_step)] = a.state_path
    step = max(set.intersection(*({int(k) for k in a.saves} | {0} for a in state.arms.values())))
    for a in state.arms.values():
        a.steps_done = a.state_step = step
        a.state_path = a.saves.get(str(step)) if step else None
        if step < steps:
            a.final_sampler = a.final_state = None
    state.rows = [r for r in state.rows if r["step"] < step]
    return step


def state_path(state_root: Path, run_id: str) -> Path:
    return Path(state_root) / run_id / STATE_FILE


# ---- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmRunner:
    """Everything one arm needs for a step; its client is its own."""

    spec: ArmSpec
    client: Any  # tinker.TrainingClient
    loss_fn: train_step.LossFn
    recorder: ins.LossCallRecorder


@dataclass
class AttemptProgress:
    """What one attempt at an arm-step has sent that changes the arm's training state."""

    updates_submitted: int = 0


def run_arm_step(runner: ArmRunner, step: int, cfg: ComparisonConfig, items: Sequence[Any], renderer: Any,
                 adam: tinker.AdamParams, tag: str, *, attempt: int = 0,
                 progress: AttemptProgress | None = None) -> tuple[dict[str, Any], list[ins.LossCallRecord]]:
    """One rollout step of one arm: sample from its current weights, then its minibatch updates.
    `progress.updates_submitted` counts updates sent (so a failed attempt says whether it moved the arm)."""
    progress = progress if progress is not None else AttemptProgress()
    t0 = time.perf_counter()
    rcfg = rollouts.RolloutConfig(cfg.groups_per_batch, cfg.group_size, cfg.temperature, cfg.max_tokens,
                                  seed=step_seed(cfg, step), max_seq_len=cfg.max_seq_len)
    retry = f"-retry{attempt}" if attempt else ""  # sampler names are immutable on the service
    sampled = rollout_batch.sample_rollout_batch(runner.client, items, renderer, rcfg,
                                                 sampler_name=f"{tag}-{runner.spec.name}-s{step}{retry}")
    minibatches = train_step.prepare_minibatches(sampled.group_of_datum, runner.spec.updates_per_batch)
    records = []
    for u, idx in enumerate(minibatches, start=1):
        progress.updates_submitted += 1  # before the call: a refusal may come after the server applied it
        context = {"arm": runner.spec.name, "step": step, "update_in_batch": u,
                   "update_index": step * runner.spec.updates_per_batch + u, "sampler_checkpoint": sampled.sampler_path}
        rec, _ = train_step.train_step(runner.client, [sampled.datums[i] for i in idx], runner.loss_fn, adam,
                                       runner.recorder, context)
        records.append(rec)
    row = step_metrics(runner.spec.name, step, sampled.batch.summary(), records, loss=runner.spec.loss,
                       seconds=time.perf_counter() - t0, sample_seconds=sampled.seconds,
                       sampler_checkpoint=sampled.sampler_path, kl=cookbook_metrics.kl_sample_train(records),
                       cookbook_env=cookbook_metrics.trajectory_metrics(sampled.batch),
                       rollout_seconds=sampled.batch.sampling_seconds + sampled.batch.grading_seconds)
    return row, records


RestoreFn = Callable[[ArmRunner, str, dict[str, Any]], ArmRunner]


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
    run: Callable[[ArmRunner, int, AttemptProgress], dict[str, Any]]
    attempts: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    dirty: bool = False  # the last attempt sent updates: the arm is not at the step's start

    def __call__(self) -> dict[str, Any]:
        if self.dirty:
            if self.start_state is None:
                raise ComparisonError(
                    f"{self.runner.spec.name} step {self.step}: refused after it sent updates, and no state was saved "
                    f"at the step's start (save_every > 1), so a retry would apply updates twice; continue with "
                    f"--resume from the last saved state")
            self.runner = self.restore(self.runner, self.start_state, self.failures[-1])
            self.failures[-1]["restored_from"] = self.start_state
            self.dirty = False
        progress = AttemptProgress()
        attempt, self.attempts = self.attempts, self.attempts + 1
        try:
            return self.run(self.runner, attempt, progress)
        except Exception as exc:
            self.failures.append({"step": self.step, "attempt": attempt, "error": f"{type(exc).__name__}: {exc}"[:500],
                                  "updates_sent_before_failure": progress.updates_submitted, "restored_from": None})
            self.dirty = progress.updates_submitted > 0
            raise


@dataclass(frozen=True)
class TrainingOutcome:
    rows: tuple[dict[str, Any], ...]
    steps_completed: int  # min over arms
    wall_seconds: float
    schedule: str
    stopped: str | None  # None when every arm finished


class StopRequested(Exception):
    """Raised by a `stop_after` hook to end the run at a step boundary (tests: a kill)."""


def train_arms(
    runners: Sequence[ArmRunner],
    cfg: ComparisonConfig,
    state: RunState,
    *,
    items_for_step: Callable[[int], Sequence[Any]],
    renderer: Any,
    tag: str,
    schedule: Schedule = "interleaved",
    on_row: Callable[[dict[str, Any]], None] = lambda _r: None,
    save_state: Callable[[ArmRunner, int], str] | None = None,
    restore: RestoreFn | None = None,
    call: Callable[[Callable[[], Any]], Any] = lambda fn: fn(),
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
    import tinker

    adams = {a.name: tinker.AdamParams(**a.adam) for a in cfg.arms}
    t0 = time.perf_counter()
    start = min(state.arms[r.spec.name].steps_done for r in runners)
    current = {r.spec.name: r for r in runners}  # a restore replaces an arm's runner (new client)

    def no_restore(runner: ArmRunner, path: str, failure: dict[str, Any]) -> ArmRunner:
        raise ComparisonError(f"{runner.spec.name} step {failure['step']}: refused after it sent updates and no "
                              "restore is configured; a retry would apply updates twice")

    def step_start_state(arm: ArmState) -> str | None:
        if arm.state_path is not None and arm.state_step == arm.steps_done:
            return arm.state_path
        return state.initial_checkpoint if arm.steps_done == 0 else None

    def one(name: str, step: int) -> tuple[dict[str, Any], GuardedArmStep | None]:
        arm = state.arms[name]
        if arm.steps_done > step:  # this arm already finished the step before a stop
            return {}, None
        items = items_for_step(step)
        guard = GuardedArmStep(
            current[name], step, step_start_state(arm), restore or no_restore,
            run=lambda r, attempt, prog: run_arm_step(r, step, cfg, items, renderer, adams[r.spec.name], tag,
                                                      attempt=attempt, progress=prog)[0])
        try:
            return call(guard), guard
        finally:
            current[name] = guard.runner
            arm.step_retries.extend(guard.failures)

    def commit(name: str, step: int, row: dict[str, Any], guard: GuardedArmStep | None) -> None:
        if not row:
            return
        runner = current[name]
        arm = state.arms[name]
        arm.steps_done = step + 1
        row = {**row, "retries": len(guard.failures) if guard else 0}
        if save_state is not None and (arm.steps_done % cfg.save_every == 0 or arm.steps_done == cfg.steps):
            arm.state_path = save_state(runner, arm.steps_done)
            arm.state_step = arm.steps_done
            arm.saves[str(arm.steps_done)] = arm.state_path
        state.rows.append(row)
        on_row(row)
        progress(step_line(row, cfg.steps))

    stopped = None
    pool = ThreadPoolExecutor(max_workers=len(runners)) if schedule == "concurrent" else None
    try:
        for step in range(start, cfg.steps):
            halt = guard.check(step) if guard is not None else None
            if halt is not None:
                stopped = halt
                progress(f"[comparison] {halt}")
                break
            t_step = guard.clock() if guard is not None else 0.0
            names = [r.spec.name for r in runners]
            if pool is None:
                for n in names:
                    commit(n, step, *one(n, step))
            else:
                futures = [(n, pool.submit(one, n, step)) for n in names]
                results = [(n, f.result()) for n, f in futures]
                for n, (row, step_guard) in results:
                    commit(n, step, row, step_guard)
            if guard is not None:
                guard.step_seconds.append(guard.clock() - t_step)
            if stop_after is not None:
                stop_after(step + 1)
    except StopRequested as stop:
        stopped = str(stop) or "stop requested"
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    done = min(state.arms[r.spec.name].steps_done for r in runners)
    return TrainingOutcome(tuple(state.rows), done, time.perf_counter() - t0, schedule, stopped)


def step_line(row: Mapping[str, Any], steps: int) -> str:
    """The terminal line of one committed arm-step (a counterfactual fraction is labelled 'cf')."""
    parts = [f"[comparison] {row['arm']} step {row['step'] + 1}/{steps}: reward {row['reward_mean']:.3f}, "
             f"format {row['format_rate']:.2f}"]
    for base, short in (("dppo_masked_frac", "masked"), ("ppo_clip_frac", "clip")):
        try:
            key, value = labelled(row, base)
        except KeyError:
            continue
        parts.append(f"{'cf ' if key.startswith('counterfactual_') else ''}{short} {value:.4g}")
    if "truncated_frac" in row:
        parts.append(f"truncated {row['truncated_frac']:.2f}")
    parts.append(f"|p-q| q90 {row.get('drift_abs_p90', 0.0):.4g}, {row.get('seconds', 0.0):.1f}s")
    return ", ".join(parts)


def make_runners(clients: Mapping[str, Any], cfg: ComparisonConfig) -> list[ArmRunner]:
    out = []
    for a in cfg.arms:
        lc = losses.LossConfig.for_loss(a.loss, cfg.normalization)  # type: ignore[arg-type]
        out.append(ArmRunner(a, clients[a.name], losses.make_loss_fn(lc), ins.LossCallRecorder(lc)))
    return out


def jsonl(rows: Sequence[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(ins.nan_free(dict(r)), sort_keys=True) + "\n" for r in rows).encode()


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)

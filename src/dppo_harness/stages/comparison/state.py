"""The comparison's resumable state: each arm's position at a step boundary (its saved states,
restores and optimizer checks), the run's rows and sessions, the checks a resume must pass
(plan, evaluator and code unchanged, arms paired) and the rewind to the last common save."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import dppo_harness
from dppo_harness.evidence.errors import UnwritableEvidenceError
from dppo_harness.evidence.files import atomic_write, unwritable_line
from dppo_harness.evidence.provenance import package_files_sha256
from dppo_harness.json_types import JsonObject
from dppo_harness.stages.comparison.config import ComparisonError
from dppo_harness.stages.comparison.step_rows import StepRowJson

STEPS_FILE = "comparison-steps.jsonl"
STATE_FILE = "comparison-state.json"


class StepRetry(TypedDict):
    """One refused attempt at an arm-step (`arms.GuardedArmStep`), as the arm's `step_retries` keeps it."""

    step: int
    attempt: int
    error: str  # exception type and message, at most 500 characters
    updates_sent_before_failure: int
    restored_from: str | None  # the step-start state restored before the next attempt


def code_revision(package_dir: Path | None = None) -> str:
    """sha256 over the package's sources and the data it carries (`package_files_sha256`: the
    vendored GSM8K files and their SHA256SUMS, the stand-in's assets): what the resume must match."""
    return package_files_sha256(package_dir or Path(dppo_harness.__file__).parent)


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
    step_retries: list[StepRetry] = field(default_factory=list)  # refused attempts, see GuardedArmStep
    # str(steps_done) -> checkpoint_record_sha256 of that save, taken when it was saved
    save_hashes: dict[str, str] = field(default_factory=dict)
    # models the service lost under this arm, each replaced from the arm's last save (at most once a run)
    lost_models: list[dict[str, Any]] = field(default_factory=list)

    def record_save(self, run_id: str, step: int, path: str) -> None:
        """The state saved after `step` steps: the resume point, hashed as it is recorded."""
        self.state_path, self.state_step = path, step
        self.saves[str(step)] = path
        self.save_hashes[str(step)] = checkpoint_record_sha256(run_id, self.name, step, path)


def checkpoint_record_sha256(run_id: str, arm: str, step: int, path: str) -> str:
    """sha256 of one checkpoint record: which run, arm and step the service's saved path holds."""
    record = json.dumps({"run_id": run_id, "arm": arm, "step": step, "path": path}, sort_keys=True)
    return hashlib.sha256(record.encode()).hexdigest()


def checkpoint_record_problems(state: RunState) -> list[str]:
    """Why the state's own checkpoint records cannot be reused: a save whose record does not hash to
    what was recorded when it was saved (edited, or copied from another run or arm), or a current
    state that is not one of the hashed saves."""
    out = []
    for arm in state.arms.values():
        for step, path in sorted(arm.saves.items(), key=lambda kv: int(kv[0])):
            want = arm.save_hashes.get(step)
            if want is None:
                out.append(f"arm {arm.name}'s checkpoint at step {step} has no hash recorded when it was saved")
            elif want != checkpoint_record_sha256(state.run_id, arm.name, int(step), path):
                out.append(
                    f"arm {arm.name}'s checkpoint record at step {step} ({path}) does not match the sha256 "
                    "recorded when it was saved"
                )
        if arm.state_path is not None and arm.saves.get(str(arm.state_step)) != arm.state_path:
            out.append(f"arm {arm.name}'s current state {arm.state_path} is not one of its hashed saves")
    return out


@dataclass
class RunState:
    run_id: str
    plan_sha256: str
    evaluator_id: str
    code_revision: str
    initial_checkpoint: str
    arms: dict[str, ArmState]
    rows: list[StepRowJson] = field(default_factory=list)  # every completed arm-step, in order
    resumed: int = 0
    # Every session that worked on this run, in order: {"run_id", "dir"} of its evidence bundle.
    sessions: list[dict[str, str]] = field(default_factory=list)
    # The hashed result snapshot holding the setup (preflight + gate) evidence the run started from.
    setup_snapshot: dict[str, str] | None = None
    # Per arm, the preflight's restore_count and optimizer checks (what later restores count on).
    setup_provenance: dict[str, Any] = field(default_factory=dict)
    resumes: list[dict[str, Any]] = field(default_factory=list)  # per resume: session, from_step, continued

    def to_json(self) -> JsonObject:
        return {
            **{k: v for k, v in asdict(self).items() if k != "arms"},
            "arms": {a: asdict(s) for a, s in self.arms.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunState:
        arms = {a: ArmState(**s) for a, s in d["arms"].items()}
        return cls(**{**{k: v for k, v in d.items() if k != "arms"}, "arms": arms})

    def save(self, path: Path) -> None:
        """A unique temp file, fsync, rename, fsync of the directory: never torn, never lost; a
        refused write (disk full, read-only, permission) is the evidence's one line."""
        try:
            atomic_write(path, json.dumps(self.to_json(), indent=1, sort_keys=True).encode())
        except OSError as exc:
            raise UnwritableEvidenceError(unwritable_line(path, exc)) from None

    @classmethod
    def load(cls, path: Path) -> RunState:
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ComparisonError(f"resume state {path}: unreadable ({exc})") from None


def resume_problems(state: RunState, *, plan_sha256: str, evaluator_id: str, code_rev: str) -> list[str]:
    """Why a saved run may not be continued: plan, evaluator, code or carried data changed."""
    out = []
    for what, saved, now in (
        ("plan sha256", state.plan_sha256, plan_sha256),
        ("evaluator id", state.evaluator_id, evaluator_id),
        ("code and data revision", state.code_revision, code_rev),
    ):
        if saved != now:
            out.append(f"{what} changed since run {state.run_id}: saved {saved[:16]}, now {now[:16]}")
    steps = [s.steps_done for s in state.arms.values()]
    if steps and max(steps) - min(steps) > 1:
        out.append(f"arms are {max(steps) - min(steps)} steps apart ({steps}): not a paired step boundary")
    return out


def rewind_to_common_save(state: RunState, steps: int) -> int:
    """Before a resume: every arm back to the last step that all arms saved (0: the shared initial
    checkpoint, `state.initial_checkpoint`), so the arms continue paired; the rows and saves after
    it are dropped and recomputed (same prompts and seeds). Returns that step."""
    step = max(set.intersection(*({int(k) for k in a.saves} | {0} for a in state.arms.values())))
    for a in state.arms.values():
        a.steps_done = a.state_step = step
        a.state_path = a.saves.get(str(step)) if step else None
        # the saves after it are trained and saved again: dropped, so no record holds two paths for a step
        a.saves = {k: v for k, v in a.saves.items() if int(k) <= step}
        a.save_hashes = {k: v for k, v in a.save_hashes.items() if int(k) <= step}
        if step < steps:
            a.final_sampler = a.final_state = None
    state.rows = [r for r in state.rows if r["step"] < step]
    return step


def state_path(state_root: Path, run_id: str) -> Path:
    return Path(state_root) / run_id / STATE_FILE


def load_owned_state(state_root: Path, run_id: str) -> RunState:
    """Run `run_id`'s saved state, refused when it names another run (copied or moved there)."""
    path = state_path(state_root, run_id)
    state = RunState.load(path)
    if state.run_id != run_id:
        raise ComparisonError(f"--resume {run_id} refused: the state at {path} belongs to run {state.run_id}")
    return state


LOCK_FILE = "run.lock"
_held: dict[Path, int] = {}  # lock files this process holds (released by the OS when it exits, even killed)


def hold_run_lock(state_root: Path, run_id: str, *, what: str) -> None:
    """Hold run `run_id`'s lock for the rest of this process, or refuse in one line: one writer per
    run, so a resume of a run that still runs (or that another resume continues) never interleaves
    its state and checkpoints with the other writer's."""
    path = (Path(state_root) / run_id / LOCK_FILE).resolve()
    if path in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ComparisonError(
            f"{what} refused: run {run_id} is being written by {holder} (it holds {path}); "
            "wait for it to end, or resume it once it has"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    _held[path] = fd


def state_file_name(state: RunState, label: str) -> str:
    """The evidence name of the run state registered at `label` in this session."""
    return f"{STATE_FILE.removesuffix('.json')}-r{state.resumed}-{label}.json"

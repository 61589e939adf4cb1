"""The comparison's resumable state: each arm's position at a step boundary (its saved states, each
hashed as it is recorded, restores and optimizer checks), the run's rows and sessions, written
atomically, and the lock that keeps one writer per run. What a resume checks is `resume`'s."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from dppo_harness.evidence.files import UnwritableEvidenceError, atomic_write, unwritable_line
from dppo_harness.json_types import JsonObject
from dppo_harness.stages.comparison.config import ComparisonError
from dppo_harness.stages.comparison.step_rows import StepRowJson

STATE_FILE = "comparison-state.json"


class StepRetry(TypedDict):
    """One refused attempt at an arm-step (`run.Arms.step_with_retry`), as the arm's `step_retries` keeps it."""

    step: int
    attempt: int
    error: str  # exception type and message, at most 500 characters
    updates_sent_before_failure: int
    restored_from: str | None  # the step-start state restored before the next attempt


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
    step_retries: list[StepRetry] = field(default_factory=list)  # refused attempts, see Arms.step_with_retry
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
    # The journaled result snapshot holding the setup (preflight + gate) evidence the run started from:
    # {run_id, seq, sha256} of its journal entry (`resume.snapshot_ref`).
    setup_snapshot: dict[str, str | int] | None = None
    # Per arm, the preflight's restore_count and optimizer checks (what later restores count on).
    setup_provenance: dict[str, Any] = field(default_factory=dict)
    resumes: list[dict[str, Any]] = field(default_factory=list)  # per resume: session, from_step, continued

    def to_json(self) -> JsonObject:
        return {
            **{k: v for k, v in asdict(self).items() if k != "arms"},
            "arms": {a: asdict(s) for a, s in self.arms.items()},
        }

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
            d = json.loads(path.read_text())
            return cls(**{**d, "arms": {a: ArmState(**s) for a, s in d["arms"].items()}})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ComparisonError(f"resume state {path}: unreadable ({exc})") from None


def state_path(state_root: Path, run_id: str) -> Path:
    return Path(state_root) / run_id / STATE_FILE


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

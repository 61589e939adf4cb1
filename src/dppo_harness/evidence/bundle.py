"""EvidenceBundle: one run's evidence directory: the immutable `files/<name>` within the limits
(`files`), result.json with its shape and merge rules (`result`), the budget ledger (`ledger.json`)
and the journal of in-loop entries (`journal`).
It holds the one lock, scans every byte for live secrets before it leaves memory and writes every
file atomically. On any error nothing changes, on disk or in memory.
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dppo_harness.evidence import files
from dppo_harness.evidence.backend import Backend
from dppo_harness.evidence.budget import CLOSING_BYTES, CLOSING_RECORDS, RECORD
from dppo_harness.evidence.files import (
    FILES_DIR,
    LATEST_FILE,
    LEDGER_FILE,
    MAX_FILES,
    RESULT_FILE,
    EvidenceError,
    FileEntry,
    LimitError,
    ResultShapeError,
    UnwritableEvidenceError,
    append_durably,
    atomic_write,
    dump_json,
    json_file_bytes,
    sidecar_files,
    unwritable_line,
)
from dppo_harness.evidence.journal import Journal
from dppo_harness.evidence.result import (
    as_text,
    check_rehearsal_plan_result,
    check_update_keys,
    initial_result,
    label_summary,
    merged_result,
    stopped_state,
    validate_result,
)
from dppo_harness.json_types import JsonObject
from dppo_harness.service.secrets_scan import SecretLeakError, scanner_for


class EvidenceBundle:
    """One run's evidence directory (`<root>/<run_id>/`). Thread-safe; every write is atomic."""

    def __init__(self, run_dir: Path, env: Mapping[str, str] | None, clock: Callable[[], float]):
        """A new, empty run (see `create`)."""
        self.dir = run_dir
        self.run_id = run_dir.name
        self._result: dict[str, Any] = initial_result()
        self._env = env  # None = os.environ, read at every scan so late-set secrets count too
        self._lock = threading.RLock()
        self._clock, self._t0 = clock, clock()
        self._ledger: dict[str, Any] = {"budget": None, "stages": []}
        self._rehearsal_plan = False  # set by record_plan for a plan of kind "rehearsal"
        self.unwritable: str | None = None  # the first refused write's line; the run fails with it
        self._closing: frozenset[str] = frozenset()  # names reserved for the close (reserve_closing)
        self._closing_bytes = 0
        self.journal = Journal(self)  # in-loop durability: entries, not files

    @classmethod
    def create(
        cls,
        root: Path,
        run_id: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> EvidenceBundle:
        root = Path(root)
        run_id = run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)
        if not files.NAME_RE.match(run_id):
            raise EvidenceError(f"run_id {run_id!r}: use letters, digits, '.', '_' or '-' only")
        run_dir = root / run_id
        if run_dir.exists():
            raise EvidenceError(f"run directory {run_dir} already exists; give another run_id")
        try:
            (run_dir / FILES_DIR).mkdir(parents=True)
        except OSError as exc:
            raise UnwritableEvidenceError(unwritable_line(run_dir, exc)) from None
        bundle = cls(run_dir, env, clock)
        bundle._write_result(bundle._result)
        bundle._write(root / LATEST_FILE, (run_id + "\n").encode())  # last: it never names a run without result.json
        return bundle

    # -- reading

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @property
    def result(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._result)

    def file_path(self, name: str) -> Path:
        return self.dir / FILES_DIR / name

    def files(self) -> list[FileEntry]:
        with self._lock:
            return [FileEntry(**f) for f in self._entries()]

    def entry(self, name: str) -> FileEntry | None:
        return next((f for f in self.files() if f["name"] == name), None)

    def _entries(self) -> list[FileEntry]:
        entries: list[FileEntry] = self._result["evidence"]["files"]
        return entries

    # -- secret scanning and refused writes

    def _scan(self, data: bytes, what: str) -> None:
        try:
            scanner_for(self._env).check(data, what)
        except SecretLeakError as exc:
            self._stop(f"Run stopped by the evidence secret scanner ({exc}).")  # the message names variables only
            raise

    def _sidecar_leak(self) -> str | None:
        """The scanner's line for the first file beside the bundle (state, metrics logs, server log)
        holding a secret, else None."""
        scanner = scanner_for(self._env)
        for fp in sidecar_files(self.dir):
            try:
                scanner.check(fp.read_bytes(), f"{fp.relative_to(self.dir.parent)} (beside the bundle)")
            except SecretLeakError as exc:
                return str(exc)
            except OSError:
                continue  # gone or unreadable: nothing of it can reach a reader through the bundle
        return None

    def _stop(self, summary: str) -> None:
        """Write the failed, closed result the evidence itself calls for; if it cannot land, the old
        result.json stays (the exception on the way already fails the run loudly)."""
        state = stopped_state(self._result, summary)
        try:
            validate_result(state)
            data = dump_json(state)
            scanner_for(self._env).check(data, RESULT_FILE)
            atomic_write(self.dir / RESULT_FILE, data)
        except (OSError, SecretLeakError, ResultShapeError, ValueError):
            return
        self._result = state

    def _write(self, path: Path, data: bytes, append: bool = False) -> None:
        """atomic_write (or append_durably), a refusal (disk full, read-only, permission) as one line; the
        run then fails: result.json is closed failed now if it can be written, else at the next write that lands."""
        try:
            (append_durably if append else atomic_write)(path, data)
        except OSError as exc:
            line = unwritable_line(path, exc)
            if self.unwritable is None:
                self.unwritable = line
                if path.name != RESULT_FILE and self._result["status"] != "failed":
                    self._stop(_unwritable_summary(line))
            raise UnwritableEvidenceError(line) from None

    # -- files

    def register_bytes(self, name: str, kind: str, data: bytes) -> FileEntry:
        """Register immutable bytes under `name`. Same bytes again is a no-op; different bytes fail.
        Every limit is checked here, the closing reserve with them."""
        data = bytes(data)
        with self._lock:
            entries = self._entries()
            entry, is_new = files.admit(name, kind, data, entries)
            if not is_new:
                return entry
            self._scan(data, f"evidence file {name!r}")
            slots, nbytes = (0, 0) if name in self._closing else self._closing_left(entries)
            files.check_limits(entry, entries, slots, nbytes)
            self._write(self.file_path(name), data)
            new = copy.deepcopy(self._result)
            new["evidence"]["files"].append(dict(entry))
            self._commit(new)
            return FileEntry(**entry)

    def register_json(self, name: str, kind: str, obj: object) -> FileEntry:
        return self.register_bytes(name, kind, json_file_bytes(name, obj))

    def append_beside(self, name: str, data: bytes) -> None:
        """Append to a sidecar beside the bundle (the journal), scanned first and fsynced before this
        returns, through the same refusal as every evidence write."""
        with self._lock:
            self._scan(data, f"{name} (beside the bundle)")
            self._write(self.dir / name, bytes(data), append=True)

    def reserve_closing(self) -> None:
        """Keep a file slot for each closing record and CLOSING_BYTES in total until they are registered:
        any other file that would take them is refused (LimitError), so the close always fits. The
        ledger records the limits and the reserve."""
        with self._lock:
            self._closing, self._closing_bytes = frozenset(CLOSING_RECORDS), CLOSING_BYTES
        self.note_ledger(evidence_budget=RECORD)  # note_ledger keeps a copy

    def _closing_left(self, entries: Sequence[FileEntry]) -> tuple[int, int]:
        """(file slots, bytes) still reserved for closing records not yet registered."""
        names = len(self._closing - {e["name"] for e in entries})
        return names, (self._closing_bytes if names else 0)

    def free_slots(self) -> int:
        """File slots any file may still take (the closing reserve left out)."""
        with self._lock:
            entries = self._entries()
            return MAX_FILES - len(entries) - self._closing_left(entries)[0]

    # -- result.json

    def _write_result(self, state: JsonObject) -> None:
        summary = state["summary"]
        if isinstance(summary, str):  # anything else fails validate_result below
            state["summary"] = label_summary(state, summary, self._rehearsal_plan)
        validate_result(state)
        if self._rehearsal_plan:
            check_rehearsal_plan_result(state)
        data = dump_json(state)
        self._scan(data, RESULT_FILE)
        self._write(self.dir / RESULT_FILE, data)

    def _commit(self, new: JsonObject) -> None:
        """Write `new` as result.json, then adopt it (a failed write leaves the old state); after a
        refused write the result is failed, whatever is merged later."""
        if self.unwritable is not None and new["status"] != "failed":
            new = stopped_state(new, _unwritable_summary(self.unwritable))
        self._write_result(new)
        self._result = new

    def _append(self, key: tuple[str, ...], item: Mapping[str, object]) -> None:
        """Append `item` to the list at `key` once (the same item again is a no-op)."""
        with self._lock:
            new = copy.deepcopy(self._result)
            target: Any = new
            for k in key:
                target = target[k]
            if item not in target:
                target.append(item)
                self._commit(new)

    def update_result(self, **fields: Any) -> None:
        """Deep-merge fields into result.json (`result.merged_result`: no posted number is dropped,
        completed_arms only grows); on any error nothing changes, on disk or in memory."""
        check_update_keys(fields)
        with self._lock:
            self._commit(merged_result(self._result, fields))

    def set_backend(self, backend: Backend) -> None:
        """The backend block; a local backend also forces the rehearsal label onto the summary."""
        with self._lock:
            self._commit({**copy.deepcopy(self._result), "backend": backend.to_json()})

    def post_arm_metrics(self, arm: str, metrics: Mapping[str, float], *, completed: bool = False) -> None:
        done = {"completed_arms": [arm]} if completed else {}
        self.update_result(
            metrics={"arms": {arm: dict(metrics)}}, evidence={"per_arm_metrics": {arm: dict(metrics)}}, **done
        )

    def add_deviation(self, field: str, original: object, effective: object, reason: str) -> None:
        """A deviation once (the result's shape refuses a field outside DEVIATION_FIELDS)."""
        dev = {"field": field, "original": as_text(original), "effective": as_text(effective), "reason": str(reason)}
        self._append(("deviations",), dev)

    def add_checkpoint(self, arm: str, step: int, uri: str) -> None:
        parts = urlsplit(uri)
        if not parts.scheme or parts.query or parts.fragment or "@" in parts.netloc:
            raise EvidenceError(
                "checkpoint uri: expected a plain reference such as tinker://<id>/weights/<name> "
                "(no query string, fragment or credentials)"
            )
        self._append(("evidence", "checkpoints"), {"arm": arm, "step": step, "uri": uri})

    def finish(
        self, status: str, verdict: str, outcome_reason: str | None = None, summary: str | None = None, **fields: Any
    ) -> None:
        """Final result first, so nothing after it can lose it; then the budget ledger as a file,
        or, when the bundle has no slot left for it, a note in ledger.json saying so."""
        final = dict(fields, status=status, verdict=verdict)
        final |= {k: v for k, v in (("outcome_reason", outcome_reason), ("summary", summary)) if v is not None}
        leak = self._sidecar_leak()
        with self._lock:
            if leak is None:
                self.update_result(**final)
            else:  # a sidecar holds a secret: the run failed, whatever it reached
                self._stop(f"Run stopped by the evidence secret scanner ({leak}).")
            if self._ledger["stages"] or self._ledger["budget"]:
                try:
                    self.register_json("budget-ledger.json", "manifest", self.ledger())
                except LimitError as exc:
                    self.note_ledger(ledger_file_not_registered=str(exc))

    # -- budget ledger (ledger.json): the ledger keeps and judges times, result.json gets its metrics

    def elapsed_seconds(self) -> float:
        return self._clock() - self._t0

    def remaining_seconds(self) -> float | None:
        b = self._ledger["budget"]
        return None if b is None else b["max_wall_seconds"] - self.elapsed_seconds()

    def set_budget(self, max_wall_seconds: float, gpu_hours: float | None = None) -> None:
        with self._lock:
            self._ledger["budget"] = {
                "max_wall_seconds": float(max_wall_seconds),
                "gpu_hours": None if gpu_hours is None else float(gpu_hours),
            }
            self._post_ledger({"budget/max_wall_seconds": float(max_wall_seconds)})

    def budget_allows(self, stage: str, projected_seconds: float) -> bool:
        """False (and the stage recorded as blocked_by_budget) if the projection exceeds what remains."""
        with self._lock:
            remaining = self.remaining_seconds()
            if remaining is None:
                raise EvidenceError("budget_allows: no budget set (call set_budget first)")
            if projected_seconds <= remaining:
                return True
            projected, remaining = float(projected_seconds), float(remaining)
            reason = f"projected {projected:.1f}s > remaining {remaining:.1f}s of wall budget"
            seconds = {"projected_seconds": projected, "remaining_seconds": remaining}
            self._ledger["stages"].append(
                {"stage": stage, "seconds": 0.0, "status": "blocked_by_budget", **seconds, "reason": reason}
            )
            self._post_ledger(
                {f"budget/blocked/{stage}": 1.0, **{f"budget/{k}/{stage}": v for k, v in seconds.items()}}
            )
            return False

    def stage_timing(self, stage: str, seconds: float, status: str) -> None:
        """One stage timing; posts the stage's and the run's total wall seconds."""
        with self._lock:
            stages = self._ledger["stages"]
            stages.append(
                {"stage": stage, "seconds": float(seconds), "status": status, "elapsed_at_end": self.elapsed_seconds()}
            )
            self._post_ledger(
                {
                    f"budget/wall_seconds/{stage}": sum(s["seconds"] for s in stages if s["stage"] == stage),
                    "budget/wall_seconds_total": sum(s["seconds"] for s in stages),
                }
            )

    def ledger(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._ledger)

    def note_ledger(self, **items: Any) -> None:
        """Session facts kept in ledger.json (stages_selected, budget_source, stage_failures)."""
        with self._lock:
            self._ledger.update(copy.deepcopy(items))
            self._write_ledger()

    def _post_ledger(self, metrics: dict[str, float]) -> None:
        self._write_ledger()
        self.update_result(metrics=metrics)

    def _write_ledger(self) -> None:
        data = dump_json(self._ledger)
        self._scan(data, LEDGER_FILE)
        self._write(self.dir / LEDGER_FILE, data)

    def mark_rehearsal_plan(self) -> None:
        """The run executes a rehearsal plan: its result must say so, now and at every later update."""
        with self._lock:
            check_rehearsal_plan_result(self._result)
            self._rehearsal_plan = True


def _unwritable_summary(line: str) -> str:
    return f"Run stopped: its evidence could not be written ({line})."

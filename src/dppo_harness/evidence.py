"""Evidence bundle: registered immutable files, result.json in the brief's shape, verify CLI.

Layout of one run (`<root>/<run_id>/`):
    result.json       the structured output, rewritten atomically after every update
    files/<name>      every registered evidence file (name, kind, sha256, size in result.json)
    ledger.json       the budget ledger sidecar (also registered as budget-ledger.json at finish)
`<root>/LATEST` holds the newest run_id.

Every byte that leaves memory (files and result.json) is scanned first for the live secret
values in the environment; a match blocks the write and raises SecretLeakError.

    python -m dppo_harness.evidence verify DIR     # DIR: a run dir, or a root with LATEST
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import secrets as _random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from dppo_harness.secrets_scan import SecretLeakError, SecretScanner, scanner_for

MAX_FILE_BYTES = 10 * 1024 * 1024
MAX_FILES = 64
MAX_TOTAL_BYTES = 40 * 1024 * 1024

KINDS = frozenset({
    "script", "effective_config", "code_revision", "code_patch", "predictions", "metrics", "plan",
    "report", "tensors", "manifest", "plot", "log", "generated_tasks",
})
DEVIATION_FIELDS = ("model", "objective", "effective_batch", "steps", "dataset", "evaluator", "endpoint")
STATUSES = ("running", "succeeded", "failed")
VERDICTS = ("supported", "refuted", "inconclusive")
OUTCOME_REASONS = ("supported", "refuted", "tie", "mixed_criteria", "insufficient_evidence", "incomplete_execution")
REHEARSAL_PREFIX = "Local rehearsal on the embedded CPU server, not Spindle: "

RESULT_FILE = "result.json"
LEDGER_FILE = "ledger.json"
FILES_DIR = "files"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RESERVED = {RESULT_FILE, LEDGER_FILE, "LATEST"}
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")

# Keys the brief's structured output has, plus the `backend` block this harness adds.
_REQUIRED_KEYS = (
    "status", "summary", "metrics", "completed_arms", "deviations", "original_hypothesis_tested",
    "tested_instead", "correctness_preflight", "initialization_provenance", "activation_calibration",
    "feasibility", "evaluation", "decision", "evidence", "backend",
)
_OPTIONAL_KEYS = ("verdict", "outcome_reason", "capacity_block", "generation_audit")
# Managed by dedicated methods so their invariants hold; update_result refuses them.
_PROTECTED = {("deviations",), ("evidence", "files"), ("evidence", "checkpoints"), ("evidence", "version"), ("backend",)}


class EvidenceError(RuntimeError):
    """Bad input to the bundle; nothing was written."""


class LimitError(EvidenceError):
    pass


class ImmutableNameError(EvidenceError):
    pass


class ResultShapeError(EvidenceError):
    pass


__all__ = [
    "EvidenceBundle", "EvidenceError", "LimitError", "ImmutableNameError", "ResultShapeError",
    "SecretLeakError", "validate_result", "verify_bundle", "code_revision", "main",
]


# ----------------------------------------------------------------------------- helpers


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory, fsync, then os.replace (never a torn file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{_random.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _dump_json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number_paths(obj: Any, path: tuple = ()) -> Iterator[tuple]:
    if _is_number(obj):
        yield path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _number_paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _number_paths(v, path + (i,))


def _get_path(obj: Any, path: tuple) -> Any:
    for p in path:
        if isinstance(obj, dict) and p in obj:
            obj = obj[p]
        elif isinstance(obj, list) and isinstance(p, int) and p < len(obj):
            obj = obj[p]
        else:
            return _MISSING
    return obj


_MISSING = object()


def _deep_merge(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        out = dict(old)
        for k, v in new.items():
            out[k] = _deep_merge(old[k], v) if k in old else copy.deepcopy(v)
        return out
    return copy.deepcopy(new)


def _fmt_path(path: tuple) -> str:
    s = ""
    for p in path:
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s


# ----------------------------------------------------------------------------- result shape


def _check_num_map(obj: Any, where: str) -> None:
    if not isinstance(obj, dict):
        raise ResultShapeError(f"{where}: expected object, got {type(obj).__name__}")
    for k, v in obj.items():
        if not _is_number(v) or not math.isfinite(v):
            raise ResultShapeError(f"{where}.{k}: expected a finite number, got {v!r}")


def validate_result(r: Any) -> None:
    """Raise ResultShapeError unless r has the brief's structured-output shape (+ backend)."""
    if not isinstance(r, dict):
        raise ResultShapeError("result: expected object")
    for k in _REQUIRED_KEYS:
        if k not in r:
            raise ResultShapeError(f"{k}: missing required key")
    for k in r:
        if k not in _REQUIRED_KEYS and k not in _OPTIONAL_KEYS:
            raise ResultShapeError(f"{k}: unknown key (the structured output has a fixed shape)")
    status = r["status"]
    if status not in STATUSES:
        raise ResultShapeError(f"status: expected one of {list(STATUSES)}, got {status!r}")
    if not isinstance(r["summary"], str):
        raise ResultShapeError("summary: expected string")
    metrics = r["metrics"]
    if not isinstance(metrics, dict) or not isinstance(metrics.get("arms"), dict):
        raise ResultShapeError("metrics: expected object with an 'arms' object")
    _check_num_map({k: v for k, v in metrics.items() if k != "arms"}, "metrics")
    for arm, m in metrics["arms"].items():
        _check_num_map(m, f"metrics.arms.{arm}")
    ca = r["completed_arms"]
    if not isinstance(ca, list) or not all(isinstance(a, str) for a in ca):
        raise ResultShapeError("completed_arms: expected list of strings")
    for a in ca:
        if a not in metrics["arms"]:
            raise ResultShapeError(f"completed_arms: arm {a!r} has no metrics under metrics.arms")
    final = status != "running"
    if "verdict" in r:
        if not final:
            raise ResultShapeError("verdict: leave it out while status is running")
        if r["verdict"] not in VERDICTS:
            raise ResultShapeError(f"verdict: expected one of {list(VERDICTS)}, got {r['verdict']!r}")
    elif final:
        raise ResultShapeError(f"verdict: a finished result (status {status}) must include a verdict")
    if "outcome_reason" in r:
        reason = r["outcome_reason"]
        if not final:
            raise ResultShapeError("outcome_reason: report it only with a final result")
        if reason not in OUTCOME_REASONS:
            raise ResultShapeError(f"outcome_reason: expected one of {list(OUTCOME_REASONS)}, got {reason!r}")
        if reason in ("supported", "refuted") and r["verdict"] != reason:
            raise ResultShapeError(f"outcome_reason: {reason!r} requires verdict {reason!r}")
        if reason not in ("supported", "refuted") and r["verdict"] != "inconclusive":
            raise ResultShapeError(f"outcome_reason: {reason!r} requires verdict 'inconclusive'")
    if "capacity_block" in r:
        cb = r["capacity_block"]
        if not isinstance(cb, dict) or set(cb) != {"error", "comparison_steps_completed", "released_clients"}:
            raise ResultShapeError("capacity_block: expected exactly error, comparison_steps_completed, released_clients")
        if not isinstance(cb["error"], str) or not isinstance(cb["released_clients"], bool) or \
                isinstance(cb["comparison_steps_completed"], bool) or not isinstance(cb["comparison_steps_completed"], int):
            raise ResultShapeError("capacity_block: error str, comparison_steps_completed int, released_clients bool")
        if status != "failed":
            raise ResultShapeError("capacity_block: only a failed run stopped by capacity carries it")
    devs = r["deviations"]
    if not isinstance(devs, list):
        raise ResultShapeError("deviations: expected list")
    for i, d in enumerate(devs):
        if not isinstance(d, dict) or set(d) != {"field", "original", "effective", "reason"}:
            raise ResultShapeError(f"deviations[{i}]: expected exactly field, original, effective, reason")
        if d["field"] not in DEVIATION_FIELDS:
            raise ResultShapeError(f"deviations[{i}].field: expected one of {list(DEVIATION_FIELDS)}, got {d['field']!r}")
        for k in ("original", "effective", "reason"):
            if not isinstance(d[k], str):
                raise ResultShapeError(f"deviations[{i}].{k}: expected string")
    oht = r["original_hypothesis_tested"]
    if oht is None:
        if final:
            raise ResultShapeError("original_hypothesis_tested: a finished result must say true or false")
    elif not isinstance(oht, bool):
        raise ResultShapeError("original_hypothesis_tested: expected bool")
    elif oht is False and not (isinstance(r["tested_instead"], str) and r["tested_instead"].strip()):
        raise ResultShapeError("tested_instead: required when original_hypothesis_tested is false")
    if r["tested_instead"] is not None and not isinstance(r["tested_instead"], str):
        raise ResultShapeError("tested_instead: expected string or null")
    ev = r["evidence"]
    if not isinstance(ev, dict) or set(ev) != {"version", "files", "checkpoints", "per_arm_metrics"}:
        raise ResultShapeError("evidence: expected exactly version, files, checkpoints, per_arm_metrics")
    if ev["version"] != 1:
        raise ResultShapeError("evidence.version: expected 1")
    for i, f in enumerate(ev["files"]):
        if not isinstance(f, dict) or set(f) != {"name", "kind", "sha256", "size"}:
            raise ResultShapeError(f"evidence.files[{i}]: expected exactly name, kind, sha256, size")
        if f["kind"] not in KINDS or not _SHA_RE.match(str(f["sha256"])) or not isinstance(f["size"], int):
            raise ResultShapeError(f"evidence.files[{i}]: bad kind, sha256 or size")
    for i, c in enumerate(ev["checkpoints"]):
        if not isinstance(c, dict) or set(c) != {"arm", "step", "uri"} or not isinstance(c["step"], int):
            raise ResultShapeError(f"evidence.checkpoints[{i}]: expected arm, step (int), uri")
    if not isinstance(ev["per_arm_metrics"], dict):
        raise ResultShapeError("evidence.per_arm_metrics: expected object")
    for arm, m in ev["per_arm_metrics"].items():
        _check_num_map(m, f"evidence.per_arm_metrics.{arm}")
    be = r["backend"]
    if be is not None and (not isinstance(be, dict) or be.get("kind") not in ("local", "tinker")):
        raise ResultShapeError("backend: expected null or an object with kind 'local' or 'tinker'")
    if isinstance(be, dict) and be["kind"] == "local" and not r["summary"].startswith(REHEARSAL_PREFIX):
        raise ResultShapeError("summary: a local-backend result must be labelled as a rehearsal")
    try:
        json.dumps(r, allow_nan=False)
    except ValueError as exc:
        raise ResultShapeError(f"result: non-finite number ({exc})") from None


def initial_result() -> dict[str, Any]:
    return {
        "status": "running",
        "summary": "",
        "metrics": {"arms": {}},
        "completed_arms": [],
        "deviations": [],
        "original_hypothesis_tested": None,
        "tested_instead": None,
        "correctness_preflight": None,
        "initialization_provenance": None,
        "activation_calibration": None,
        "feasibility": None,
        "evaluation": None,
        "decision": None,
        "evidence": {"version": 1, "files": [], "checkpoints": [], "per_arm_metrics": {}},
        "backend": None,
    }


# ----------------------------------------------------------------------------- bundle


class EvidenceBundle:
    """One run's evidence directory. Thread-safe; every write is atomic."""

    def __init__(self, run_dir: Path, result: dict[str, Any], secret_values: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic):
        self.dir = run_dir
        self.run_id = run_dir.name
        self._result = result
        self._secret_values = tuple(secret_values)
        self._env = env  # None = os.environ, read at every scan so late-set secrets count too
        self._lock = threading.RLock()
        self._clock = clock
        self._t0 = clock()
        self._ledger: dict[str, Any] = {"budget": None, "stages": []}
        ledger_path = run_dir / LEDGER_FILE
        if ledger_path.exists():
            self._ledger = json.loads(ledger_path.read_text())

    # -- construction

    @classmethod
    def create(cls, root: Path, run_id: str | None = None, secret_values: Sequence[str] = (), *,
               env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> "EvidenceBundle":
        root = Path(root)
        run_id = run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + _random.token_hex(3)
        if not _NAME_RE.match(run_id):
            raise EvidenceError(f"run_id {run_id!r}: use letters, digits, '.', '_' or '-' only")
        run_dir = root / run_id
        if run_dir.exists():
            raise EvidenceError(f"run directory {run_dir} already exists; open it with EvidenceBundle.open")
        (run_dir / FILES_DIR).mkdir(parents=True)
        bundle = cls(run_dir, initial_result(), secret_values, env, clock)
        bundle._write_result()
        atomic_write(root / "LATEST", (run_id + "\n").encode())
        return bundle

    @classmethod
    def open(cls, run_dir: Path, secret_values: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
             clock: Callable[[], float] = time.monotonic) -> "EvidenceBundle":
        run_dir = Path(run_dir)
        result = json.loads((run_dir / RESULT_FILE).read_text(encoding="utf-8"))
        validate_result(result)
        return cls(run_dir, result, secret_values, env, clock)

    # -- reading

    @property
    def result(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._result)

    def file_path(self, name: str) -> Path:
        return self.dir / FILES_DIR / name

    def files(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(f) for f in self._result["evidence"]["files"]]

    def entry(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            for f in self._result["evidence"]["files"]:
                if f["name"] == name:
                    return dict(f)
        return None

    # -- secret scanning

    def _scanner(self) -> SecretScanner:
        return scanner_for(self._env, self._secret_values)

    def _scan(self, data: bytes, what: str) -> None:
        try:
            self._scanner().check(data, what)
        except SecretLeakError as exc:
            self._mark_failed_after_leak(str(exc))
            raise

    def _mark_failed_after_leak(self, message: str) -> None:
        # The message names variables only. Record the failure without the offending content.
        fields = {"status": "failed", "verdict": "inconclusive", "outcome_reason": "incomplete_execution"}
        state = _deep_merge(self._result, fields)
        if state["original_hypothesis_tested"] is None:
            state["original_hypothesis_tested"] = False
            state["tested_instead"] = "nothing: the run stopped before any claim could be tested"
        state["summary"] = self._label(state, f"Run stopped by the evidence secret scanner ({message}).")
        try:
            data = _dump_json(state)
            self._scanner().check(data, RESULT_FILE)
            validate_result(state)
        except (SecretLeakError, ResultShapeError, ValueError):
            return  # the old result.json stays; the exception already fails the run loudly
        self._result = state
        atomic_write(self.dir / RESULT_FILE, data)

    # -- files

    def register_bytes(self, name: str, kind: str, data: bytes) -> dict:
        """Register immutable bytes under `name`. Same bytes again is a no-op; different bytes fail."""
        if not isinstance(name, str) or not _NAME_RE.match(name) or name in _RESERVED:
            raise EvidenceError(f"file name {name!r}: use 1-128 of letters, digits, '.', '_', '-' (not a reserved name)")
        if kind not in KINDS:
            raise EvidenceError(f"file {name!r}: unknown kind {kind!r}; expected one of {sorted(KINDS)}")
        if not isinstance(data, (bytes, bytearray)):
            raise EvidenceError(f"file {name!r}: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        digest, size = sha256_bytes(data), len(data)
        with self._lock:
            existing = self.entry(name)
            if existing is not None:
                if existing["sha256"] == digest and existing["kind"] == kind:
                    return existing
                raise ImmutableNameError(
                    f"file {name!r} is already registered with different {'bytes' if existing['sha256'] != digest else 'kind'}"
                    f" (sha256 {existing['sha256'][:12]}…, kind {existing['kind']}); use a new name")
            self._scan(data, f"evidence file {name!r}")
            files = self._result["evidence"]["files"]
            if size > MAX_FILE_BYTES:
                raise LimitError(f"file {name!r} is {size} bytes; the limit is {MAX_FILE_BYTES} bytes (10 MiB) per file")
            if len(files) + 1 > MAX_FILES:
                raise LimitError(f"file {name!r} would be file {len(files) + 1}; the limit is {MAX_FILES} files per run")
            total = sum(f["size"] for f in files)
            if total + size > MAX_TOTAL_BYTES:
                raise LimitError(f"file {name!r} ({size} bytes) would bring the run to {total + size} bytes; "
                                 f"the limit is {MAX_TOTAL_BYTES} bytes (40 MiB) in total")
            atomic_write(self.file_path(name), data)
            entry = {"name": name, "kind": kind, "sha256": digest, "size": size}
            files.append(entry)
            try:
                self._write_result()
            except Exception:
                files.remove(entry)
                raise
            return dict(entry)

    def register_json(self, name: str, kind: str, obj: Any) -> dict:
        try:
            data = (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False, ensure_ascii=False) + "\n").encode()
        except (TypeError, ValueError) as exc:
            raise EvidenceError(f"file {name!r}: not JSON-serializable without NaN/inf ({exc})") from None
        return self.register_bytes(name, kind, data)

    def register_file(self, name: str, kind: str, path: Path) -> dict:
        path = Path(path)
        if not path.is_file():
            raise EvidenceError(f"file {name!r}: source {path} does not exist or is not a file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise LimitError(f"file {name!r} is {path.stat().st_size} bytes; the limit is {MAX_FILE_BYTES} bytes (10 MiB) per file")
        return self.register_bytes(name, kind, path.read_bytes())

    # -- result.json

    def _label(self, state: dict, summary: str) -> str:
        be = state.get("backend")
        if isinstance(be, dict) and be.get("kind") == "local" and not summary.startswith(REHEARSAL_PREFIX):
            return REHEARSAL_PREFIX + summary
        return summary

    def _write_result(self, state: dict | None = None) -> None:
        state = self._result if state is None else state
        state["summary"] = self._label(state, state["summary"])
        validate_result(state)
        data = _dump_json(state)
        self._scan(data, RESULT_FILE)
        atomic_write(self.dir / RESULT_FILE, data)

    def update_result(self, **fields: Any) -> None:
        """Deep-merge fields into result.json and rewrite it atomically.

        Every number posted earlier must still be there afterwards (values may be updated, never
        dropped); completed_arms only grows. On any error nothing changes, on disk or in memory.
        """
        for key, value in fields.items():
            if (key,) in _PROTECTED:
                raise EvidenceError(f"{key}: use the dedicated bundle method, not update_result")
            if key == "evidence" and isinstance(value, dict):
                for sub in value:
                    if ("evidence", sub) in _PROTECTED:
                        raise EvidenceError(f"evidence.{sub}: managed by the bundle (register_*/add_checkpoint)")
        with self._lock:
            old = self._result
            new = _deep_merge(old, fields)
            if "completed_arms" in fields:
                merged = list(old["completed_arms"])
                merged += [a for a in fields["completed_arms"] if a not in merged]
                new["completed_arms"] = merged
            for path in _number_paths(old):
                if not _is_number(_get_path(new, path)):
                    raise EvidenceError(f"{_fmt_path(path)}: an earlier posted number would be dropped")
            self._write_result(new)
            self._result = new

    def set_backend(self, kind: str, *, requested_model: str, served_model: str,
                    sdk_versions: Mapping[str, str], **extra: Any) -> None:
        """The backend block; a local backend also forces the rehearsal label onto the summary."""
        if kind not in ("local", "tinker"):
            raise EvidenceError(f"backend kind {kind!r}: expected 'local' or 'tinker'")
        block = {"kind": kind, "requested_model": requested_model, "served_model": served_model,
                 "sdk_versions": dict(sdk_versions), **extra}
        with self._lock:
            new = copy.deepcopy(self._result)
            new["backend"] = block
            self._write_result(new)
            self._result = new

    def post_arm_metrics(self, arm: str, metrics: Mapping[str, float], *, completed: bool = False) -> None:
        fields: dict[str, Any] = {"metrics": {"arms": {arm: dict(metrics)}},
                                  "evidence": {"per_arm_metrics": {arm: dict(metrics)}}}
        if completed:
            fields["completed_arms"] = [arm]
        self.update_result(**fields)

    def add_deviation(self, field: str, original: Any, effective: Any, reason: str) -> None:
        if field not in DEVIATION_FIELDS:
            raise EvidenceError(f"deviation field {field!r}: expected one of {list(DEVIATION_FIELDS)}")
        dev = {"field": field, "original": _as_text(original), "effective": _as_text(effective), "reason": str(reason)}
        with self._lock:
            if dev in self._result["deviations"]:
                return
            new = copy.deepcopy(self._result)
            new["deviations"].append(dev)
            self._write_result(new)
            self._result = new

    def add_checkpoint(self, arm: str, step: int, uri: str) -> None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise EvidenceError(f"checkpoint step: expected int, got {type(step).__name__}")
        parts = urlsplit(uri)
        if not parts.scheme or parts.query or parts.fragment or "@" in parts.netloc:
            raise EvidenceError("checkpoint uri: expected a plain reference such as tinker://<id>/weights/<name> "
                                "(no query string, fragment or credentials)")
        cp = {"arm": arm, "step": step, "uri": uri}
        with self._lock:
            if cp in self._result["evidence"]["checkpoints"]:
                return
            new = copy.deepcopy(self._result)
            new["evidence"]["checkpoints"].append(cp)
            self._write_result(new)
            self._result = new

    def finish(self, status: str, verdict: str, outcome_reason: str | None = None, summary: str | None = None,
               **fields: Any) -> None:
        """Final result; also registers the budget ledger."""
        final = dict(fields, status=status, verdict=verdict)
        if outcome_reason is not None:
            final["outcome_reason"] = outcome_reason
        if summary is not None:
            final["summary"] = summary
        if self._ledger["stages"] or self._ledger["budget"]:
            self.register_json("budget-ledger.json", "manifest", self._ledger)
        self.update_result(**final)

    # -- budget ledger

    def elapsed_seconds(self) -> float:
        return self._clock() - self._t0

    def set_budget(self, max_wall_seconds: float, gpu_hours: float | None = None) -> None:
        with self._lock:
            self._ledger["budget"] = {"max_wall_seconds": float(max_wall_seconds),
                                      "gpu_hours": None if gpu_hours is None else float(gpu_hours)}
            self._write_ledger()
            self.update_result(metrics={"budget/max_wall_seconds": float(max_wall_seconds)})

    def remaining_seconds(self) -> float | None:
        b = self._ledger["budget"]
        return None if b is None else b["max_wall_seconds"] - self.elapsed_seconds()

    def budget_allows(self, stage: str, projected_seconds: float, projected_gpu_hours: float | None = None) -> bool:
        """False (and the stage recorded as blocked_by_budget) if the projection exceeds what remains."""
        with self._lock:
            b = self._ledger["budget"]
            if b is None:
                raise EvidenceError("budget_allows: no budget set (call set_budget first)")
            remaining = self.remaining_seconds()
            reasons = []
            if projected_seconds > remaining:
                reasons.append(f"projected {projected_seconds:.1f}s > remaining {remaining:.1f}s of wall budget")
            if projected_gpu_hours is not None and b["gpu_hours"] is not None and projected_gpu_hours > b["gpu_hours"]:
                reasons.append(f"projected {projected_gpu_hours:.3f} GPU-h > cap {b['gpu_hours']:.3f}")
            if not reasons:
                return True
            self._ledger["stages"].append({"stage": stage, "seconds": 0.0, "status": "blocked_by_budget",
                                           "projected_seconds": float(projected_seconds),
                                           "remaining_seconds": float(remaining), "reason": "; ".join(reasons)})
            self._write_ledger()
            self.update_result(metrics={f"budget/blocked/{stage}": 1.0,
                                        f"budget/projected_seconds/{stage}": float(projected_seconds),
                                        f"budget/remaining_seconds/{stage}": float(remaining)})
            return False

    def stage_timing(self, stage: str, seconds: float, status: str) -> None:
        with self._lock:
            self._ledger["stages"].append({"stage": stage, "seconds": float(seconds), "status": status,
                                           "elapsed_at_end": self.elapsed_seconds()})
            self._write_ledger()
            total = sum(s["seconds"] for s in self._ledger["stages"] if s["stage"] == stage)
            self.update_result(metrics={f"budget/wall_seconds/{stage}": total,
                                        "budget/wall_seconds_total": sum(s["seconds"] for s in self._ledger["stages"])})

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage into the ledger; status 'passed' or 'failed' by whether it raised."""
        t = self._clock()
        try:
            yield
        except BaseException:
            self.stage_timing(name, self._clock() - t, "failed")
            raise
        self.stage_timing(name, self._clock() - t, "passed")

    def ledger(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._ledger)

    def _write_ledger(self) -> None:
        data = _dump_json(self._ledger)
        self._scan(data, LEDGER_FILE)
        atomic_write(self.dir / LEDGER_FILE, data)

    # -- provenance

    def register_code_revision(self, repo_root: Path) -> list[dict]:
        info, patch = code_revision(Path(repo_root), exclude=[self.dir])
        entries = [self.register_json("code-revision.json", "code_revision", info)]
        if patch:
            entries.append(self.register_bytes("code.patch", "code_patch", patch))
        return entries

    def register_script(self, path: Path, repo_root: Path | None = None) -> dict:
        path = Path(path).resolve()
        rel = path.relative_to(repo_root.resolve()) if repo_root else Path(path.name)
        name = "script-" + str(rel).replace(os.sep, "__")
        return self.register_file(name, "script", path)

    def register_plan(self, plan: Any, name: str | None = None) -> dict:
        """Register a plans.Plan's exact file bytes; the recorded sha256 must equal Plan.sha256."""
        entry = self.register_bytes(name or plan.name, "plan", plan.data)
        if entry["sha256"] != plan.sha256:
            raise EvidenceError(f"plan {plan.name}: registered sha256 differs from the loaded plan's")
        return entry

    def register_effective_config(self, config: Mapping[str, Any], name: str = "effective-config.json") -> dict:
        return self.register_json(name, "effective_config", config)

    def record_plan(self, plan: Any, effective_config: Mapping[str, Any], *, plan_name: str | None = None) -> None:
        """Before any training call: the plan's exact bytes, the effective config, every deviation
        it declares (plan + backend), the hypothesis scope and generation_audit applicability.

        `effective_config` is plans.effective_config(plan, backend_info)."""
        if effective_config.get("plan", {}).get("sha256") != plan.sha256:
            raise EvidenceError("effective config was not built from this plan (sha256 differs)")
        self.register_plan(plan, plan_name)
        self.register_effective_config(effective_config)
        for d in effective_config.get("deviations", []):
            self.add_deviation(d["field"], d["original"], d["effective"], d["reason"])
        fields: dict[str, Any] = {"generation_audit": dict(effective_config["generation_audit"])}
        if "original_hypothesis_tested" in plan.raw:
            fields["original_hypothesis_tested"] = plan.raw["original_hypothesis_tested"]
            fields["tested_instead"] = plan.raw.get("tested_instead")
        elif self._result["original_hypothesis_tested"] is None and not self._result["deviations"]:
            fields["original_hypothesis_tested"] = True
        self.update_result(**fields)

    # -- pytest session (called by dppo_harness.pytest_plugin)

    def start_session(self, *, backend: str, plan: Any, stages: Sequence[str], project_root: Path,
                      test_files: Sequence[str | Path] = (), served_model: str | None = None,
                      size_reductions: Sequence[Mapping[str, str]] = ()) -> None:
        """Everything that must be in evidence before any service call of the session.

        Backend block, code revision (+ patch), the executed stage test files (kind script; unit and
        integration test files, which are many, go into one sha256 manifest to spare the 64-file
        limit), the plan's bytes, the effective config, its deviations, and the run budget.
        """
        from dppo_harness import plans as P
        from dppo_harness.service import sdk_versions

        root = Path(project_root)
        versions = sdk_versions()
        self.set_backend(backend, requested_model=plan.base_model,
                         served_model=served_model or "reported at client creation (see initialization_provenance)",
                         sdk_versions=versions)
        self.register_provenance(root, [])
        stage_files, other_files = [], []
        for f in sorted({Path(p).resolve() for p in test_files}):
            try:
                parts = f.relative_to(root.resolve()).parts
            except ValueError:
                parts = ()
            (stage_files if len(parts) > 1 and parts[0] == "tests" and parts[1] in ("preflight", "gates", "diagnostic")
             else other_files).append(f)
        for f in stage_files:
            self.register_script(f, root)
        conftest = root / "conftest.py"
        if conftest.is_file():
            self.register_script(conftest, root)
        if other_files:
            self.register_json("test-files.json", "manifest", [
                {"path": str(f.relative_to(root.resolve())) if root.resolve() in f.parents else str(f),
                 "sha256": sha256_bytes(f.read_bytes()), "size": f.stat().st_size} for f in other_files if f.is_file()])
        info = P.BackendInfo(backend=backend, requested_model=plan.base_model,  # type: ignore[arg-type]
                             served_model=served_model or "the embedded server's model (named at client creation)"
                             if backend == "local" else (served_model or plan.base_model),
                             sdk_versions=versions, size_reductions=tuple(size_reductions))
        self.record_plan(plan, P.effective_config(plan, info))
        budget, source = plan.budget, f"{plan.name} budget"
        if plan.kind == "bounded_diagnostic":
            # The diagnostic's 12-minute cap belongs to its stage; the run as a whole stays
            # inside the original experiment's budget.
            try:
                budget, source = P.check_original_plan(plan).budget, f"original plan {plan.raw['original_plan']['file']}"
            except P.PlanError as exc:
                source = f"{plan.name} caps (original plan unavailable: {exc})"
        with self._lock:
            self._ledger["stages_selected"] = list(stages)
            self._ledger["budget_source"] = source
        self.set_budget(budget["max_wall_minutes"] * 60.0, budget["gpu_hours"])

    def finish_session(self, stage_failures: Mapping[str, str] | None = None) -> None:
        """Close the session's result: fills only what no stage has set (status, verdict, reason)."""
        failures = dict(stage_failures or {})
        with self._lock:
            self._ledger["stage_failures"] = failures
            self._write_ledger()
            r = self._result
            if r["status"] != "running":
                return
            fields: dict[str, Any] = {"status": "failed" if failures else "succeeded",
                                      "verdict": r.get("verdict", "inconclusive")}
            if r["original_hypothesis_tested"] is None:
                fields["original_hypothesis_tested"] = False
                fields["tested_instead"] = ("harness stages only (" + ", ".join(self._ledger.get("stages_selected", []))
                                            + "); the accuracy comparison did not run")
            if "outcome_reason" not in r and fields["verdict"] == "inconclusive":
                fields["outcome_reason"] = "incomplete_execution"
            if not r["summary"].removeprefix(REHEARSAL_PREFIX).strip():
                ran = ", ".join(self._ledger.get("stages_selected", [])) or "no stage"
                fields["summary"] = (f"Stages run: {ran}. " + (
                    "Failed: " + "; ".join(f"{s} ({n})" for s, n in failures.items()) + "."
                    if failures else "All selected stages passed; the accuracy hypothesis was not tested."))
        self.finish(**fields)

    def register_provenance(self, repo_root: Path, scripts: Iterable[Path] = ()) -> list[dict]:
        """Code revision (+ code_patch) and the executed stage test files (kind script)."""
        entries = self.register_code_revision(repo_root)
        for s in scripts:
            entries.append(self.register_script(Path(s), Path(repo_root)))
        return entries


def _as_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


# ----------------------------------------------------------------------------- code revision


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=60)


def _source_sha256(root: Path) -> str | None:
    pkg = root / "src" / "dppo_harness"
    if not pkg.is_dir():
        return None
    h = hashlib.sha256()
    for p in sorted(pkg.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def code_revision(root: Path, exclude: Iterable[Path] = ()) -> tuple[dict[str, Any], bytes]:
    """(revision info, patch bytes): git commit plus the full uncommitted diff, untracked files included.

    Read-only: uses `git diff --no-index` for untracked files instead of touching the index.
    """
    info: dict[str, Any] = {"repo": root.name, "source_sha256": _source_sha256(root)}
    head = _git(root, "rev-parse", "HEAD") if (root / ".git").exists() else None
    if head is None or head.returncode != 0:
        info.update({"commit": None, "available": False,
                     "reason": "not a git checkout (or no commit); source_sha256 identifies the package source"})
        return info, b""
    info.update({"commit": head.stdout.decode().strip(), "available": True})
    tracked = _git(root, "diff", "HEAD", "--binary").stdout
    excl = [Path(e).resolve() for e in exclude]
    untracked, skipped = [], []
    out = _git(root, "ls-files", "--others", "--exclude-standard", "-z").stdout.decode()
    for rel in filter(None, out.split("\0")):
        p = (root / rel).resolve()
        if any(p == e or e in p.parents for e in excl):
            continue
        if p.stat().st_size > 2 * 1024 * 1024:  # large data: listed with its hash, not inlined
            skipped.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_bytes(p.read_bytes())})
            continue
        untracked.append(rel)
    parts = [tracked]
    for rel in untracked:
        parts.append(_git(root, "diff", "--no-index", "--binary", "--", "/dev/null", rel).stdout)
    patch = b"".join(parts)
    info.update({"dirty": bool(patch), "untracked_files": untracked, "untracked_not_in_patch": skipped,
                 "patch_sha256": sha256_bytes(patch) if patch else None})
    return info, patch


# ----------------------------------------------------------------------------- verify


_REF_KEYS = ("evidence_ref", "predictions_ref", "manifest_ref", "dataset_file", "evaluation_file", "audit_file")


def _iter_refs(obj: Any, path: tuple = ()) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = path + (k,)
            if isinstance(k, str) and (k in _REF_KEYS or k.endswith("_ref") or k == "observations_file"):
                yield _fmt_path(p), v
            elif path == ("feasibility",) and k == "source" and isinstance(v, str) and v and " " not in v:
                yield _fmt_path(p), v
            else:
                yield from _iter_refs(v, p)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _iter_refs(v, path + (i,))


def _split_refs(ref: str) -> list[str]:
    """'a.json#x; b.json#y' -> ['a.json#x', 'b.json#y'] (file names never hold ';' or ',')."""
    return [r.strip() for r in re.split(r"[;,]", ref) if r.strip()]


def verify_bundle(path: Path, env: Mapping[str, str] | None = None) -> list[str]:
    """Problems found (empty list = verified). `path` is a run dir, or a root holding LATEST."""
    path = Path(path)
    if not (path / RESULT_FILE).exists() and (path / "LATEST").exists():
        path = path / (path / "LATEST").read_text().strip()
    problems: list[str] = []
    try:
        raw = (path / RESULT_FILE).read_bytes()
        result = json.loads(raw)
    except FileNotFoundError:
        return [f"{path / RESULT_FILE}: missing"]
    except (ValueError, UnicodeDecodeError) as exc:
        return [f"{RESULT_FILE}: not valid JSON ({exc})"]
    try:
        validate_result(result)
    except ResultShapeError as exc:
        problems.append(f"{RESULT_FILE}: {exc}")
        if not isinstance(result, dict) or not isinstance(result.get("evidence"), dict):
            return problems
    scanner = scanner_for(env)
    try:
        scanner.check(raw, RESULT_FILE)
    except SecretLeakError as exc:
        problems.append(str(exc))
    files = result["evidence"].get("files", [])
    by_name: dict[str, dict] = {}
    total = 0
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            problems.append(f"evidence.files[{i}]: not an object")
            continue
        name = f.get("name")
        if name in by_name:
            problems.append(f"{name}: registered twice")
        by_name[name] = f
        fp = path / FILES_DIR / str(name)
        if not isinstance(name, str) or not _NAME_RE.match(name) or not fp.is_file():
            problems.append(f"{name}: registered but missing from {FILES_DIR}/")
            continue
        data = fp.read_bytes()
        total += len(data)
        if len(data) != f.get("size"):
            problems.append(f"{name}: size {len(data)} != recorded {f.get('size')}")
        if sha256_bytes(data) != f.get("sha256"):
            problems.append(f"{name}: sha256 does not match the recorded value (file changed)")
        if len(data) > MAX_FILE_BYTES:
            problems.append(f"{name}: exceeds the 10 MiB per-file limit")
        try:
            scanner.check(data, f"evidence file {name!r}")
        except SecretLeakError as exc:
            problems.append(str(exc))
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files registered; the limit is {MAX_FILES}")
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes registered; the limit is {MAX_TOTAL_BYTES}")
    for where, ref in _iter_refs(result):
        names: list[tuple[str, str | None]] = []
        if isinstance(ref, str):
            names += [(r, None) for r in _split_refs(ref)]
        elif isinstance(ref, list):
            names += [(r, None) for x in ref if isinstance(x, str) for r in _split_refs(x)]
        elif isinstance(ref, dict) and isinstance(ref.get("name"), str):
            names.append((ref["name"], ref.get("sha256")))
        elif ref is not None:
            problems.append(f"{where}: unrecognised reference {type(ref).__name__}")
        for name, sha in names:
            base = name.split("#", 1)[0]
            if base not in by_name:
                problems.append(f"{where}: references {base!r}, which is not a registered file")
            elif sha is not None and sha != by_name[base].get("sha256"):
                problems.append(f"{where}: sha256 for {base!r} differs from the registered file")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dppo_harness.evidence")
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check every registered file's sha256 and size, and result.json references")
    v.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if not args.dir.exists():
        print(f"verify: {args.dir} does not exist", file=sys.stderr)
        return 2
    problems = verify_bundle(args.dir)
    if problems:
        for p in problems:
            print(f"FAIL {p}")
        print(f"verify: {len(problems)} problem(s) in {args.dir}")
        return 1
    target = args.dir if (args.dir / RESULT_FILE).exists() else args.dir / (args.dir / "LATEST").read_text().strip()
    n = len(json.loads((target / RESULT_FILE).read_text())["evidence"]["files"])
    print(f"verify: OK, {n} registered file(s) match their sha256 and size in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

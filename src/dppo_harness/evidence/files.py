"""The bundle's file names, limits, writes and errors (SecretLeakError comes from secrets_scan):
`files/<name>`, immutable once registered. The entries ({name, kind, sha256, size}) live in
result.json under evidence.files; the bundle keeps them there. This module decides whether bytes
may be registered and writes them atomically.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypedDict, get_args


class EvidenceError(RuntimeError):
    """Bad input to the bundle; nothing was written."""


class LimitError(EvidenceError):
    """A file, the file count or the run's total bytes would exceed the bundle's limits."""


class ImmutableNameError(EvidenceError):
    """A registered name was offered different bytes or a different kind."""


class ResultShapeError(EvidenceError):
    """result.json would not have the structured-output shape (`result.ResultModel`)."""


class UnwritableEvidenceError(EvidenceError):
    """The evidence directory refused a write (disk full, read-only, permission denied); nothing of
    that write landed. Its message is the one line a user sees."""


MAX_FILE_BYTES = 10 * 1024 * 1024
MAX_FILES = 64
MAX_TOTAL_BYTES = 40 * 1024 * 1024

FileKind = Literal[
    "script",
    "effective_config",
    "code_revision",
    "code_patch",
    "predictions",
    "metrics",
    "plan",
    "report",
    "tensors",
    "manifest",
    "plot",
    "log",
    "generated_tasks",
]
KINDS = frozenset(get_args(FileKind))  # checked at registration; result.json's file entries use the same
RESULT_FILE = "result.json"
LEDGER_FILE = "ledger.json"
LATEST_FILE = "LATEST"  # beside the run dirs: the newest run_id
FILES_DIR = "files"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RESERVED_NAMES = frozenset({RESULT_FILE, LEDGER_FILE, LATEST_FILE})
STATE_ROOT = "comparison-state"  # beside the run dirs: comparison-state/<run>/ (state, lock, metrics logs)
SERVER_DIR = "local-server"  # beside the run dirs: the embedded server a comparison keeps, its server.log
EFFECTIVE_CONFIG_FILE = "effective-config.json"


class FileEntry(TypedDict):
    name: str
    kind: str
    sha256: str
    size: int


def sidecar_files(run: Path) -> list[Path]:
    """The files the run wrote beside its registered ones: its own sidecars (ledger.json, ...), its
    comparison state and metrics logs, and the embedded server's log."""
    out = sorted(p for p in run.iterdir() if p.is_file() and p.name != RESULT_FILE)
    state = run.parent / STATE_ROOT / run.name
    if state.is_dir():
        out += sorted(p for p in state.rglob("*") if p.is_file())
    log = run.parent / SERVER_DIR / "server.log"
    return out + ([log] if log.is_file() else [])


def run_dir_of(path: Path) -> Path:
    """A run dir as given, or the LATEST run under a root."""
    if not (path / RESULT_FILE).exists() and (path / LATEST_FILE).exists():
        return path / (path / LATEST_FILE).read_text().strip()
    return path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Free space a run needs before it starts: the bundle's own limit and one more largest file (the
# temp copy an atomic write holds while it replaces nothing yet).
MIN_FREE_BYTES = MAX_TOTAL_BYTES + MAX_FILE_BYTES


def unwritable_reason(directory: Path) -> str | None:
    """Why nothing can be written at `directory` (or where it would be created), else None: a probe
    file is created and removed in it or its nearest existing parent (permission bits alone say
    nothing for root or on a read-only mount), and its file system must have MIN_FREE_BYTES free."""
    target = Path(directory)
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        return f"{target} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write in {target}: {exc.strerror or type(exc).__name__}"
    free = shutil.disk_usage(target).free
    if free < MIN_FREE_BYTES:
        return (
            f"only {free / 2**20:.1f} MiB free in {target}; a run's evidence needs {MIN_FREE_BYTES / 2**20:.0f} MiB "
            f"(its {MAX_TOTAL_BYTES / 2**20:.0f} MiB limit and one {MAX_FILE_BYTES / 2**20:.0f} MiB file being written)"
        )
    return None


_WHY = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is spent",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def unwritable_line(path: Path, exc: OSError) -> str:
    """One line for a refused evidence write: where, what the system said, what would settle it."""
    code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    why = _WHY.get(exc.errno or 0, exc.strerror or str(exc))
    return (
        f"evidence not written: {path}: {why} ({code}); free space or make the evidence directory "
        "writable, or give another --evidence-dir"
    )


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory, fsync, os.replace, then fsync the directory
    (never a torn file, never a rename lost in a crash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        try:  # the rename itself durable; a platform without directory handles gets what it can
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
    finally:
        if tmp.exists():
            tmp.unlink()


def append_durably(path: Path, data: bytes) -> None:
    """Append `data` and fsync before returning (a kill leaves at most a torn tail)."""
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def dump_json(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")


def json_file_bytes(name: str, obj: object) -> bytes:
    """A registered JSON file's bytes: sorted keys, no NaN/inf."""
    try:
        return (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False, ensure_ascii=False) + "\n").encode()
    except (TypeError, ValueError) as exc:
        raise EvidenceError(f"file {name!r}: not JSON-serializable without NaN/inf ({exc})") from None


def written(entries: Sequence[FileEntry]) -> str:
    """What a run has already registered, for a limit's refusal line."""
    return f"already written: {len(entries)} files, {sum(f['size'] for f in entries)} bytes"


def admit(name: str, kind: str, data: bytes, entries: Sequence[FileEntry]) -> tuple[FileEntry, bool]:
    """(entry, is_new): the same name, bytes and kind again is a no-op; EvidenceError for a bad
    name or kind, ImmutableNameError for a changed file."""
    if not (isinstance(name, str) and NAME_RE.match(name) and name not in RESERVED_NAMES):
        raise EvidenceError(f"file name {name!r}: use 1-128 of letters, digits, '.', '_', '-' (not a reserved name)")
    if kind not in KINDS:
        raise EvidenceError(f"file {name!r}: unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    entry = FileEntry(name=name, kind=kind, sha256=sha256_bytes(data), size=len(data))
    for existing in entries:
        if existing["name"] != name:
            continue
        if existing["sha256"] == entry["sha256"] and existing["kind"] == kind:
            return FileEntry(**existing), False
        what = "bytes" if existing["sha256"] != entry["sha256"] else "kind"
        raise ImmutableNameError(
            f"file {name!r} is already registered with different {what}"
            f" (sha256 {existing['sha256'][:12]}…, kind {existing['kind']}); use a new name"
        )
    return entry, True


def check_limits(entry: FileEntry, entries: Sequence[FileEntry], slots: int = 0, nbytes: int = 0) -> None:
    """The bundle's limits, the last `slots` files and `nbytes` bytes kept for the closing records."""
    name, size, n = entry["name"], entry["size"], len(entries) + 1
    total = sum(f["size"] for f in entries) + size
    if size > MAX_FILE_BYTES:
        raise LimitError(
            f"file {name!r} is {size} bytes; the limit is {MAX_FILE_BYTES} bytes (10 MiB) per file; {written(entries)}"
        )
    if n > MAX_FILES:
        raise LimitError(f"file {name!r} would be file {n}; the limit is {MAX_FILES} files per run; {written(entries)}")
    if total > MAX_TOTAL_BYTES:
        raise LimitError(
            f"file {name!r} ({size} bytes) would bring the run to {total} bytes; "
            f"the limit is {MAX_TOTAL_BYTES} bytes (40 MiB) in total; {written(entries)}"
        )
    if n > MAX_FILES - slots:
        raise LimitError(
            f"file {name!r} would be file {n}; the last {slots} of the {MAX_FILES} file slots are reserved "
            f"for the closing records; {written(entries)}"
        )
    if total > MAX_TOTAL_BYTES - nbytes:
        raise LimitError(
            f"file {name!r} would bring the run to {total} bytes; the last {nbytes} of {MAX_TOTAL_BYTES} bytes "
            f"are reserved for the closing records; {written(entries)}"
        )

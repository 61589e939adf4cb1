"""The code a run executed: its git revision with the full uncommitted diff (read-only git calls),
and ONE deterministic zip of kind `script` holding all of it (sorted members, fixed timestamps:
equal trees give equal bytes) with a member manifest (`ARCHIVE-MANIFEST.json`), so a reviewer can
rerun exactly it while the bundle stays far under its file limit. Binary weight assets (`*.pt`)
would push the one file past the per-file limit: the manifest lists them under `referenced` (path,
sha256, size) instead.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import subprocess
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dppo_harness.evidence.files import sha256_bytes
from dppo_harness.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    from dppo_harness.evidence.bundle import EvidenceBundle
    from dppo_harness.evidence.files import FileEntry


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=60)


def package_files_sha256(package_dir: Path, pattern: str = "*") -> str:
    """sha256 over a package's files matching `pattern`, each file's path relative to `package_dir`
    plus its bytes, in path order, bytecode caches excepted. Every file (sources and what the package
    carries: vendored data, the embedded server's assets) is what a resume must match; "*.py" is
    the one hash of the executed source (the provenance's `source_sha256`)."""
    h = hashlib.sha256()
    for p in sorted(Path(package_dir).rglob(pattern)):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            h.update(str(p.relative_to(package_dir)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def code_revision(root: Path, exclude: Iterable[Path] = ()) -> tuple[JsonObject, bytes]:
    """(revision info, patch bytes): the git commit plus the diff of tracked files. Untracked files
    are listed by path, size and sha256, never inlined: a `.env` or a notes file with a token in it
    is the user's, not the run's code. Read-only (no index change)."""
    pkg = root / "src" / "dppo_harness"
    info: JsonObject = {"repo": root.name, "source_sha256": package_files_sha256(pkg, "*.py") if pkg.is_dir() else None}
    head = _git(root, "rev-parse", "HEAD") if (root / ".git").exists() else None
    if head is None or head.returncode != 0:
        reason = "not a git checkout (or no commit); source_sha256 identifies the package source"
        return {**info, "commit": None, "available": False, "reason": reason}, b""
    info.update({"commit": head.stdout.decode().strip(), "available": True})
    patch = _git(root, "diff", "HEAD", "--binary").stdout
    excl = [Path(e).resolve() for e in exclude]
    untracked: list[JsonValue] = []
    listed: list[JsonValue] = []
    out = _git(root, "ls-files", "--others", "--exclude-standard", "-z").stdout.decode()
    for rel in filter(None, out.split("\0")):
        p = (root / rel).resolve()
        if any(p == e or e in p.parents for e in excl) or not p.is_file():
            continue
        untracked.append(rel)
        listed.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_bytes(p.read_bytes())})
    info.update(
        {
            "dirty": bool(patch) or bool(untracked),
            "untracked_files": untracked,
            "untracked_not_in_patch": listed,
            "patch_sha256": sha256_bytes(patch) if patch else None,
        }
    )
    return info, patch


ARCHIVE_NAME = "code-archive.zip"
MANIFEST_MEMBER = "ARCHIVE-MANIFEST.json"
# Relative to the project root; folders are taken recursively.
ARCHIVED = ("src/dppo_harness", "tests", "plans", "conftest.py", "pyproject.toml", "benchmarks")
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)
_REFERENCED_SUFFIXES = (".pt",)
# Names that hold credentials by convention: never archived, tracked or not.
SECRET_FILE_PATTERNS = (
    ".env",
    ".env.*",
    "*.env",
    ".envrc",
    ".netrc",
    ".pypirc",
    "*.pem",
    "*.key",
    "*.p12",
    "credentials",
    "credentials.json",
    "id_rsa*",
    "id_ed25519*",
)


def tracked_files(root: Path) -> set[Path] | None:
    """The files git tracks under `root` (None: not a git checkout, or git unavailable)."""
    if not (root / ".git").exists():
        return None
    try:
        out = _git(root, "ls-files", "-z")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {(root / rel).resolve() for rel in out.stdout.decode().split("\0") if rel}


def archived_paths(root: Path, include: Iterable[str] = ARCHIVED) -> list[Path]:
    """Every file under the archived roots (sorted; caches, compiled files and secret-named files
    left out); in a git checkout, only the files git tracks (an untracked file is the user's, not
    the run's code: code.patch lists it by hash)."""
    root = Path(root).resolve()
    out: set[Path] = set()
    for rel in include:
        p = root / rel
        if p.is_file():
            out.add(p)
        elif p.is_dir():
            out.update(
                f
                for f in p.rglob("*")
                if f.is_file() and not _SKIP_PARTS & set(f.parts) and f.suffix not in (".pyc", ".pyo")
            )
    tracked = tracked_files(root)
    secret = [f for f in out if any(fnmatch.fnmatch(f.name.lower(), pat) for pat in SECRET_FILE_PATTERNS)]
    return sorted(f for f in out if f not in secret and (tracked is None or f.resolve() in tracked))


def build_archive(
    root: Path, *, commit: str | None = None, include: Iterable[str] = ARCHIVED
) -> tuple[bytes, dict[str, Any]]:
    """(zip bytes, manifest). Deterministic for a given tree and commit."""
    root = Path(root).resolve()
    members, referenced = [], []
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for f in archived_paths(root, include):
            data = f.read_bytes()
            rel = f.relative_to(root).as_posix()
            entry = {"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            if f.suffix in _REFERENCED_SUFFIXES:
                referenced.append(entry)
                continue
            members.append(entry)
            info = zipfile.ZipInfo(rel, date_time=_FIXED_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, data, zipfile.ZIP_DEFLATED)
        manifest = {
            "kind": "code_archive",
            "version": 1,
            "commit": commit,
            "roots": list(include),
            "members": members,
            "n_members": len(members),
            "referenced": referenced,
        }
        manifest_info = zipfile.ZipInfo(MANIFEST_MEMBER, date_time=_FIXED_TIME)
        zf.writestr(manifest_info, json.dumps(manifest, indent=1, sort_keys=True), zipfile.ZIP_DEFLATED)
    return buf.getvalue(), manifest


def register_code(bundle: EvidenceBundle, root: Path) -> list[FileEntry]:
    """code-revision.json, code.patch when the checkout has uncommitted changes, and the code archive."""
    info, patch = code_revision(Path(root), exclude=[bundle.dir])
    entries = [bundle.register_json("code-revision.json", "code_revision", info)]
    if patch:
        entries.append(bundle.register_bytes("code.patch", "code_patch", patch))
    commit = info["commit"]
    archive, _ = build_archive(root, commit=commit if isinstance(commit, str) else None)
    return [*entries, bundle.register_bytes(ARCHIVE_NAME, "script", archive)]

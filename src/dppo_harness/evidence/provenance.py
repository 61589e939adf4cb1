"""Code revision of the run: git commit plus the full uncommitted diff (read-only git calls)."""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

from dppo_harness.evidence.files import sha256_bytes
from dppo_harness.json_types import JsonObject, JsonValue


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
    """(revision info, patch bytes): the git commit plus the diff of tracked files.

    Untracked files are listed with their path, size and sha256 but never inlined: a `.env` or a
    notes file with a token in it is the user's, not the run's code. Read-only (no index change).
    """
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

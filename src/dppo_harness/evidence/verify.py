"""`python -m dppo_harness.evidence verify DIR`: re-check a bundle from disk alone: every registered
file's sha256 and size, the limits, the result shape, the journal's lines, every reference in
result.json (to a file or a journal entry), and the secret scan, over what the run wrote beside its
registered files too (it is shared with the bundle).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dppo_harness.evidence.files import (
    FILES_DIR,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_TOTAL_BYTES,
    NAME_RE,
    RESULT_FILE,
    ResultShapeError,
    run_dir_of,
    sha256_bytes,
    sidecar_files,
)
from dppo_harness.evidence.journal import JOURNAL_FILE, JournalError, read_entries
from dppo_harness.evidence.result import validate_result
from dppo_harness.json_types import JsonMap
from dppo_harness.plans.models import format_path
from dppo_harness.service.secrets_scan import SecretLeakError, scanner_for

_REF_KEYS = ("observations_file", "dataset_file", "evaluation_file", "audit_file")  # and every `*_ref`


def _is_ref(path: tuple[str | int, ...], key: object, value: object) -> bool:
    if isinstance(key, str) and (key in _REF_KEYS or key.endswith("_ref")):
        return True
    # feasibility.source names a file when it is one word
    return path == ("feasibility",) and key == "source" and isinstance(value, str) and bool(value) and " " not in value


def iter_refs(obj: object, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str, object]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = (*path, k)
            if _is_ref(path, k, v):
                yield format_path(p), v
            else:
                yield from iter_refs(v, p)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from iter_refs(v, (*path, i))


def split_refs(ref: str) -> list[str]:
    """'a.json#x; b.json#y' -> ['a.json#x', 'b.json#y'] (file names never hold ';' or ',')."""
    return [r.strip() for r in re.split(r"[;,]", ref) if r.strip()]


def verify_bundle(path: Path, env: Mapping[str, str] | None = None) -> list[str]:
    """Problems found (empty list = verified). `path` is a run dir, or a root holding LATEST."""
    path = run_dir_of(Path(path))
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

    def scan(data: bytes, what: str) -> None:
        try:
            scanner.check(data, what)
        except SecretLeakError as exc:
            problems.append(str(exc))

    scan(raw, RESULT_FILE)
    files = result["evidence"].get("files", [])
    by_name: dict[str, dict[str, Any]] = {}
    total = 0
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            problems.append(f"evidence.files[{i}]: not an object")
            continue
        name = f.get("name")
        if name in by_name:
            problems.append(f"{name}: registered twice")
        by_name[str(name)] = f
        fp = path / FILES_DIR / str(name)
        if not isinstance(name, str) or not NAME_RE.match(name) or not fp.is_file():
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
        scan(data, f"evidence file {name!r}")
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files registered; the limit is {MAX_FILES}")
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes registered; the limit is {MAX_TOTAL_BYTES}")
    try:  # a torn last line is a kill mid-append; any other bad line an altered journal
        journal = {e.ref: e.sha256 for e in read_entries(path / JOURNAL_FILE)}
    except JournalError as exc:
        problems.append(str(exc))
        journal = {}
    problems += _reference_problems(result, by_name, journal)
    for fp in sidecar_files(path):
        try:
            data = fp.read_bytes()
        except OSError as exc:
            problems.append(f"{fp.relative_to(path.parent)}: unreadable ({exc.strerror})")
        else:
            scan(data, f"{fp.relative_to(path.parent)} (beside the bundle)")
    return problems


def _reference_problems(result: object, by_name: Mapping[str, JsonMap], journal: Mapping[str, str]) -> list[str]:
    """Each reference names a registered file (`name` or `name#part`) or a journal entry
    (`journal.jsonl#<seq>`), with its sha256 where the reference gives one."""
    problems: list[str] = []
    shas = {**{n: f.get("sha256") for n, f in by_name.items()}, **journal}
    for where, ref in iter_refs(result):
        names: list[tuple[str, str | None]] = []
        if isinstance(ref, str):
            names += [(r, None) for r in split_refs(ref)]
        elif isinstance(ref, list):
            names += [(r, None) for x in ref if isinstance(x, str) for r in split_refs(x)]
        elif isinstance(ref, dict) and isinstance(ref.get("name"), str):
            names.append((ref["name"], ref.get("sha256")))
        elif ref is not None:
            problems.append(f"{where}: unrecognised reference {type(ref).__name__}")
        for name, sha in names:
            entry = name.startswith(f"{JOURNAL_FILE}#")
            key, what = (name, "journal entry") if entry else (name.split("#", 1)[0], "registered file")
            if key not in shas:
                problems.append(f"{where}: references {key!r}, which is not a {what}")
            elif sha is not None and sha != shas[key]:
                problems.append(f"{where}: sha256 for {key!r} differs from the {what}")
    return problems


FINAL_STATUSES = ("succeeded", "failed")
INCOMPLETE_EXIT = 3  # the hashes hold, the run did not end: never read as verified


def main(argv: Sequence[str] | None = None) -> int:
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
    target = run_dir_of(args.dir)
    result = json.loads((target / RESULT_FILE).read_text())
    n = len(result["evidence"]["files"])
    if result.get("status") not in FINAL_STATUSES:
        print(
            f"verify: INCOMPLETE, {n} registered file(s) match their sha256 and size in {target}, but its status is "
            f"{result.get('status')!r}: the run was killed or is still running, so its result is not final"
        )
        return INCOMPLETE_EXIT
    print(f"verify: OK, {n} registered file(s) match their sha256 and size in {target} (status {result['status']})")
    return 0

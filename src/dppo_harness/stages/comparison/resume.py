"""What a resumed comparison takes over from the sessions before it, re-verified by hash.

A resume (`--resume RUN_ID`) does not rerun the preflight and the gate. Their results are in the
hashed result snapshot the run started from (`RunState.setup_snapshot`, in the first session's
bundle). Before anything is reused, every bundle of the run so far is verified from disk
(`evidence verify`: every registered file's sha256 and size, every reference) and the snapshot's
sha256 is checked against the one recorded when the run started. Then the setup blocks
(correctness_preflight, initialization_provenance, activation_calibration, feasibility) are
posted in the new bundle, each file they reference registered again with the same bytes, and a
`resumed-from-N.json` manifest names the run, the session it continues, that session's last
snapshot and every reused file with its sha256. Any mismatch refuses the resume with one line.
The run's state exists only because its first session's preflight and gate passed (a failed
stage blocks the comparison); the gate report's own `passed` is checked again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dppo_harness.evidence.files import FILES_DIR, RESULT_FILE, sha256_bytes
from dppo_harness.evidence.snapshots import snapshot_names
from dppo_harness.evidence.verify import iter_refs, split_refs, verify_bundle
from dppo_harness.json_types import JsonObject
from dppo_harness.stages.comparison.config import ComparisonError
from dppo_harness.stages.comparison.state import RunState, checkpoint_record_problems
from dppo_harness.stages.gate import is_report_file

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle

SETUP_BLOCKS = ("correctness_preflight", "initialization_provenance", "activation_calibration", "feasibility")


def latest_snapshot(bundle: EvidenceBundle) -> dict[str, str] | None:
    """The bundle's newest result snapshot: {run_id, name, sha256}, or None if it posted none."""
    names = snapshot_names(bundle)
    if not names:
        return None
    entry = bundle.entry(names[-1])
    return {"run_id": bundle.run_id, "name": names[-1], "sha256": entry["sha256"] if entry else ""}


def _registry(run_dir: Path) -> dict[str, dict[str, Any]]:
    result = json.loads((run_dir / RESULT_FILE).read_text())
    return {f["name"]: f for f in result["evidence"]["files"]}


def _last_snapshot_on_disk(run_dir: Path) -> dict[str, str] | None:
    reg = _registry(run_dir)
    names = sorted(n for n in reg if n.startswith("result-") and n[7:11].isdigit())
    return {"run_id": run_dir.name, "name": names[-1], "sha256": reg[names[-1]]["sha256"]} if names else None


def _referenced_files(blocks: JsonObject) -> Iterator[str]:
    for _, ref in iter_refs(dict(blocks)):
        values = ref if isinstance(ref, list) else [ref]
        for v in values:
            if isinstance(v, str):
                yield from (r.split("#", 1)[0] for r in split_refs(v))
            elif isinstance(v, Mapping) and isinstance(v.get("name"), str):
                yield v["name"]


def _refuse(run_id: str, why: str) -> ComparisonError:
    return ComparisonError(f"--resume {run_id} refused: {why}")


STATE_COPY_PREFIX = "comparison-state-"


def _registered_state_copies(run_dir: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(name, content) of each run state registered in a bundle; content None when its bytes no
    longer hash to the registered sha256."""
    for name, entry in sorted(_registry(run_dir).items()):
        if not (name.startswith(STATE_COPY_PREFIX) and name.endswith(".json")):
            continue
        try:
            raw = (run_dir / FILES_DIR / name).read_bytes()
        except OSError:
            yield name, None
            continue
        yield name, json.loads(raw) if sha256_bytes(raw) == entry["sha256"] else None


def checkpoint_problems(state: RunState) -> list[str]:
    """Why the checkpoints a resume would reuse cannot be trusted: each save's record must hash to
    what was recorded when it was saved, and agree with every copy of the run state registered
    (hashed) in the run's earlier bundles, up to the step a later session resumed from (the steps
    after it were trained and saved again)."""
    out = checkpoint_record_problems(state)
    for i, session in enumerate(state.sessions):
        run_dir = Path(session["dir"])
        if not (run_dir / RESULT_FILE).is_file():
            continue  # a missing bundle is refused by verified_dirs, naming it
        later = [int(r["from_step"]) for r in state.resumes[i:]]
        limit = min(later) if later else None
        for name, copy in _registered_state_copies(run_dir):
            if copy is None:
                out.append(f"{session['run_id']}/{name} does not match the sha256 its bundle registered")
                continue
            for arm_name, arm in copy.get("arms", {}).items():
                here = state.arms.get(arm_name)
                for step, path in arm.get("saves", {}).items():
                    if limit is not None and int(step) > limit:
                        continue
                    now = here.saves.get(step) if here is not None else None
                    if now != path:
                        out.append(
                            f"arm {arm_name}'s checkpoint at step {step} is {now} in the state but {path} in "
                            f"{session['run_id']}/{name}"
                        )
    return out


def verified_dirs(state: RunState) -> list[Path]:
    """Every earlier session's bundle, each verified from disk; refuses on the first problem."""
    dirs = []
    for s in state.sessions[:-1]:
        d = Path(s["dir"])
        if not (d / RESULT_FILE).is_file():
            raise _refuse(state.run_id, f"the bundle of session {s['run_id']} is missing ({d})")
        problems = verify_bundle(d)
        if problems:
            raise _refuse(
                state.run_id,
                f"the evidence of session {s['run_id']} does not verify by hash: {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
            )
        dirs.append(d)
    return dirs


def reuse_setup(bundle: EvidenceBundle, state: RunState) -> None:
    """Verify the run's earlier bundles, take over the setup evidence, register the resumed-from
    manifest (see the module docstring) and post where this session starts. Call after the state
    names this session."""
    dirs = verified_dirs(state)
    if not dirs:
        raise _refuse(state.run_id, "the saved state names no earlier session to continue")
    snap = state.setup_snapshot
    blocks: JsonObject = {}
    files: list[dict[str, Any]] = []
    if snap is not None:
        setup_dir = next((d for d in dirs if d.name == snap["run_id"]), None)
        if setup_dir is None:
            raise _refuse(
                state.run_id, f"the setup snapshot's session {snap['run_id']} is not among the run's sessions"
            )
        reg = _registry(setup_dir)
        data = (setup_dir / FILES_DIR / snap["name"]).read_bytes()
        if reg.get(snap["name"], {}).get("sha256") != snap["sha256"] or sha256_bytes(data) != snap["sha256"]:
            raise _refuse(
                state.run_id,
                f"setup snapshot {snap['run_id']}/{snap['name']} does not match the sha256 "
                "recorded when the run started",
            )
        setup = json.loads(data)
        blocks = {k: setup[k] for k in SETUP_BLOCKS if setup.get(k) is not None}
        gate_reports = sorted(n for n in reg if is_report_file(n))  # one per piloted treatment arm
        for name in sorted(set(_referenced_files(blocks)) | set(gate_reports)):
            raw = (setup_dir / FILES_DIR / name).read_bytes()
            entry = bundle.register_bytes(name, reg[name]["kind"], raw)
            files.append(
                {
                    "name": name,
                    "kind": entry["kind"],
                    "sha256": entry["sha256"],
                    "size": entry["size"],
                    "from_run": snap["run_id"],
                }
            )
        for name in gate_reports:
            if not json.loads((setup_dir / FILES_DIR / name).read_bytes())["passed"]:
                raise _refuse(state.run_id, f"the activation gate of session {snap['run_id']} did not pass ({name})")
    last = _last_snapshot_on_disk(dirs[-1])
    resume = state.resumes[-1]
    continued = {
        "run_id": dirs[-1].name,
        "status": json.loads((dirs[-1] / RESULT_FILE).read_text())["status"],
        "last_snapshot": last,
    }
    name = f"resumed-from-{state.resumed}.json"
    bundle.register_json(
        name,
        "manifest",
        {
            "kind": "comparison_resume",
            "comparison_run": state.run_id,
            "resumed_times": state.resumed,
            "from_step": resume["from_step"],
            "continues_session": continued,
            "sessions_verified": [d.name for d in dirs],
            "setup_snapshot": snap,
            "reused_files": files,
            "note": "the preflight and the gate were not rerun: their evidence is taken over from the setup snapshot "
            "after every earlier bundle verified by sha256",
        },
    )
    bundle.update_result(**blocks)
    bundle.update_result(
        initialization_provenance={
            "resume": {
                "comparison_run": state.run_id,
                "resumed_times": state.resumed,
                "from_step": resume["from_step"],
                "continues_session": continued,
                "evidence_ref": name,
            }
        }
    )

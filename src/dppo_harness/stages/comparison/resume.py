"""What a resume checks and takes over from the sessions before it, re-verified by hash.

A resume (`--resume RUN_ID`) continues the saved state only when plan, evaluator and code are
unchanged and every checkpoint record hashes as recorded and agrees with the run states the earlier
sessions journaled; it rewinds to the last step every arm saved. It does not rerun the preflight and
the gate: every earlier bundle is verified from disk (`evidence verify`), the setup snapshot's journal
line checked against the sha256 recorded when the run started, then the setup blocks (SETUP_BLOCKS) are posted in the
new bundle with each file they reference registered again with the same bytes, and a
`resumed-from-N.json` manifest names the run, the session it continues and every reused file with its
sha256. The gate report's own `passed` is checked again. Any mismatch refuses the resume in one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dppo_harness.evidence.files import FILES_DIR, RESULT_FILE
from dppo_harness.evidence.journal import JOURNAL_FILE, Entry, JournalError, read_entries
from dppo_harness.evidence.verify import iter_refs, split_refs, verify_bundle
from dppo_harness.json_types import JsonObject, obj
from dppo_harness.stages.comparison.config import ComparisonError
from dppo_harness.stages.comparison.state import RunState, checkpoint_record_sha256, hold_run_lock, state_path
from dppo_harness.stages.write import GATE_REPORT_FILE

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle

SETUP_BLOCKS = ("correctness_preflight", "initialization_provenance", "activation_calibration", "feasibility")


def _registry(run_dir: Path) -> dict[str, dict[str, Any]]:
    result = json.loads((run_dir / RESULT_FILE).read_text())
    return {f["name"]: f for f in result["evidence"]["files"]}


def snapshot_ref(run_id: str, entry: Entry) -> dict[str, str | int]:
    """A journaled result snapshot as a later session names it: its line's sha256 (`Entry.sha256`)."""
    return {"run_id": run_id, "seq": entry.seq, "sha256": entry.sha256}


def _journal(run_id: str, session_dir: Path) -> list[Entry]:
    """An earlier session's journal entries; an altered journal refuses the resume in one line."""
    try:
        return read_entries(session_dir / JOURNAL_FILE)
    except JournalError as exc:
        raise _refuse(run_id, str(exc)) from None


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


def checkpoint_problems(state: RunState) -> list[str]:
    """Why the checkpoints a resume would reuse cannot be trusted: each save's record must hash to
    what was recorded when it was saved (not edited, not copied from another run or arm), the
    current state must be one of the hashed saves, and every save must agree with every run state
    the run's earlier sessions journaled, up to the step a later session resumed from (the steps
    after it were trained and saved again)."""
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
    for i, session in enumerate(state.sessions):
        later = [int(r["from_step"]) for r in state.resumes[i:]]
        limit = min(later) if later else None
        for entry in _journal(state.run_id, Path(session["dir"])):  # each run state journaled there
            if (entry.stage, entry.kind) != ("comparison", "state"):
                continue
            for arm_name, journaled in obj(obj(entry.data)["arms"]).items():
                here = state.arms.get(arm_name)
                for step, was in obj(obj(journaled)["saves"]).items():
                    if limit is not None and int(step) > limit:
                        continue
                    now = here.saves.get(step) if here is not None else None
                    if now != was:
                        out.append(
                            f"arm {arm_name}'s checkpoint at step {step} is {now} in the state but {was} in "
                            f"{session['run_id']}/{entry.ref}"
                        )
    return out


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
    # Arm after arm, the arms are at most one step apart; an arm replaced after a lost model trains
    # again from its last save, so it alone may lag further (the rewind pairs them again).
    steps = [s.steps_done for s in state.arms.values()]
    if any(max(steps) - s.steps_done > 1 and not s.lost_models for s in state.arms.values()):
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


def load_owned_state(state_root: Path, run_id: str) -> RunState:
    """Run `run_id`'s saved state, refused when it names another run (copied or moved there)."""
    path = state_path(state_root, run_id)
    state = RunState.load(path)
    if state.run_id != run_id:
        raise ComparisonError(f"--resume {run_id} refused: the state at {path} belongs to run {state.run_id}")
    return state


def open_resumed(
    state_root: Path,
    run_id: str,
    *,
    plan_sha256: str,
    evaluator_id: str,
    code_rev: str,
    steps: int,
    session: dict[str, str],
) -> RunState:
    """Run `run_id`'s saved state, locked to this process, checked (else refused in one line, before
    the rewind picks a checkpoint to reuse), rewound to the last step every arm saved, with this
    `session` appended."""
    path = state_path(state_root, run_id)
    if not path.is_file():
        raise ComparisonError(f"--resume {run_id}: no saved comparison state at {path}")
    hold_run_lock(state_root, run_id, what=f"--resume {run_id}")
    state = load_owned_state(state_root, run_id)
    problems = resume_problems(state, plan_sha256=plan_sha256, evaluator_id=evaluator_id, code_rev=code_rev)
    problems += checkpoint_problems(state)
    if problems:
        raise _refuse(run_id, "; ".join(problems))
    continued = state.sessions[-1]["run_id"] if state.sessions else state.run_id
    from_step = rewind_to_common_save(state, steps)
    state.resumed += 1
    state.resumes.append({"session": session["run_id"], "continues_session": continued, "from_step": from_step})
    state.sessions.append(session)
    return state


def verified_dirs(state: RunState) -> list[Path]:
    """Every earlier session's bundle, each verified from disk; refuses on the first problem."""
    dirs = []
    for s in state.sessions[:-1]:
        d = Path(s["dir"])
        problems = verify_bundle(d)  # a missing bundle is a missing result.json
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
        found = next((e for e in _journal(state.run_id, setup_dir) if e.seq == snap["seq"]), None)
        if found is None or found.kind != "snapshot" or found.sha256 != snap["sha256"]:
            raise _refuse(
                state.run_id,
                f"setup snapshot {snap['run_id']}/{JOURNAL_FILE}#{snap['seq']} does not match the sha256 "
                "recorded when the run started",
            )
        setup = obj(found.data)
        blocks = {k: setup[k] for k in SETUP_BLOCKS if setup.get(k) is not None}
        gate_reports = [GATE_REPORT_FILE] if GATE_REPORT_FILE in reg else []
        for name in sorted(set(_referenced_files(blocks)) | set(gate_reports)):
            raw = (setup_dir / FILES_DIR / name).read_bytes()
            entry = bundle.register_bytes(name, reg[name]["kind"], raw)
            files.append(
                {"name": name, **{k: entry[k] for k in ("kind", "sha256", "size")}, "from_run": snap["run_id"]}
            )
        for name in gate_reports:
            if not json.loads((setup_dir / FILES_DIR / name).read_bytes())["passed"]:
                raise _refuse(state.run_id, f"the activation gate of session {snap['run_id']} did not pass ({name})")
    snaps = [e for e in _journal(state.run_id, dirs[-1]) if e.kind == "snapshot"]
    last = snapshot_ref(dirs[-1].name, snaps[-1]) if snaps else None
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

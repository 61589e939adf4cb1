"""A comparison killed with SIGKILL and resumed, as a user runs it: `pytest -m comparison` as a
subprocess on the CI rehearsal plan (2 rollout steps x 2 groups x 8 at max_tokens 64, 4 test items,
the smallest whose activation gate still passes on the stand-in) with the default
options, its whole process group killed once both arms have finished step 1, then the same command
with `--resume RUN_ID`. With the default `--save-every` (5) no step was saved yet: the kill falls
between saves, and the resume rewinds to the shared initial checkpoint and trains step 0 again.

- nothing of the killed run is left running; its bundle stays `status: running` and verifies;
- the killed run keeps its journal (the rows of the steps before the kill, its snapshots);
- the resumed session reruns neither the preflight nor the gate, reuses their evidence, names
  the run and session it continues with that session's last journaled snapshot, and its bundle passes
  `python -m dppo_harness.evidence verify`;
- its per-step rows equal an uninterrupted run's from the same initial checkpoint (computed here
  on the same server state): token-derived fields exactly, logprob-derived floats within
  RESUME_FLOAT_ATOL; every step of every arm is there once (the killed session's rows of the
  rewound steps are not kept).

Unit parity in these sessions is the loss-parity file alone (tests/unit/test_losses.py), to keep
CI time down; the comparison still starts only after it passed in the same session. Both runs
use the space form `--evidence-dir DIR` with DIR existing, from a working directory outside the
project.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from comparison_rows import TOKEN_FIELDS, comparable, row_differences
from harness_paths import LOSS_PARITY
from server_in_process import ServerInProcess

from dppo_harness.data import gsm8k, tokenizer
from dppo_harness.evidence import verify_bundle
from dppo_harness.evidence.journal import read_entries
from dppo_harness.plans import load_plan
from dppo_harness.service.observed import ClientRegistry, create_from_state_with_response, make_service_client
from dppo_harness.stages.comparison.run import make_loss, run_arm_step
from dppo_harness.stages.comparison.state import state_path

pytestmark = pytest.mark.timeout(3000)

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "tests" / "fixtures" / "plans" / "comparison-ci-kill-resume.json"
TESTS = [ROOT / LOSS_PARITY, ROOT / "tests" / "preflight", ROOT / "tests" / "gates", ROOT / "tests" / "comparison"]
KILL_AFTER = 1
FROM_STEP = 0  # the last step all arms saved before the kill: none, so the shared initial checkpoint


def _command(evidence: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "comparison",
        *map(str, TESTS),
        "--plan",
        str(PLAN),
        "--evidence-dir",
        str(evidence),
        "--timeout=2400",
        "-p",
        "no:cacheprovider",
        "-q",
        *extra,
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TINKER_BASE_URL"}
    return dict(env, PYTHONUNBUFFERED="1", TINKER_TELEMETRY="0")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_and_kill(evidence: Path, cwd: Path) -> tuple[list[str], float]:
    """Start the comparison; SIGKILL its process group when both arms reported step KILL_AFTER
    (reported after the step's row was journaled)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        _command(evidence),
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, seen = [], set()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[comparison] ") and f" step {KILL_AFTER}/" in line:
                seen.add(line.split()[1])
            if len(seen) == 2:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
    assert len(seen) == 2, f"the run ended before both arms saved step {KILL_AFTER}:\n" + "".join(lines[-60:])
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "a process of the killed run is still running"
    return lines, time.monotonic() - t0


def _uninterrupted_rows(server_dir: Path, initial_checkpoint: str) -> list[dict]:
    """Both arms from the shared initial checkpoint for every step, without a stop (the server
    state the killed and resumed runs used, so the checkpoint resolves). The server runs in this
    process: what it serves is the same, without a second interpreter and torch start-up."""
    run = load_plan(PLAN).run
    registry = ClientRegistry()
    rows = []
    with ServerInProcess(server_dir) as srv:
        try:
            sc = make_service_client("local", srv.base_url, registry=registry, stage="reference")
            clients = {a.name: create_from_state_with_response(sc, initial_checkpoint)[0] for a in run.arms}
            arm_losses = {a.name: make_loss(a, run) for a in run.arms}
            train = gsm8k.load_split("train", seed=run.seed)
            renderer = tokenizer.make_renderer().renderer
            for step in range(run.rollout_steps):  # the comparison's arm-step, arm after arm
                items = train.batch(step, run.groups_per_batch)
                for a in run.arms:
                    rows.append(
                        run_arm_step(clients[a.name], a, run, step, items, renderer, arm_losses[a.name], "reference")
                    )
        finally:
            registry.release_all()
    return rows


def _rows(path: Path) -> list[dict]:
    rows = [comparable(json.loads(x)) for x in path.read_text().splitlines() if x.strip()]
    return sorted(rows, key=lambda r: (r["arm"], r["step"]))


def test_sigkilled_comparison_resumes_into_a_bundle_that_verifies(tmp_path):
    evidence = tmp_path / "runs"
    evidence.mkdir()  # exists before the first run: the space form must still root at the project
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    _lines, killed_s = _run_and_kill(evidence, elsewhere)
    killed_id = (evidence / "LATEST").read_text().strip()
    killed = evidence / killed_id
    assert json.loads((killed / "result.json").read_text())["status"] == "running"
    assert verify_bundle(killed) == [], "the killed run's bundle does not verify"
    told = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(killed)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert told.returncode == 3 and "INCOMPLETE" in told.stdout, told.stdout  # hashes hold; never read as verified
    state = json.loads(state_path(evidence / "comparison-state", killed_id).read_text())
    assert all(a["steps_done"] == KILL_AFTER and str(KILL_AFTER) not in a["saves"] for a in state["arms"].values()), (
        state
    )
    journal = read_entries(killed / "journal.jsonl")  # what the kill left: every entry appended before it
    last_snapshot = [e for e in journal if e.kind == "snapshot"][-1]
    assert f"s{KILL_AFTER}" not in [e.label for e in journal if e.kind == "state"]  # killed between saves
    rows = {(e.data["arm"], e.data["step"]) for e in journal if e.kind == "row"}
    assert {(a, s) for a in state["arms"] for s in range(KILL_AFTER)} <= rows

    t0 = time.monotonic()
    resumed_proc = subprocess.run(
        _command(evidence, "--resume", killed_id),
        cwd=elsewhere,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=2400,
    )
    resumed_s = time.monotonic() - t0
    out = resumed_proc.stdout + resumed_proc.stderr
    assert resumed_proc.returncode == 0, out[-5000:]
    assert "[gate]" not in out, "the resumed session reran the gate"
    resumed = evidence / (evidence / "LATEST").read_text().strip()
    assert resumed.name != killed_id
    check = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(resumed)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr

    result = json.loads((resumed / "result.json").read_text())
    assert result["status"] == "succeeded", result["status"]
    prov = result["initialization_provenance"]
    resume = prov["resume"]
    assert resume["comparison_run"] == killed_id and resume["resumed_times"] == 1 and resume["from_step"] == FROM_STEP
    assert resume["continues_session"]["run_id"] == killed_id and resume["continues_session"]["status"] == "running"
    assert resume["continues_session"]["last_snapshot"] == {
        "run_id": killed_id,
        "seq": last_snapshot.seq,
        "sha256": last_snapshot.sha256,
    }
    for arm in state["arms"]:  # the checkpoint each arm actually loaded: the shared initial state
        assert prov["arms"][arm]["loaded_checkpoint_uri"] == state["initial_checkpoint"]
    manifest = json.loads((resumed / "files" / resume["evidence_ref"]).read_text())
    reused = {f["name"] for f in manifest["reused_files"]}
    assert "activation-gate-report.json" in reused and "feasibility-pilot.json" in reused, reused
    own = {f["name"] for f in result["evidence"]["files"]}
    assert not {"restoration-probe.json", "gate-pilot-step0.npz"} & own  # neither the preflight nor the gate ran
    report = (resumed / "files" / "report.md").read_text()
    assert f"from step {FROM_STEP}" in report and "1 time(s)" in report and killed_id in report

    reference = _uninterrupted_rows(evidence / "local-server", state["initial_checkpoint"])
    got = _rows(resumed / "files" / "comparison-steps-1.jsonl")
    want = sorted((comparable(r) for r in reference), key=lambda r: (r["arm"], r["step"]))
    assert [(r["arm"], r["step"]) for r in got] == [(r["arm"], r["step"]) for r in want]
    problems = [p for g, w in zip(got, want, strict=True) for p in row_differences(g, w)]
    assert not problems, "resumed run differs from the uninterrupted run:\n" + "\n".join(problems)
    worst = max(
        abs(float(g[k]) - float(w[k])) for g, w in zip(got, want) for k in w if k not in (*TOKEN_FIELDS, "arm", "step")
    )
    print(f"killed run {killed_s:.0f} s, resumed run {resumed_s:.0f} s; max logprob-derived |diff| {worst:.3g}")

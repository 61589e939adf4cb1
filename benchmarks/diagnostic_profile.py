"""Where `pytest -m diagnostic` spends its time: the main job, end to end, phase by phase.

    python benchmarks/diagnostic_profile.py [--out DIR] [--json] [-- EXTRA PYTEST ARGS]

Runs `pytest -m diagnostic --timeout=720` once (a fresh evidence dir and pytest basetemp under
--out, default a new temp dir; `stage_cpu_plugin` records each test's wall window and the harness
process's CPU) and prints, from what that run itself recorded:

- wall and CPU seconds (user + system) of the whole run, split into the harness process and the
  embedded server process (its own `os.times()`, in `server_stats.json` at shutdown), with the load
  average before and after: on a shared machine wall seconds are not comparable between runs, CPU
  seconds mostly are;
- per stage (unit parity, preflight, diagnostic): wall, harness CPU, server CPU (the server's
  cumulative CPU on its `engine ...` log lines, cut at the stage boundaries), and the server start;
- the diagnostic: restore, sampling + freezing (wall, server CPU), initial sentinels, then per
  update the client's view (`diagnostic-analysis.json` timings.update_phases: waiting for the
  custom loss's forward, the loss + recorder, persisting the update's tensors before the optimizer
  step, waiting for the backward and the optimizer step, collecting a sentinel) next to the
  server's (one `engine ...` line per call: wall and CPU of the first-pass forward, the backward
  pass, the optimizer step, the sentinel forwards of the trained model), and what comes after
  training (analysis, replay, report, evidence).

Nothing is asserted; the figures go to docs/benchmarks.md with the date, machine and load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) dppo_harness\.local_server\.engine engine (?P<label>\S+) "
    r"(?P<wall>[\d.]+)s wall (?P<cpu>[\d.]+)s cpu \(process (?P<proc>[\d.]+)s cpu\)"
    r"(?: model (?P<model>\S+))?(?: (?P<datums>\d+) datums (?P<tokens>\d+) tokens)?"
)
READY_LINE = re.compile(r"engine \S+ ready in (?P<s>[\d.]+)s")
STARTING_LINE = re.compile(r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) dppo_harness\.local_server starting")


def _ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_diagnostic(out: Path, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "diagnostic",
        "--timeout=720",
        "-p",
        "no:cacheprovider",
        "-p",
        "stage_cpu_plugin",
        f"--basetemp={out / 'pytest'}",
        f"--evidence-dir={out / 'evidence'}",
        *extra,
    ]
    env = dict(os.environ, DIAGNOSTIC_PROFILE_TESTS=str(out / "tests.json"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "benchmarks"), env.get("PYTHONPATH")) if p)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = os.getloadavg(), time.perf_counter()
    with open(out / "pytest.log", "wb") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "command": " ".join(cmd[2:]),
        "exit_code": rc,
        "wall_s": wall,
        "cpu_s": cpu,
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
    }


def stage_of(nodeid: str) -> str:
    parts = nodeid.split("/")
    return {"unit": "unit parity", "preflight": "preflight", "diagnostic": "diagnostic"}.get(
        parts[1] if len(parts) > 2 and parts[0] == "tests" else "", "other"
    )


def engine_calls(log: Path) -> list[dict]:
    rows = []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        m = ENGINE_LINE.search(line)
        if m:
            rows.append(
                {
                    "end": _ts(m["ts"]),
                    "label": m["label"],
                    "wall": float(m["wall"]),
                    "cpu": float(m["cpu"]),
                    "proc": float(m["proc"]),
                    "model": m["model"],
                    "datums": int(m["datums"]) if m["datums"] else None,
                    "tokens": int(m["tokens"]) if m["tokens"] else None,
                }
            )
    return rows


def server_cpu_until(calls: list[dict], t: float) -> float:
    """The server's cumulative CPU at the last engine call that ended by `t` (0 before any)."""
    done = [c["proc"] for c in calls if c["end"] <= t]
    return max(done) if done else 0.0


def trained_model_calls(calls: list[dict]) -> dict[str, list[dict]]:
    """The diagnostic's trained client is the model with the most backward passes; its forwards
    right before a backward are the custom loss's first passes, the others sentinel/probe forwards."""
    per_model: dict[str, list[dict]] = defaultdict(list)
    for c in calls:
        if c["model"]:
            per_model[c["model"]].append(c)
    if not per_model:
        return {}
    model = max(per_model, key=lambda m: sum(c["label"] == "forward_backward" for c in per_model[m]))
    seq = per_model[model]
    kinds: dict[str, list[dict]] = defaultdict(list)
    for i, c in enumerate(seq):
        if c["label"] == "forward":
            nxt = seq[i + 1]["label"] if i + 1 < len(seq) else None
            kinds["first-pass forward" if nxt == "forward_backward" else "sentinel/probe forward"].append(c)
        elif c["label"] == "forward_backward":
            kinds["backward pass (forward_backward)"].append(c)
        else:
            kinds[c["label"]].append(c)
    return dict(kinds)


def _json(path: Path | None) -> dict:
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def summarize(out: Path, run: dict) -> dict:
    evidence = out / "evidence"
    run_id = (evidence / "LATEST").read_text().strip() if (evidence / "LATEST").is_file() else None
    files = evidence / run_id / "files" if run_id else None
    analysis = _json(files / "diagnostic-analysis.json" if files else None)
    ledger = _json(evidence / run_id / "ledger.json" if run_id else None)
    stage_ends = {row["stage"]: row for row in ledger.get("stages", [])}
    server_dirs = sorted((out / "pytest").glob("local-server*"))
    server_dir = server_dirs[0] if server_dirs else out / "pytest"
    stats = _json(server_dir / "server_stats.json")
    log = server_dir / "server.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    ready = [float(m["s"]) for m in map(READY_LINE.search, text.splitlines()) if m]
    started = [_ts(m["ts"]) for m in map(STARTING_LINE.search, text.splitlines()) if m]
    calls = engine_calls(log)
    recorded = _json(out / "tests.json")
    tests = recorded.get("tests", [])
    stages: dict[str, dict] = {}
    for row in tests:
        st = stages.setdefault(
            stage_of(row["nodeid"]), {"tests": 0, "start": row["start"], "end": row["end"], "harness_cpu_s": 0.0}
        )
        st["tests"] += 1
        st["start"], st["end"] = min(st["start"], row["start"]), max(st["end"], row["end"])
        st["harness_cpu_s"] += row["cpu_s"]
    for st in stages.values():
        st["wall_s"] = st["end"] - st["start"]
        st["server_cpu_s"] = server_cpu_until(calls, st["end"]) - server_cpu_until(calls, st["start"])
    diag_window = stages.get("diagnostic", {})
    sampling = [c for c in calls if c["label"] == "asample" and c["end"] >= diag_window.get("start", 0.0)]
    timings = analysis.get("timings", {})
    return {
        "run": run,
        "server_process_cpu_s": stats.get("process_cpu_seconds"),
        "harness_process_cpu_s": recorded.get("session_cpu_s"),
        "harness_tests_cpu_s": sum(r["cpu_s"] for r in tests),
        "server_engine_ready_s": ready[0] if ready else None,
        "server_started_at": started[0] if started else None,
        "stages": stages,
        "sampling_server_cpu_s": (max(c["proc"] for c in sampling) - min(c["proc"] - c["cpu"] for c in sampling))
        if sampling
        else None,
        "diagnostic": {
            k: timings.get(k) for k in ("restore_seconds", "sampling_seconds", "setup_seconds", "wall_seconds")
        },
        "update_seconds": timings.get("update_seconds") or [],
        "update_phases": timings.get("update_phases") or [],
        "engine_by_kind": trained_model_calls(calls),
        "retained_forwards": stats.get("retained_forwards"),
        # the ledger's clock starts with the evidence bundle, inside the preflight's first test
        "session_start_after_preflight_start_s": (
            stage_ends["preflight"]["seconds"] - stage_ends["preflight"]["elapsed_at_end"]
        )
        if "preflight" in stage_ends
        else None,
        "diagnostic_stage_end_s": stage_ends.get("diagnostic", {}).get("elapsed_at_end"),
    }


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def print_report(s: dict) -> None:
    run = s["run"]
    la = [" ".join(f"{x:.2f}" for x in run[k]) for k in ("loadavg_before", "loadavg_after")]
    print(f"command: python -m {run['command']}  (exit code {run['exit_code']})")
    print(f"load average before: {la[0]}; after: {la[1]}")
    server_cpu = s["server_process_cpu_s"]
    split = (
        f"server process {server_cpu:.1f} s, harness {run['cpu_s'] - server_cpu:.1f} s"
        if server_cpu is not None
        else "server CPU not recorded"
    )
    print(f"wall {run['wall_s']:.1f} s; CPU {run['cpu_s']:.1f} s ({split})")
    if s["harness_process_cpu_s"] is not None and server_cpu is not None:
        own = s["harness_process_cpu_s"]
        print(
            f"  harness: pytest process {own:.1f} s (tests {s['harness_tests_cpu_s']:.1f} s; collection, imports, "
            f"session start and end {own - s['harness_tests_cpu_s']:.1f} s), CLIs the tests ran in subprocesses "
            f"{run['cpu_s'] - server_cpu - own:.1f} s"
        )
    print("\nstage            tests   wall s  harness CPU s  server CPU s")
    for name in ("unit parity", "preflight", "diagnostic", "other"):
        st = s["stages"].get(name)
        if st:
            print(
                f"  {name:<14} {st['tests']:5d} {st['wall_s']:8.1f} {st['harness_cpu_s']:14.1f} {st['server_cpu_s']:13.1f}"
            )
    if s["server_engine_ready_s"] is not None:
        print(
            f"  server: engine loaded in {s['server_engine_ready_s']:.1f} s (server.log 'ready in'; "
            "before it, the process imports torch, transformers, peft, aiohttp)"
        )
    d = s["diagnostic"]
    if d.get("wall_seconds") is not None:
        print("\ndiagnostic (seconds since the session start, the budget ledger's clock)")
        samp_cpu = s["sampling_server_cpu_s"]
        print(
            f"  restore {d['restore_seconds']:.1f} s; sampling + freeze {d['sampling_seconds']:.1f} s"
            + (f" (server CPU {samp_cpu:.1f} s)" if samp_cpu is not None else "")
            + f"; setup done at {d['setup_seconds']:.1f} s; training stopped at {d['wall_seconds']:.1f} s"
        )
    ups = s["update_seconds"]
    if ups:
        print(
            f"  {len(ups)} updates: {sum(ups):.1f} s, mean {_mean(ups):.2f} s, median {statistics.median(ups):.2f} s, "
            f"min {min(ups):.2f} s, max {max(ups):.2f} s"
        )
    if s["update_phases"]:
        keys = [k for k in s["update_phases"][0] if k != "total"]
        print(
            "  client view per update (mean s): "
            + ", ".join(f"{k} {_mean([p.get(k, 0.0) for p in s['update_phases']]):.2f}" for k in keys)
        )
    if s["engine_by_kind"]:
        print("  server view, trained model (calls: mean wall s / mean CPU s / total CPU s)")
        for kind, rows in s["engine_by_kind"].items():
            print(
                f"    {kind:<34} {len(rows):3d}: {_mean([r['wall'] for r in rows]):6.2f} / "
                f"{_mean([r['cpu'] for r in rows]):6.2f} / {sum(r['cpu'] for r in rows):6.1f}"
            )
    if s["retained_forwards"]:
        print(f"  retained first passes: {s['retained_forwards']}")
    if s["diagnostic_stage_end_s"] is not None and d.get("wall_seconds") is not None:
        print(
            f"  after training (final checkpoint, analysis, replay, report, evidence, the stage's other tests): "
            f"{s['diagnostic_stage_end_s'] - d['wall_seconds']:.1f} s"
        )
    if s["session_start_after_preflight_start_s"] is not None:
        print(
            f"  the session clock started {s['session_start_after_preflight_start_s']:.1f} s into the preflight "
            "(server start, connectivity, evidence bundle)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="working dir (default: a new temp dir)")
    ap.add_argument("--json", action="store_true", help="also print the summary as JSON")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="diagnostic-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    run = run_diagnostic(out, args.pytest_args)
    summary = summarize(out, run)
    print_report(summary)
    print(f"\nrun directory: {out}")
    if args.json:
        print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()

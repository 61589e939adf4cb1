"""The plan tool (`python -m dppo_harness.plans validate`), the launch-scope rule, and
the refusal of a bad spec by `pytest -m preflight --plan` before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_env import harness_env

from dppo_harness.loss.loss_registry import loss_names
from dppo_harness.plans import launch_refusal, launch_undecided_refusal, load_plan, unauthorized_stages

REGISTERED = ", ".join(loss_names())  # whatever losses are registered

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "plans" / "exp_e6b0965af3.json"
SHIPPED = ROOT / "plans" / "rehearsal" / "comparison-local.json"
DIAG = ROOT / "plans" / "exp_e6b0965af3-diagnostic-r1.json"
ENV = harness_env(PYTHONPATH=str(ROOT / "src"))


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dppo_harness.plans", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_validate_prints_the_effective_config_or_one_line_per_error(tmp_path):
    ok = _cli("validate", str(SHIPPED))
    assert ok.returncode == 0, ok.stderr
    cfg = json.loads(ok.stdout)
    assert cfg["plan"]["kind"] == "rehearsal" and cfg["config"]["run"]["stated_in_prose"]["group_size"]["value"] == 8
    raw = json.loads(SPEC.read_text())
    raw["lora_rank"] = "32"
    raw["optimizer"].pop("lr")
    raw["arms"][0]["seed"] = 0.5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    proc = _cli("validate", str(bad))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(lines) == 3 and all(line.startswith(f"{bad}: ") for line in lines), lines
    assert {line.split(": ")[1] for line in lines} == {"lora_rank", "optimizer.lr", "arms[0].seed"}
    raw = json.loads(SPEC.read_text())
    raw["arms"][1]["loss"] = "dppo_v2"
    bad.write_text(json.dumps(raw))
    proc = _cli("validate", str(bad))
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"{bad}: bad.json.resolution.json: no such file beside the plan; the spec format has no field for "
        "groups_per_batch, group_size, temperature, max_tokens or the baseline arm, so this file states them, each "
        "value with the spec sentence it quotes"
    )
    (tmp_path / "bad.json.resolution.json").write_bytes((ROOT / "plans" / f"{SPEC.name}.resolution.json").read_bytes())
    proc = _cli("validate", str(bad))
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"{bad}: arms[1].loss: 'dppo_v2' is not a registered loss (registered: " + REGISTERED + ")"
    )
    assert _cli("rehearse", str(SPEC), "--out", str(tmp_path / "r.json")).returncode == 2  # no such command


def test_preflight_with_an_unknown_loss_stops_in_seconds_with_one_line(tmp_path):
    raw = json.loads(SPEC.read_text())
    raw["arms"][1]["loss"] = "dppo_v2"
    plan = tmp_path / "unknown-loss.json"
    plan.write_text(json.dumps(raw))
    (tmp_path / f"{plan.name}.resolution.json").write_bytes(
        (ROOT / "plans" / f"{SPEC.name}.resolution.json").read_bytes()
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "preflight",
            f"--plan={plan}",
            "-p",
            "no:cacheprovider",
            f"--evidence-dir={tmp_path / 'evidence'}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    secs = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-2000:]
    assert proc.stderr.strip() == (
        f"ERROR: --plan: {plan}: arms[1].loss: 'dppo_v2' is not a registered loss (registered: " + REGISTERED + ")"
    ), proc.stderr
    assert "Traceback" not in out and not (tmp_path / "evidence").exists()  # nothing collected, started or written
    assert secs < 120, secs  # pytest start-up only (the refusal is at configure time)


def test_launch_rule_refuses_unauthorized_training_stages_on_a_real_service():
    spec, diag = load_plan(SPEC), load_plan(DIAG)
    stages = ("unit", "preflight", "gate", "comparison")
    # the saved spec's launch, stated in its resolution file: nothing authorized but the diagnostic plan
    assert unauthorized_stages(spec.launch, stages) == ["gate", "comparison"]
    line = launch_refusal(
        spec.name, spec.launch, stages, embedded=False, service="https://svc", stated_in=spec.launch_stated_in
    )
    assert line == (
        "launch scope: stage gate, comparison is not authorized on https://svc (not the embedded server): "
        "plan exp_e6b0965af3.json's launch (stated in exp_e6b0965af3.json.resolution.json) authorizes no "
        f"training stage ({spec.launch.scope}); a plan whose launch.authorized_stages lists "
        "gate, comparison would authorize it"
    )
    assert unauthorized_stages(None, stages) == ["gate", "comparison"]  # no launch at all: nothing authorized
    line = launch_refusal("x.json", None, stages, embedded=False, service="https://svc")
    assert line is not None and "plan x.json carries no launch block" in line
    assert launch_refusal(spec.name, spec.launch, stages, embedded=True, service="x") is None  # rehearsal
    assert launch_refusal(spec.name, spec.launch, ("unit", "preflight"), embedded=False, service="x") is None
    # the requester's launch: only the bounded diagnostic
    assert diag.launch is not None and diag.launch.authorized_stages == ["diagnostic"]
    assert (
        launch_refusal(diag.name, diag.launch, ("unit", "preflight", "diagnostic"), embedded=False, service="x") is None
    )
    line = launch_refusal(diag.name, diag.launch, ("gate",), embedded=False, service="x")
    assert line is not None and "launch authorizes diagnostic (single bounded diagnostic continuation" in line
    # the declared rehearsal states that it authorizes nothing on a real service
    rehearsal = load_plan(SHIPPED)
    assert rehearsal.launch is not None and rehearsal.launch.authorized_stages == []
    line = launch_refusal(rehearsal.name, rehearsal.launch, stages, embedded=False, service="x")
    assert line is not None and "launch authorizes no training stage (offline rehearsal on the embedded server" in line
    # the service could not be identified: refused when a stage needs authorization, never skipped
    seen = "connectivity preflight (reachable): https://svc answered HTTP 503"
    line = launch_undecided_refusal(spec.name, spec.launch, stages, service="https://svc", seen=seen)
    assert line is not None and line.startswith(
        "launch scope: stage gate, comparison is authorized only on the embedded"
    )
    assert seen in line and "launch.authorized_stages lists gate, comparison" in line
    assert launch_undecided_refusal(diag.name, diag.launch, ("unit", "diagnostic"), service="x", seen=seen) is None

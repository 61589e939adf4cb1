"""The plan tools (`python -m dppo_harness.plans rehearse|validate`), the launch-scope rule, and
the refusal of a bad spec by `pytest -m preflight --plan` before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_env import harness_env

from dppo_harness.plans import (
    RehearsalSize,
    launch_refusal,
    launch_undecided_refusal,
    load_plan,
    make_rehearsal,
    unauthorized_stages,
)

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "plans" / "exp_e6b0965af3.json"
SHIPPED = ROOT / "plans" / "rehearsal" / "comparison-local.json"
DIAG = ROOT / "plans" / "exp_e6b0965af3-diagnostic-r1.json"
VARIANT = ROOT / "tests" / "fixtures" / "plans" / "spec-variant.json"
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


def _shipped_lr_reason() -> str:
    return next(d["reason"] for d in json.loads(SHIPPED.read_text())["differences"] if d["field"] == "optimizer.lr")


def test_rehearse_reproduces_the_shipped_rehearsal_plan_byte_for_byte():
    """Given the shipped plan's size and its measured lr reason, the tool writes exactly its bytes."""
    size = RehearsalSize(steps=3, groups=4, eval_items=50, lr=0.01, lr_reason=_shipped_lr_reason())
    assert make_rehearsal(SPEC, SHIPPED, size) == SHIPPED.read_bytes()
    # the defaults (no option) are the shipped plan's: the measured lr and its reason, 4 groups x 8
    assert make_rehearsal(SPEC, SHIPPED, RehearsalSize(groups=None, lr=0.01)) == SHIPPED.read_bytes()
    # another lr without a reason differs only in the lr differences
    generic = json.loads(make_rehearsal(SPEC, SHIPPED, RehearsalSize(3, 4, 50, 0.02)))
    shipped = json.loads(SHIPPED.read_text())
    assert [d["field"] for d in generic["differences"]] == [d["field"] for d in shipped["differences"]]
    changed = [d["field"] for d, s in zip(generic["differences"], shipped["differences"], strict=True) if d != s]
    assert changed and all(f.endswith("lr") or f.endswith("learning_rate") or f == "method" for f in changed)


def test_rehearse_with_no_option_makes_a_new_spec_run_on_the_stand_in(tmp_path):
    """A new spec of the family, no option: the stand-in's measured lr (the mask fires) and 32
    rollouts per batch (8 groups of 4: a batch holds gradient-bearing tokens), each declared with
    its measured reason; --spec-lr keeps the spec's lr."""
    out = tmp_path / "variant-default.json"
    proc = _cli("rehearse", str(VARIANT), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = load_plan(out)
    run = plan.run
    assert all(a.lr == 0.01 for a in run.arms) and run.groups_per_batch.value == 8 and run.rollout_steps == 3
    assert run.eval_items == 50 and run.group_size.value == 4 and run.max_tokens.value == 96
    reasons = {d.field: d.reason for d in plan.rehearsal.differences}
    assert "the stand-in's DPPO mask was measured to fire at this lr" in reasons["optimizer.lr"], reasons
    assert "the spec's 3e-5 is a setting for Qwen/Qwen3.5-2B" in reasons["optimizer.lr"]
    assert "8 groups: 32 rollouts per batch as in the shipped rehearsal" in reasons["steps"], reasons
    assert "batch_size" not in reasons  # the spec's own 8 x 4: nothing to change
    kept = tmp_path / "variant-spec-lr.json"
    assert _cli("rehearse", str(VARIANT), "--out", str(kept), "--spec-lr").returncode == 0
    assert all(a.lr == 3e-5 for a in load_plan(kept).run.arms)


def test_rehearse_cli_writes_a_plan_that_validates_with_the_specs_own_values(tmp_path):
    out = tmp_path / "variant-rehearsal.json"
    proc = _cli(
        "rehearse",
        str(VARIANT),
        "--out",
        str(out),
        "--steps",
        "2",
        "--groups",
        "2",
        "--eval-items",
        "8",
        "--lr",
        "0.01",
    )
    assert proc.returncode == 0, proc.stderr
    assert "it validates" in proc.stderr
    plan = load_plan(out)
    assert plan.kind == "rehearsal" and plan.rehearsal.derived_from.sha256 == load_plan(VARIANT).sha256
    run = plan.run
    assert [a.name for a in run.arms] == ["clip_ref_s7", "tv_mask_s7"] and run.lora_rank == 16 and run.seed == 7
    assert (run.rollout_steps, run.groups_per_batch.value, run.group_size.value, run.max_tokens.value) == (2, 2, 4, 96)
    assert run.eval_items == 8 and run.criteria[0].margin == 0.05 and all(a.lr == 0.01 for a in run.arms)
    assert (
        "groups_per_batch=2" in run.groups_per_batch.source and "2 rollout steps (4 optim steps)" in plan.spec["method"]
    )
    assert [c.model_dump(exclude_none=True) for c in run.gate_checks][:4] == [
        c.model_dump(exclude_none=True) for c in load_plan(VARIANT).run.gate_checks
    ][:4]  # gates unchanged
    assert _cli("rehearse", str(VARIANT), "--out", str(out)).returncode == 1  # never overwritten silently


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
        f"{bad}: arms[1].loss: 'dppo_v2' is not a registered loss (registered: dppo_divergence_mask, grpo_clip_eps0.2)"
    )


def test_preflight_with_an_unknown_loss_stops_in_seconds_with_one_line(tmp_path):
    raw = json.loads(SPEC.read_text())
    raw["arms"][1]["loss"] = "dppo_v2"
    plan = tmp_path / "unknown-loss.json"
    plan.write_text(json.dumps(raw))
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
        f"ERROR: --plan: {plan}: arms[1].loss: 'dppo_v2' is not a registered loss "
        "(registered: dppo_divergence_mask, grpo_clip_eps0.2)"
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

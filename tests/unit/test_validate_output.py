"""`plans validate` prints the effective config as JSON on stdout, unchanged, and on stderr every
schedule value with the sentence its resolution file quotes (a default says so) and, as
information, the decision's half-width at the planned item count next to each margin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dppo_harness.plans import load_plan, plan_config
from dppo_harness.plans.resolution import KEYS

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "plans" / "exp_e6b0965af3.json"


def _validate(path: Path) -> tuple[dict, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-m", "dppo_harness.plans", "validate", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr.splitlines()


def test_validate_prints_every_prose_value_with_its_sentence_and_the_half_width_next_to_the_margin():
    config, lines = _validate(SAVED)
    assert config == json.loads(json.dumps(plan_config(load_plan(SAVED))))  # stdout: the effective config
    run = load_plan(SAVED).run
    for key, stated in run.stated.items():  # every value, with the sentence it quotes
        assert any(
            line.startswith(f"  {key} = {stated.value} ({KEYS[key].what}) from exp_e6b0965af3.json.resolution.json: ")
            and stated.source in line
            for line in lines
        ), (key, lines)
    assert any(line.startswith("  gate_pilot_steps = 5 ") and "A 5-step pilot" in line for line in lines), lines
    (half,) = [line for line in lines if "half-width" in line]
    assert (
        "primary: accuracy dppo_seed0 - grpo_seed0: half-width 0.07479 at 1319 paired items (alpha 0.05, "
        "difference range 2) next to margin 0: supported needs an observed mean difference above 0.07479, "
        "refuted one below -0.07479"
    ) in half, half


def test_a_default_and_an_unreachable_verdict_are_said_plainly(tmp_path):
    raw = json.loads(SAVED.read_text())
    raw["eval"]["n_examples"] = 8
    raw["decision_rule"]["criteria"][0]["margin"] = 0.05
    path = tmp_path / "small.json"
    path.write_text(json.dumps(raw))
    resolution = json.loads((ROOT / "plans" / "exp_e6b0965af3.json.resolution.json").read_text())
    del resolution["values"]["minibatches_per_batch"]
    (tmp_path / "small.json.resolution.json").write_text(json.dumps(resolution))
    config, lines = _validate(path)
    assert config["config"]["run"]["stated_in_prose"]["minibatches_per_batch"]["default"] is True
    assert any(
        line.startswith(
            "  minibatches_per_batch = 2 (complete-group minibatches per rollout batch) "
            "default (arms[*].updates_per_batch): one complete-group minibatch per update (the resolution file "
            "states no split)"
        )
        for line in lines
    ), lines
    (half,) = [line for line in lines if "half-width" in line]
    assert (
        "half-width 0.9603 at 8 paired items" in half
        and "above 1.01 (unreachable)" in half
        and "refuted one below -0.9103" in half
        and "-0.9103 (unreachable)" not in half
    ), half

"""The closing block of a run: composed from result.json (pure), printed by pytest_terminal_summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from dppo_harness.evidence.run_summary import TITLE, summary_lines
from dppo_harness.pytest_plugin import stages

REPO = Path(__file__).resolve().parents[2]


def _result(**over):
    base = {
        "status": "succeeded",
        "verdict": "inconclusive",
        "outcome_reason": "insufficient_evidence",
        "metrics": {
            "arms": {
                "grpo_seed0": {
                    "steps_completed": 3.0,
                    "reward_mean_last": 0.125,
                    "accuracy": 0.4,
                    "eval_n": 50.0,
                    "eval_invalid_outputs": 7.0,
                },
                "dppo_seed0": {
                    "steps_completed": 3.0,
                    "reward_mean_last": 0.25,
                    "accuracy": 0.44,
                    "eval_n": 50.0,
                    "eval_invalid_outputs": 5.0,
                },
                "base": {"accuracy": 0.3, "eval_n": 50.0, "eval_invalid_outputs": 9.0},
            }
        },
        "completed_arms": ["grpo_seed0", "dppo_seed0"],
        "evidence": {"files": [{"name": "report.md"}, {"name": "result-0001.json"}]},
    }
    base.update(over)
    return base


def test_comparison_block_names_run_verdict_paths_and_every_arm(tmp_path):
    run_dir = tmp_path / "evidence" / "20261201-abc"
    lines = summary_lines(_result(), run_dir)
    assert lines[0] == "run 20261201-abc: status succeeded, verdict inconclusive (insufficient_evidence)"
    assert f"evidence: {run_dir}" in lines and f"report:   {run_dir / 'files' / 'report.md'}" in lines
    arms = [ln.strip() for ln in lines if ln.startswith("  ")]
    assert arms[0] == "grpo_seed0: 3 steps (completed), final reward 0.125, accuracy 0.4 (n=50, 7 invalid)"
    assert arms[1].startswith("dppo_seed0: 3 steps (completed), final reward 0.25, accuracy 0.44")
    assert arms[2] == "base model: accuracy 0.3 (n=50, 9 invalid)"


def test_stopped_run_names_the_stage_and_why(tmp_path):
    res = _result(
        status="failed",
        verdict="inconclusive",
        outcome_reason="incomplete_execution",
        metrics={"arms": {"grpo_seed0": {"steps_completed": 1.0, "reward_mean_last": 0.0}}},
        completed_arms=[],
        evidence={"files": []},
    )
    lines = summary_lines(
        res,
        tmp_path / "r1",
        stage_failures={"gate": "tests/gates/t.py::test_gate"},
        failure_messages={"gate": "tests/gates/t.py::test_gate: dppo_masked_token_fraction: 0 < min"},
        stage_order=stages.STAGES,
    )
    assert lines[1] == "stopped at stage 'gate': tests/gates/t.py::test_gate: dppo_masked_token_fraction: 0 < min"
    assert "report:   none written (no stage reached its report)" in lines
    assert "  grpo_seed0: 1 steps, final reward 0, accuracy n/a (not evaluated)" in lines
    budget = summary_lines(res, tmp_path / "r1", stage_failures={"comparison": "blocked_by_budget before comparison"})
    assert budget[1] == "stopped at stage 'comparison': blocked_by_budget before comparison"


def test_diagnostic_and_capacity_blocks(tmp_path):
    diag = {
        "status": "succeeded",
        "verdict": "inconclusive",
        "metrics": {
            "arms": {},
            "diagnostic/updates_done": 16.0,
            "diagnostic/mask_fired": 0.0,
            "diagnostic/active": 0.0,
        },
        "completed_arms": [],
        "evidence": {"files": [{"name": "report.md"}]},
    }
    lines = summary_lines(diag, tmp_path / "d")
    assert lines[0] == "run d: status succeeded, verdict inconclusive"
    assert (
        lines[-1] == "  bounded diagnostic (dppo_seed0 trained, no outcome arms): 16 updates, mask fired no, active no"
    )
    cap = _result(
        status="failed", capacity_block={"error": "trainer capacity exhausted", "comparison_steps_completed": 2}
    )
    assert summary_lines(cap, tmp_path / "c")[1] == (
        "stopped by service capacity after 2 comparison steps: trainer capacity exhausted"
    )
    running = summary_lines({"status": "running", "metrics": {"arms": {}}}, tmp_path / "x")
    assert running[0] == "run x: status running, no verdict" and "status still running" in running[1]


INNER = """
from dppo_harness.evidence import EvidenceBundle
from dppo_harness.pytest_plugin.hooks import STATE_KEY


def test_parity(pytestconfig, tmp_path_factory):
    bundle = EvidenceBundle.create(tmp_path_factory.mktemp("ev"))
    bundle.post_arm_metrics("dppo_seed0", {"steps_completed": 3.0, "reward_mean_last": 0.25, "accuracy": 0.5,
                                           "eval_n": 50.0, "eval_invalid_outputs": 2.0}, completed=True)
    pytestconfig.stash[STATE_KEY].bundle = bundle
"""


@pytest.fixture
def inner(pytester: pytest.Pytester):
    (pytester.path / "plans" / "rehearsal").mkdir(parents=True)
    for name in (
        "exp_e6b0965af3.json",
        "exp_e6b0965af3.json.resolution.json",
        "exp_e6b0965af3-diagnostic-r1.json",
        "rehearsal/comparison-local.json",
        "rehearsal/comparison-local.json.resolution.json",
    ):
        (pytester.path / "plans" / name).write_bytes((REPO / "plans" / name).read_bytes())
    pytester.makeconftest('pytest_plugins = ["dppo_harness.pytest_plugin.hooks"]')
    pytester.makeini("[pytest]\ntestpaths = tests\naddopts = --strict-markers -p no:cacheprovider\n")
    (pytester.path / "tests" / "unit").mkdir(parents=True)
    (pytester.path / "tests" / "unit" / "test_u.py").write_text(INNER)
    (pytester.path / "tests" / "preflight").mkdir(parents=True)
    (pytester.path / "tests" / "preflight" / "test_p.py").write_text(
        "def test_restore():\n    assert 1 == 2, 'no restore'\n"
    )
    return pytester


def test_the_session_ends_with_the_summary_block(inner):
    res = inner.runpytest("-m", "preflight")
    out = res.stdout.str()
    assert TITLE in out, out
    block = out[out.index(TITLE) :]
    assert "status failed" in block and "stopped at stage 'preflight': tests/preflight/test_p.py::test_restore" in block
    assert "no restore" in block and "evidence: " in block
    assert "  dppo_seed0: 3 steps (completed), final reward 0.25, accuracy 0.5 (n=50, 2 invalid)" in block
    # the block comes before pytest's own final line
    assert out.rindex(TITLE) < out.rindex(" in ")


def test_no_block_without_an_evidence_bundle(inner):
    (inner.path / "tests" / "unit" / "test_u.py").write_text("def test_parity():\n    assert True\n")
    assert TITLE not in inner.runpytest().stdout.str()

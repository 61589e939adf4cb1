"""Stage `diagnostic`: the requester's bounded diagnostic, then its evidence checked offline.

The run itself happens once, in the session fixture `diagnostic_run` (dppo_harness.pytest_plugin.fixtures).
"""

import subprocess
import sys

from dppo_harness.instrument.instrumentation import ANALYSIS_FILE
from dppo_harness.stages.diagnostic.classification import CAUSES
from dppo_harness.stages.diagnostic.config import max_wall_seconds
from dppo_harness.stages.diagnostic.write import NEXT_ACTION_FILE, REFERENCES_FILE


def _cli(module: str, path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *(["verify"] if module.endswith("evidence") else []), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_diagnostic_ran_as_planned_within_its_caps(diagnostic_run):
    run = diagnostic_run
    assert not run.state.errors, run.state.errors
    assert run.state.frozen.sha256, "no frozen batch: the diagnostic never sampled"
    assert 1 <= run.state.updates_done <= run.plan.schedule.max_optimizer_updates
    assert run.state.wall_seconds <= max_wall_seconds(run.plan), f"{run.state.wall_seconds:.0f}s > cap"
    assert [r.context["update_index"] for r in run.state.records] == list(range(1, run.state.updates_done + 1))
    assert all(r.context["frozen_batch_sha256"] == run.state.frozen.sha256 for r in run.state.records)
    assert run.selftest["passed"], run.selftest


def test_conclusion_is_classified_and_not_a_defect(diagnostic_run, evidence_bundle):
    c = diagnostic_run.classification
    assert c.active or c.cause in CAUSES
    assert c.cause != "code_or_instrumentation_defect", c.explanation
    assert not c.integrity_problems, c.integrity_problems
    result = evidence_bundle.result
    assert result["original_hypothesis_tested"] is False and result["tested_instead"]
    assert result["metrics"]["diagnostic/updates_done"] == diagnostic_run.state.updates_done
    for name in (ANALYSIS_FILE, REFERENCES_FILE, NEXT_ACTION_FILE, "report.md"):
        assert evidence_bundle.entry(name), f"{name} not registered"


def test_evidence_verify_and_offline_replay_pass(diagnostic_run, evidence_bundle):
    verify = _cli("dppo_harness.evidence", evidence_bundle.dir)
    # mid-session the hashes hold but the result is not final yet (it is written at session end)
    running = evidence_bundle.result["status"] == "running"
    assert verify.returncode == (3 if running else 0), verify.stdout + verify.stderr
    assert ("verify: INCOMPLETE" if running else "verify: OK") in verify.stdout
    replay = _cli("dppo_harness.instrument.replay", evidence_bundle.dir)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert f"{diagnostic_run.state.updates_done} loss calls" in replay.stdout


def test_the_diagnostic_trained_the_preflights_client(diagnostic_run, client_registry, evidence_bundle):
    """No third DPPO client: no training client is created in the diagnostic stage."""
    assert client_registry.training_clients_by_stage().get("diagnostic", 0) == 0
    assert diagnostic_run.state.restore.get("source", "").startswith("the restoration preflight's client")
    entry = evidence_bundle.result["initialization_provenance"]["arms"]["dppo_seed0"]
    assert entry["restore_count"] == 1 and [c["after_restore"] for c in entry["optimizer_checks"]] == [0, 1]


def test_truncation_and_declarations_are_recorded_and_reported(diagnostic_run, evidence_bundle):
    """The frozen batch's truncation at max_tokens and answer yield are measured and stated in the
    report next to the declared renderer (thinking mode) and loss normalization."""
    import json

    analysis = json.loads(evidence_bundle.file_path(ANALYSIS_FILE).read_text())
    y = analysis["rollout_yield"]
    config = analysis["config"]
    assert y["n"] == config["groups_per_batch"] * config["group_size"]
    assert y["max_tokens"] == config["max_tokens"] and 0 <= y["truncated"] <= y["n"]
    metrics = evidence_bundle.result["metrics"]
    assert metrics["diagnostic/rollout_truncated_frac"] == y["truncated_frac"]
    eff = json.loads(evidence_bundle.file_path("effective-config.json").read_text())
    assert eff["renderer"]["thinking"] in ("enabled", "disabled") and eff["loss_normalization"]["mode"] == "token_mean"
    text = evidence_bundle.file_path("report.md").read_text()
    assert f"- renderer `{eff['renderer']['name']}`, thinking {eff['renderer']['thinking']}" in text
    assert f"frozen batch rollouts: {y['truncated']} of {y['n']} responses" in text
    assert "- loss normalization `token_mean`" in text

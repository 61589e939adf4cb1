"""Stage `comparison`: the paired comparison run as the executed plan says (on the local backend
the declared rehearsal plan), then its evidence checked offline.

The run itself happens once, in the session fixture `comparison_run` (dppo_harness.fixtures_stages).
"""

import json
import subprocess
import sys

from dppo_harness import comparison_eval as E
from dppo_harness import losses, stats


def test_both_arms_ran_every_step_with_recorded_metrics(comparison_run, evidence_bundle):
    run = comparison_run
    assert run.stopped is None and run.capacity_block is None, run.stopped
    cfg = run.config
    assert run.steps_completed == cfg.steps
    for a in cfg.arms:
        steps = [r["step"] for r in run.rows if r["arm"] == a.name]
        assert steps == list(range(cfg.steps)), (a.name, steps)
        assert all(r["updates"] == a.updates_per_batch for r in run.rows if r["arm"] == a.name)
    result = evidence_bundle.result
    assert sorted(result["completed_arms"]) == sorted(a.name for a in cfg.arms)
    assert set(result["metrics"]["arms"]) == {a.name for a in cfg.arms}
    uris = {c["arm"] for c in result["evidence"]["checkpoints"]}
    assert {a.name for a in cfg.arms} <= uris


def test_treatment_mask_fires_in_the_comparison(comparison_run):
    """Each DPPO treatment arm's mask removes tokens during training (the rehearsal lr is chosen so it
    does); the baseline's masked fraction is the same rule counted counterfactually on its own tensors."""
    cfg = comparison_run.config
    for t in cfg.treatments:
        if t.loss == losses.DPPO_LOSS:
            assert sum(r["dppo_masked_frac"] for r in comparison_run.rows if r["arm"] == t.name) > 0, t.name
    assert all(r["loss_tokens"] > 0 for r in comparison_run.rows)


def test_predictions_observations_and_decision_are_consistent(comparison_run, evidence_bundle, plan):
    run = comparison_run
    n = run.config.eval_items
    scored = {s["arm"] for s in run.scores}
    assert scored == {E.BASE_ARM} | {a.name for a in run.config.arms}
    for s in run.scores:
        rows = [json.loads(x) for x in evidence_bundle.file_path(s["predictions_ref"]).read_text().splitlines()]
        assert len(rows) == n and all({"item_id", "arm", "prediction", "reference"} <= set(r) for r in rows)
    obs_path = evidence_bundle.file_path(E.OBSERVATIONS_FILE)
    obs = stats.read_observations(obs_path)
    assert len(obs) == n * len(run.config.arms)
    decision = evidence_bundle.result["decision"]
    assert decision["version"] == 1 and decision["observations_file"]["name"] == E.OBSERVATIONS_FILE
    assert decision["observations_file"]["sha256"] == evidence_bundle.entry(E.OBSERVATIONS_FILE)["sha256"]
    # Recomputing the Hoeffding CI from the retained file reproduces the reported one.
    again = E.recompute_from_file(obs_path, run.config.criteria, alpha=run.config.alpha)
    for reported, recomputed in zip(decision["criteria"], again, strict=True):
        assert (reported["lower"], reported["upper"]) == (recomputed["lower"], recomputed["upper"])
    if plan.kind == "rehearsal":
        assert run.final["verdict"] == "inconclusive" and decision["rehearsal"] is True


def test_evidence_verify_passes(comparison_run, evidence_bundle):
    out = subprocess.run([sys.executable, "-m", "dppo_harness.evidence", "verify", str(evidence_bundle.dir)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert evidence_bundle.entry("report.md") is not None


def test_summary_is_two_plain_sentences_naming_the_served_model(comparison_run, evidence_bundle):
    """The brief's output shape: at most 2 sentences; a rehearsal names the stand-in that computed."""
    from dppo_harness.conclusion import count_sentences

    summary = comparison_run.final["summary"]
    assert count_sentences(summary) <= 2, summary
    served = evidence_bundle.result["backend"]["served_model"]
    if evidence_bundle.result["backend"]["kind"] == "local":
        assert served in summary and "rehearsal" in summary

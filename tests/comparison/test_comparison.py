"""Stage `comparison`: the paired comparison run as the executed plan says (on the local backend
the declared rehearsal plan), then its evidence checked offline.

The run itself happens once, in the session fixture `comparison_run` (dppo_harness.pytest_plugin.fixtures).
"""

import json
import subprocess
import sys

import pytest

from dppo_harness.evaluation import stats
from dppo_harness.loss import loss_registry
from dppo_harness.stages.comparison.decision import decide_criteria
from dppo_harness.stages.comparison.evaluate import BASE_ARM
from dppo_harness.stages.comparison.step_rows import fraction_names
from dppo_harness.stages.write import OBSERVATIONS_FILE


def _session_index(evidence_bundle) -> int:
    """Which session of the run this bundle is: 0, or N after N resumes (its files carry N)."""
    runs = [
        int(e["name"].removeprefix("comparison-run-").removesuffix(".json"))
        for e in evidence_bundle.files()
        if e["name"].startswith("comparison-run-") and e["name"].endswith(".json")
    ]
    assert runs, "no comparison-run-N.json registered"
    return max(runs)


def test_both_arms_ran_every_step_with_recorded_metrics(comparison_run, evidence_bundle, plan):
    run = comparison_run
    assert run.stopped is None and run.capacity_block is None, run.stopped
    cfg = plan.run
    assert run.steps_completed == cfg.rollout_steps
    for a in cfg.arms:
        steps = [r["step"] for r in run.rows if r["arm"] == a.name]
        assert steps == list(range(cfg.rollout_steps)), (a.name, steps)
        assert all(r["updates"] == a.updates_per_batch for r in run.rows if r["arm"] == a.name)
    result = evidence_bundle.result
    assert sorted(result["completed_arms"]) == sorted(a.name for a in cfg.arms)
    # the trained arms, and the base model under its own key (scored, never trained or completed)
    assert set(result["metrics"]["arms"]) == {a.name for a in cfg.arms} | {BASE_ARM}
    uris = {c["arm"] for c in result["evidence"]["checkpoints"]}
    assert {a.name for a in cfg.arms} <= uris


def test_treatment_mask_fires_in_the_comparison(comparison_run, evidence_bundle, plan):
    """Each DPPO treatment arm's mask removes tokens during training (the rehearsal lr is chosen so it
    does). A rule an arm's registered loss does not train with is counted counterfactually on the
    arm's own tensors, and says so in its name (rows and metrics.arms): for the spec's pair, the
    GRPO arm's DPPO mask and the DPPO arm's PPO clip."""
    cfg = plan.run
    for t in cfg.treatments:
        if t.loss == loss_registry.DPPO_LOSS:
            assert sum(r["dppo_masked_frac"] for r in comparison_run.rows if r["arm"] == t.name) > 0, t.name
    assert all(r["loss_tokens"] > 0 for r in comparison_run.rows)
    arms = evidence_bundle.result["metrics"]["arms"]
    for a in cfg.arms:
        names = fraction_names(a.loss)
        for r in (r for r in comparison_run.rows if r["arm"] == a.name):
            for base, key in names.items():
                other = base if key != base else f"counterfactual_{base}"
                assert key in r and other not in r, (a.name, key)
        for base in ("dppo_masked_frac", "ppo_clip_frac"):
            assert f"{names[base]}_mean" in arms[a.name], (a.name, names[base])
    own = {
        a.loss: {k for k in fraction_names(a.loss).values() if not k.startswith("counterfactual_")} for a in cfg.arms
    }
    assert own.get(loss_registry.GRPO_LOSS, {"ppo_clip_frac", "last_update_clip_frac"}) == {
        "ppo_clip_frac",
        "last_update_clip_frac",
    }
    assert own.get(loss_registry.DPPO_LOSS, {"dppo_masked_frac", "last_update_masked_frac"}) == {
        "dppo_masked_frac",
        "last_update_masked_frac",
    }


def test_every_scored_model_has_accuracy_n_and_invalid_outputs_under_its_own_key(comparison_run, evidence_bundle, plan):
    result = evidence_bundle.result
    for s in result["evaluation"]["scores"]:
        for where in (result["metrics"]["arms"], result["evidence"]["per_arm_metrics"]):
            m = where[s["arm"]]
            assert m["accuracy"] == s["value"] and m["eval_n"] == plan.run.eval_items
            assert 0 <= m["eval_invalid_outputs"] <= m["eval_n"]
            assert 0 <= m["eval_truncated_frac"] <= 1 and m["eval_mean_response_tokens"] > 0
        assert result["metrics"][f"eval/accuracy/{s['arm']}"] == s["value"]  # the earlier key stays


def test_rows_carry_truncation_kl_and_entropy(comparison_run):
    for r in comparison_run.rows:
        assert 0 <= r["truncated_frac"] <= 1 and 0 <= r["no_answer_frac"] <= 1 and r["mean_response_tokens"] > 0
        assert r["entropy"] > 0 and "kl_sample_train_v1" in r and r["kl_sample_train_v2"] >= 0
        assert r["cookbook_env"]["env/all/reward/total"] == pytest.approx(r["reward_mean"])


def test_report_shows_the_truncation_plot_and_the_informational_interval(comparison_run, evidence_bundle, plan):
    text = evidence_bundle.file_path("report.md").read_text()
    assert "![truncation and answer yield](comparison-truncation-and-answer-yield.png)" in text
    assert evidence_bundle.entry("comparison-truncation-and-answer-yield.png")["kind"] == "plot"
    assert "### Informational paired interval (not the decision rule)" in text and "discordant pairs" in text
    info = evidence_bundle.result["decision"]["informational"]
    assert info["used_for_verdict"] is False and info["n"] == plan.run.eval_items
    assert info["treatment_only_correct"] + info["baseline_only_correct"] == info["discordant_pairs"]
    metrics = evidence_bundle.result["metrics"]
    assert metrics["comparison/informational_newcombe_lower"] == info["lower"]


def test_predictions_observations_and_decision_are_consistent(comparison_run, evidence_bundle, plan):
    run = comparison_run
    n = plan.run.eval_items
    scores = evidence_bundle.result["evaluation"]["scores"]
    assert {s["arm"] for s in scores} == {BASE_ARM} | {a.name for a in plan.run.arms}
    for s in scores:
        rows = [json.loads(x) for x in evidence_bundle.file_path(s["predictions_ref"]).read_text().splitlines()]
        assert len(rows) == n and all({"item_id", "arm", "prediction", "reference"} <= set(r) for r in rows)
    obs_path = evidence_bundle.file_path(OBSERVATIONS_FILE)
    obs = stats.read_observations(obs_path)
    assert len(obs) == n * len(plan.run.arms)
    decision = evidence_bundle.result["decision"]
    assert decision["version"] == 1 and decision["observations_file"]["name"] == OBSERVATIONS_FILE
    assert decision["observations_file"]["sha256"] == evidence_bundle.entry(OBSERVATIONS_FILE)["sha256"]
    # Recomputing the Hoeffding CI from the retained file reproduces the reported one.
    again = decide_criteria(obs, plan.run.criteria, alpha=plan.run.alpha)
    for reported, recomputed in zip(decision["criteria"], again, strict=True):
        assert (reported["lower"], reported["upper"]) == (recomputed.lower, recomputed.upper)
    if plan.kind == "rehearsal":
        assert run.final["verdict"] == "inconclusive" and decision["rehearsal"] is True


def test_evidence_verify_passes(comparison_run, evidence_bundle):
    out = subprocess.run(
        [sys.executable, "-m", "dppo_harness.evidence", "verify", str(evidence_bundle.dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    running = evidence_bundle.result["status"] == "running"  # final only once the stage posted it
    assert out.returncode == (3 if running else 0), out.stdout + out.stderr
    assert evidence_bundle.entry("report.md") is not None


def test_summary_is_two_plain_sentences_naming_the_served_model(comparison_run, evidence_bundle):
    """The brief's output shape: at most 2 sentences; a rehearsal names the stand-in that computed."""
    from summary_sentences import count_sentences

    summary = comparison_run.final["summary"]
    assert count_sentences(summary) <= 2, summary
    served = evidence_bundle.result["backend"]["served_model"]
    if evidence_bundle.result["backend"]["kind"] == "local":
        assert served in summary and "rehearsal" in summary


def test_the_schedule_and_its_source_are_recorded(comparison_run, evidence_bundle, harness_options):
    """Arm after arm unless asked, on any service: the schedule the feasibility pilot timed."""
    n = _session_index(evidence_bundle)
    manifest = json.loads(evidence_bundle.file_path(f"comparison-run-{n}.json").read_text())
    assert manifest["schedule"] == comparison_run.schedule
    if harness_options.comparison_schedule is None:
        assert comparison_run.schedule == "interleaved"
        assert (
            manifest["schedule_source"].startswith("default on")
            and "feasibility pilot timed" in (manifest["schedule_source"])
        )
    state = json.loads(evidence_bundle.file_path(f"comparison-state-r{n}-end.json").read_text())
    guard = state["training"]["wall_guard"]
    # one measured step time per step this session trained (a resumed session starts mid-run)
    assert guard["step_seconds"] and len(guard["step_seconds"]) <= comparison_run.steps_completed
    assert n > 0 or len(guard["step_seconds"]) == comparison_run.steps_completed


def test_gate_and_feasibility_clients_were_closed_before_the_arms_trained(
    comparison_run, client_registry, harness_options
):
    sessions = {r["stage"]: r for r in client_registry.records()}
    if harness_options.resume:  # the setup stages ran in the session this one continues, not here
        assert not {"preflight-probes", "feasibility-pilot", "gate-pilot"} & set(sessions), sorted(sessions)
        return
    for stage in ("preflight-probes", "feasibility-pilot", "gate-pilot"):
        assert sessions[stage]["released"], stage
    assert not sessions["session"]["released"]  # the arms' session stays open until the session ends
    closed_in = {label: ev["stage"] for ev in client_registry.events for label in ev["closed"]}
    assert closed_in[sessions["gate-pilot"]["label"]] == "gate"  # closed in its own stage, before the arms
    assert closed_in[sessions["preflight-probes"]["label"]] == "preflight"
    # The comparison creates a training client only to restore an arm for a retried step.
    retries = sum(r.get("retries", 0) for r in comparison_run.rows)
    assert client_registry.training_clients_by_stage().get("comparison", 0) <= retries

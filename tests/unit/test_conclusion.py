"""The diagnostic's answer to the question asked: the summary is <= 2 plain sentences naming the
stand-in, and a stand-in's inactive mask is missing evidence for the planned model, next action =
same plan on the service."""

from pathlib import Path

import pytest
from diagnostic_rehearsal import simulate_records
from summary_sentences import count_sentences

from dppo_harness.evidence.backend import ServedModel
from dppo_harness.plans import load_plan
from dppo_harness.stages.diagnostic.classification import deterministic_selftest
from dppo_harness.stages.diagnostic.loop import RunState
from dppo_harness.stages.diagnostic.write import analyse

PLANS = Path(__file__).parents[2] / "plans"
PLAN = load_plan(PLANS / "exp_e6b0965af3-diagnostic-r1.json")
STAND_IN = ServedModel("Qwen/Qwen3.5-2B", "local/tiny-qwen3-gsm8k")
REAL = ServedModel("Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-2B")


def _result(served, drift=0.0):
    records = simulate_records(seed=1, drift_per_update=drift)
    state = RunState(records=records, updates_done=len(records), setup_seconds=40.0, wall_seconds=579.4)
    return analyse(PLAN, state, deterministic_selftest(), {}, served=served)


def test_count_sentences():
    assert count_sentences("One. Two.") == 2
    assert count_sentences("Drift q90 0.0006 on local/tiny-qwen3.5 stayed low. Next: rerun") == 2
    assert count_sentences("A. B. C. D. E. F.") == 6


def test_stand_in_inactive_is_missing_evidence_and_next_action_is_rerun_unchanged():
    res = _result(STAND_IN)
    c = res.classification
    assert c.state == "inactive" and c.measured_cause == "legitimate_inactive_regime"  # measured state kept
    assert c.cause == "missing_evidence" and c.stand_in
    assert "stand-in only" in c.explanation
    a = res.next_action
    assert a["cause"] == "missing_evidence" and a["plan_changes"] == [] and not a["executed"]
    assert "unchanged on the real service" in a["action"]
    assert "more epochs" not in a["action"].split("more epochs become")[0]


def test_real_model_inactive_keeps_legitimate_regime_and_more_epochs():
    res = _result(REAL)
    assert res.classification.cause == "legitimate_inactive_regime"
    assert "more epochs" in res.next_action["action"]


def test_code_defect_on_a_stand_in_stays_a_defect():
    records = simulate_records(seed=1, drift_per_update=0.0)  # on-policy: inactive at any delta
    state = RunState(records=records, updates_done=len(records))
    selftest = deterministic_selftest()
    selftest["passed"] = False
    c = analyse(PLAN, state, selftest, {}, served=STAND_IN).classification
    assert c.cause == c.measured_cause == "code_or_instrumentation_defect"
    active = _result(STAND_IN, drift=0.012).classification
    assert active.active and active.measured_cause is None and active.cause == "missing_evidence"


@pytest.mark.parametrize("served", [STAND_IN, REAL], ids=["stand-in", "real"])
def test_summary_is_at_most_two_plain_sentences_and_names_the_stand_in(served):
    s = _result(served).result_fields["summary"]
    assert count_sentences(s) <= 2, s
    assert len(s) < 500, len(s)
    if served.rehearsal:
        assert "local/tiny-qwen3-gsm8k" in s and "missing_evidence" in s
    else:
        assert "stand-in" not in s


def test_report_labels_the_cause_and_the_stand_in_limitation_on_any_backend():
    from dppo_harness.evidence import report

    res = _result(STAND_IN)
    a = res.analysis_json()
    text = report.render_markdown(a, {}, "tinker", res.next_action)  # bundle B: tinker backend, stand-in served
    assert "verified: a stand-in served" in text and "suspected" in text
    assert "Stand-in model `local/tiny-qwen3-gsm8k`" in text
    assert "unchanged on the real service" in text

"""report.md and its PNG plots, rendered from the diagnostic's analysis and registered as evidence."""

from pathlib import Path

import numpy as np
import pytest
from diagnostic_rehearsal import simulate_records

from dppo_harness.evidence import EvidenceBundle, report, verify_bundle
from dppo_harness.evidence.backend import ServedModel
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.plans import load_plan
from dppo_harness.stages.diagnostic.classification import deterministic_selftest
from dppo_harness.stages.diagnostic.loop import RunState
from dppo_harness.stages.diagnostic.write import analyse

PLAN = load_plan(Path(__file__).parents[2] / "plans" / "exp_e6b0965af3-diagnostic-r1.json")


def _sentinel_points(drift: float):
    rng = np.random.default_rng(0)
    q = rng.uniform(0.05, 0.95, 40)
    adv = np.where(np.arange(40) % 2, 0.5, -0.5)
    points = []
    for u in (0, 1, 2, 4, 8, 16):
        p = np.clip(q + 0.01 + drift * u * np.sign(adv), 1e-6, 1)
        p0 = np.clip(q + 0.01, 1e-6, 1)
        points.append(
            {"after_update": u, "summary": ins.sentinel_summary(np.log(p), np.log(q), np.log(p0), np.ones(40), adv)}
        )
    return points


def _analysis(drift: float):
    records = simulate_records(seed=5, drift_per_update=drift)
    points = _sentinel_points(drift / 4)
    sentinels = {
        "tokens": 40,
        "sequence_indices": [0, 1],
        "selection_rule": "test",
        "points": points,
        "at_init": points[0]["summary"],
        "last": points[-1],
    }
    state = RunState(records=records, updates_done=16, setup_seconds=20.0, wall_seconds=100.0)
    res = analyse(PLAN, state, deterministic_selftest(), sentinels, ServedModel(PLAN.planned_model, PLAN.planned_model))
    return res.analysis_json(), res.next_action


@pytest.mark.parametrize("drift,fired", [(0.012, True), (0.0, False)])
def test_report_and_plots_are_registered_and_say_whether_the_mask_fired(tmp_path, drift, fired):
    analysis, action = _analysis(drift)
    bundle = EvidenceBundle.create(tmp_path)
    names = report.write_report(bundle, analysis, "local", action)
    assert set(names) == {"drift_tails", "histograms", "fractions", "sentinels", "report"}
    for key in ("drift_tails", "histograms", "fractions", "sentinels"):
        assert bundle.file_path(names[key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert bundle.entry(names[key])["kind"] == "plot"
    text = bundle.file_path("report.md").read_text()
    assert f"Did the DPPO mask fire? {'YES' if fired else 'NO'}." in text
    assert analysis["classification"]["explanation"] in text
    assert text.count("| ") > 20 and "![Sentinel drift](diagnostic-sentinel-drift.png)" in text
    if not fired:
        assert (
            "legitimate_inactive_regime" in text
            and f"vs +delta {PLAN.diagnostic.fixed_settings.treatment.delta}" in text
        )
    assert verify_bundle(bundle.dir) == []


def test_report_without_data_says_so(tmp_path):
    analysis, action = _analysis(0.0)
    analysis.update(per_update=[], pooled_second_epoch=None, sentinels={})
    text = report.render_markdown(analysis, report.make_plots(analysis), "tinker", action)
    assert "Drift tails per update: not available" in text and "stand-in" not in text

"""Must fire / must not fire on the real engine (embedded server, stock SDK, small plans).

A deliberately high learning rate, two epochs over one frozen batch: the DPPO mask must remove
nonzero-advantage gradients on BOTH advantage signs. A zero learning rate: the mask must stay
silent, and the diagnostic must call that an inactive regime, not a defect.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tinker
from sdk_session import end_session

from dppo_harness import constants
from dppo_harness.evidence import EvidenceBundle, verify_bundle
from dppo_harness.instrument import replay
from dppo_harness.instrument.instrumentation import ANALYSIS_FILE
from dppo_harness.plans import Plan, load_plan
from dppo_harness.stages.diagnostic.loop import run_bounded_diagnostic

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = Path(__file__).parents[1] / "fixtures" / "plans" / "diagnostic-ci-tiny.json"


def small_plan(tmp_path: Path, learning_rate: float, max_wall_minutes: float = 12.0) -> Plan:
    """The tiny CI plan grown to 8 groups x 4 in one minibatch of all 8 complete groups, 64 tokens:
    2 epochs = 2 updates, the second-epoch loss call sees the policy after one update."""
    d = json.loads(TINY.read_text())
    d["schedule"].update(groups_per_batch=8, groups_per_minibatch=8)
    d["fixed_settings"]["sampling"]["max_tokens"] = 64
    d["fixed_settings"]["optimizer"]["learning_rate"] = learning_rate
    d["caps"]["max_wall_minutes"] = max_wall_minutes
    path = tmp_path / "diagnostic-must-fire.json"
    path.write_text(json.dumps(d))
    return load_plan(path)


HIGH_LR = 1e-2  # 500x the plan's 2e-5: deliberately far off-policy after one update


@pytest.fixture(scope="module")
def engine(shared_server):
    sc = tinker.ServiceClient(base_url=shared_server.base_url, api_key=constants.LOCAL_API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=32, seed=0)
        init = tc.save_state("must-fire-initial").result().path
        yield sc, init
    finally:
        end_session(sc)


def _run(engine, tmp_path, lr):
    sc, init = engine
    bundle = EvidenceBundle.create(tmp_path / "evidence")
    res = run_bounded_diagnostic(sc, small_plan(tmp_path, lr), bundle, init, backend="local")
    assert not res.state.errors, res.state.errors
    assert res.state.updates_done == 2
    # Sentinel forwards after updates 1 and 2 are deferred (issue 10 section 5); all are collected.
    assert [pt["after_update"] for pt in res.sentinels["points"]] == [0, 1, 2]
    assert verify_bundle(bundle.dir) == []
    rep = replay.replay_bundle(bundle.dir)
    assert rep.ok, rep.problems
    return res


def test_high_lr_fires_on_both_sides_with_removed_gradients(engine, tmp_path):
    res = _run(engine, tmp_path, HIGH_LR)
    p = res.pooled
    assert p["tokens/pos_adv"] > 0 and p["tokens/neg_adv"] > 0, "the small batch has no advantage signal"
    assert p["dppo/removed_pos_adv"] > 0 and p["dppo/removed_neg_adv"] > 0, p
    assert p["dppo/exceed_pos_on_pos_adv"] == p["dppo/removed_pos_adv"]
    assert p["dppo/exceed_neg_on_neg_adv"] == p["dppo/removed_neg_adv"]
    assert res.classification.mask_fired and not res.classification.integrity_problems


def test_zero_lr_stays_silent_and_is_an_inactive_regime(engine, tmp_path):
    res = _run(engine, tmp_path, 0.0)
    assert all(r.stats["dppo/removed"] == 0 for r in res.state.records)
    assert res.pooled["tokens/nonzero_adv"] > 0  # silent with signal present, not for lack of it
    c = res.classification
    # Measured on the stand-in: the state is kept, but for the planned model it is missing evidence
    # (issue 11 point 2); the next action is the same plan, unchanged, on the real service.
    assert c.state == "inactive" and c.measured_cause == "legitimate_inactive_regime", c.explanation
    assert c.cause == "missing_evidence" and c.stand_in
    assert "unchanged on the real service" in res.next_action["action"]


def test_wall_cap_exhausted_in_setup_persists_evidence_and_stops(engine, tmp_path):
    sc, init = engine
    bundle = EvidenceBundle.create(tmp_path / "evidence")
    plan = small_plan(tmp_path, 2e-5, max_wall_minutes=0.5 / 60)
    res = run_bounded_diagnostic(sc, plan, bundle, init, backend="local")
    assert res.state.updates_done == 0 and "wall cap" in res.state.stop_reason
    assert res.classification.cause == "missing_evidence"
    assert bundle.entry(ANALYSIS_FILE) and bundle.entry("report.md")
    assert verify_bundle(bundle.dir) == []

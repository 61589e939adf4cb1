"""Paired Hoeffding numbers, verdict rule and the CLI's refusals."""

import json
import math
import subprocess
import sys

import pytest

from dppo_harness.evaluation import stats


def test_half_width_matches_hand_computation():
    # (b-a) * sqrt(ln(2/alpha) / (2n)) with range 2, n=1319, alpha=0.05
    hand = 2 * math.sqrt(math.log(40) / 2638)
    assert stats.hoeffding_half_width(1319, 0.05, 2.0) == pytest.approx(hand, rel=1e-15)
    assert round(hand, 4) == 0.0748
    assert stats.hoeffding_half_width(100, 0.1, 2.0) == pytest.approx(2 * math.sqrt(math.log(20) / 200))


def test_interval_and_verdicts_on_known_scores():
    n = 1319
    # treatment right on 1000 items, baseline on 800, all baseline-right items also treatment-right
    t = [1] * 1000 + [0] * 319
    b = [1] * 800 + [0] * 519
    r = stats.paired_hoeffding(t, b)
    hw = 2 * math.sqrt(math.log(40) / (2 * n))
    assert r["n"] == n and r["mean_treatment"] == 1000 / n and r["mean_baseline"] == 800 / n
    assert r["mean_difference"] == pytest.approx(200 / n)
    assert r["lower"] == pytest.approx(200 / n - hw) and r["upper"] == pytest.approx(200 / n + hw)
    assert r["verdict"] == "supported" and r["outcome_reason"] == "supported"  # 0.1516 - 0.0748 > 0
    # a 5-point gap is positive but smaller than the half-width: inconclusive, not validated
    small = stats.paired_hoeffding([1] * 66 + [0] * 1253, [0] * n)
    assert small["mean_difference"] > 0 and small["verdict"] == "inconclusive"
    assert small["outcome_reason"] == "insufficient_evidence" and "contains the margin" in small["reason"]
    worse = stats.paired_hoeffding(b, t)
    assert worse["verdict"] == "refuted"
    # the margin moves the decision
    assert stats.paired_hoeffding(t, b, margin=0.1)["verdict"] == "inconclusive"


def test_decide_boundaries():
    assert stats.decide(0.0, 0.2, 0.0)[0] == "inconclusive"  # touching the margin does not settle it
    assert stats.decide(1e-9, 0.2, 0.0)[0] == "supported"
    assert stats.decide(-0.2, -1e-9, 0.0)[0] == "refuted"


def _rows(arm, values, evaluator="e" * 64, seed=0, start=0):
    return [
        {
            "item_id": f"gsm8k-test-{i + start:04d}",
            "arm": arm,
            "seed": seed,
            "metric": "accuracy",
            "value": v,
            "evaluator_id": evaluator,
        }
        for i, v in enumerate(values)
    ]


def test_pairing_refusals():
    ok = _rows("dppo", [1, 0, 1]) + _rows("grpo", [0, 0, 1]) + _rows("base", [0, 0, 0])
    res = stats.paired_hoeffding_from_rows(ok, "dppo", "grpo")
    assert res["n"] == 3 and res["mean_difference"] == pytest.approx(1 / 3) and res["seeds"] == [0]
    with pytest.raises(stats.ObservationError, match="unpaired items: 1 only in 'dppo'"):
        stats.paired_hoeffding_from_rows(_rows("dppo", [1, 0, 1]) + _rows("grpo", [0, 0]), "dppo", "grpo")
    with pytest.raises(stats.ObservationError, match="duplicate observation"):
        stats.paired_hoeffding_from_rows(ok + _rows("grpo", [1]), "dppo", "grpo")
    with pytest.raises(stats.ObservationError, match="outside the bounds"):
        stats.paired_hoeffding_from_rows(_rows("dppo", [1, 2, 1]) + _rows("grpo", [0, 0, 1]), "dppo", "grpo")
    with pytest.raises(stats.ObservationError, match="not a number"):
        stats.paired_hoeffding_from_rows(_rows("dppo", [True, 0, 1]) + _rows("grpo", [0, 0, 1]), "dppo", "grpo")
    with pytest.raises(stats.ObservationError, match="2 evaluators"):
        stats.paired_hoeffding_from_rows(
            _rows("dppo", [1, 0, 1]) + _rows("grpo", [0, 0, 1], evaluator="f" * 64), "dppo", "grpo"
        )
    with pytest.raises(stats.ObservationError, match="no 'accuracy' observations for arm 'ppo'"):
        stats.paired_hoeffding_from_rows(ok, "dppo", "ppo")
    with pytest.raises(stats.ObservationError, match="missing"):
        stats.paired_hoeffding_from_rows([{"arm": "dppo"}], "dppo", "grpo")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dppo_harness.evaluation.stats", *map(str, args)], capture_output=True, text=True
    )


@pytest.mark.integration  # a CLI in a subprocess: the default run, not unit parity
def test_cli_prints_json_and_refuses_bad_files(tmp_path):
    good = tmp_path / "scored-observations.jsonl"
    rows = _rows("dppo", [1] * 1000 + [0] * 319) + _rows("grpo", [1] * 800 + [0] * 519)
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = _cli("paired-hoeffding", good, "--treatment", "dppo", "--baseline", "grpo", "--alpha", "0.05", "--margin", "0")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["n"] == 1319 and out["verdict"] == "supported"
    assert out["half_width"] == pytest.approx(0.07479, abs=1e-5)
    for key in ("mean_treatment", "mean_baseline", "mean_difference", "lower", "upper"):
        assert isinstance(out[key], float)

    cases = {
        "unpaired": (rows[:-1], "unpaired items"),
        "dup": (rows + rows[:1], "duplicate observation"),
        "oob": ([{**rows[0], "value": 1.5}] + rows[1:], "outside the bounds"),
        "nan": (None, "outside the bounds"),
    }
    for name, (bad_rows, message) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        if bad_rows is None:
            text = "".join(json.dumps(r) + "\n" for r in rows).replace('"value": 1,', '"value": NaN,', 1)
            path.write_text(text)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in bad_rows))
        p = _cli("paired-hoeffding", path, "--treatment", "dppo", "--baseline", "grpo")
        assert p.returncode == 2 and message in p.stderr and p.stdout == "", (name, p.stderr)
    p = _cli("paired-hoeffding", tmp_path / "missing.jsonl", "--treatment", "dppo", "--baseline", "grpo")
    assert p.returncode == 2 and "error:" in p.stderr


def test_pair_observations_is_a_record_in_key_order():
    rows = [
        {"item_id": i, "arm": arm, "seed": 0, "metric": "accuracy", "value": v, "evaluator_id": "e" * 64}
        for arm, values in (("dppo", (1, 0)), ("grpo", (0, 0)))
        for i, v in zip(("b", "a"), values)
    ]
    paired = stats.pair_observations(rows, "dppo", "grpo")
    assert paired.keys == [("a", 0), ("b", 0)] and paired.treatment == [0, 1] and paired.baseline == [0, 0]
    assert paired.seeds == [0] and paired.evaluator_id == "e" * 64

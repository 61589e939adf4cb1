"""Pure parts of the paired comparison: config, metrics, resume rules, verdict rules, rehearsal plans."""

import copy
import json
import re
from pathlib import Path

import pytest
from comparison_rows import comparable

from dppo_harness import plans
from dppo_harness.evaluation import stats
from dppo_harness.evidence.provenance import package_files_sha256
from dppo_harness.loss import loss_registry
from dppo_harness.loss.terms import LossStats
from dppo_harness.plans import PlanError, load_plan, parse_plan
from dppo_harness.stages.comparison.config import ComparisonError, step_seed
from dppo_harness.stages.comparison.decision import (
    CriterionDecision,
    decide_criteria,
    decision_block,
    verdict,
)
from dppo_harness.stages.comparison.resume import resume_problems, rewind_to_common_save
from dppo_harness.stages.comparison.state import (
    STATE_FILE,
    ArmState,
    RunState,
    state_path,
)
from dppo_harness.stages.comparison.step_rows import arm_summary, step_line, step_metrics
from dppo_harness.stages.write import OBSERVATIONS_FILE

ROOT = Path(__file__).parents[2]
SPEC = load_plan(ROOT / "plans" / "exp_e6b0965af3.json")
REHEARSAL = load_plan(ROOT / "plans" / "rehearsal" / "comparison-local.json")


def _sizes(run):
    return (run.rollout_steps, run.groups_per_batch, run.group_size, run.max_tokens, run.eval_items)


def test_config_of_the_saved_spec_and_the_rehearsal():
    full = SPEC.run
    assert _sizes(full) == (50, 32, 8, 512, 1319)
    assert [(a.name, a.loss, a.role) for a in full.arms] == [
        ("grpo_seed0", "grpo_clip_eps0.2", "baseline"),
        ("dppo_seed0", "dppo_divergence_mask", "treatment"),
    ]
    assert all(a.adam["learning_rate"] == 2e-5 for a in full.arms) and full.temperature == 1.0
    assert [(c.treatment, c.baseline, c.margin) for c in full.criteria] == [("dppo_seed0", "grpo_seed0", 0.0)]
    small = REHEARSAL.run
    assert small.base_model == "local/tiny-qwen3-gsm8k" and small.arms[0].updates_per_batch == 2
    assert (
        small.rollout_steps * 2 == REHEARSAL.spec["steps"] and small.eval_items == REHEARSAL.spec["eval"]["n_examples"]
    )


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s["arms"][1].update(loss="reinforce"), "^arms\\[1\\].loss: 'reinforce' is not a registered loss"),
        (lambda s: s["arms"][1].update(seed=1), "^arms: seed differs between arms"),
        (lambda s: s["arms"][1].update(lr=1e-3), "^arms\\[1\\].lr: 0.001 != restoration_preflight"),
        (lambda s: s.update(steps=101), "^steps: 101 optimizer steps is not a multiple"),
        (lambda s: s.update(batch_size=128), "^batch_size: 128 != groups_per_batch 32 x group_size 8"),
        (
            lambda s: s["restoration_preflight"]["groups"][0]["arms"][0]["optimizer_config"].update(learning_rate=1.0),
            "^arms\\[0\\].lr: 2e-05 != restoration_preflight optimizer_config.learning_rate 1.0",
        ),
    ],
)
def test_plan_load_refuses_specs_that_break_the_pairing(mutate, match):
    spec = copy.deepcopy(SPEC.raw)
    mutate(spec)
    with pytest.raises(PlanError) as e:
        parse_plan(json.dumps(spec).encode(), SPEC.path)  # read with the saved spec's resolution file
    assert re.match(match, str(e.value).removeprefix(f"{SPEC.path}: ")), str(e.value)


def test_same_seeds_for_both_arms_distinct_across_steps():
    run = SPEC.run
    seeds = [step_seed(run, s) for s in range(run.rollout_steps)]
    assert len(set(seeds)) == run.rollout_steps and seeds[1] - seeds[0] == run.groups_per_batch


class _Rec:
    def __init__(self, **stats):
        # every decision's counts, 0 unless given
        self.stats = LossStats.from_row(dict.fromkeys(LossStats.scalar_names(), 0) | stats)


SUMMARY = {
    "mean_reward": 0.5,
    "frac_format": 0.75,
    "frac_correct": 0.25,
    "response_tokens": 400,
    "frac_truncated": 0.125,
    "frac_no_answer": 0.25,
    "mean_response_tokens": 50.0,
    "n_sequences": 8,
    "config": {"max_tokens": 64},
}


def _recs():
    return [
        _Rec(
            **{
                "tokens/loss": 100,
                "dppo/removed": 10,
                "ppo/clipped": 0,
                "dppo/masked_frac_loss_tokens": 0.1,
                "ppo/clip_frac_loss_tokens": 0.0,
                "drift/abs_p90": 0.01,
            }
        ),
        _Rec(
            **{
                "tokens/loss": 300,
                "dppo/removed": 0,
                "ppo/clipped": 3,
                "dppo/masked_frac_loss_tokens": 0.0,
                "ppo/clip_frac_loss_tokens": 0.01,
                "drift/abs_p90": 0.02,
            }
        ),
    ]


def test_step_metrics_pool_fractions_by_loss_tokens():
    row = step_metrics(
        "a",
        3,
        SUMMARY,
        _recs(),
        loss=loss_registry.DPPO_LOSS,
        seconds=2.0,
        sample_seconds=1.0,
        sampler_checkpoint="tinker://x",
        kl={"optim/kl_sample_train_v1": 0.01, "optim/entropy": 0.5},
    )
    assert row["dppo_masked_frac"] == pytest.approx(10 / 400)
    assert row["counterfactual_ppo_clip_frac"] == pytest.approx(3 / 400)
    assert row["drift_abs_p90"] == 0.02 and row["updates"] == 2 and row["loss_tokens"] == 400
    assert (row["truncated_frac"], row["no_answer_frac"], row["mean_response_tokens"]) == (0.125, 0.25, 50.0)
    assert (row["kl_sample_train_v1"], row["entropy"]) == (0.01, 0.5) and "kl_sample_train_v2" not in row
    assert "seconds" not in comparable(row) and comparable(row)["reward_mean"] == 0.5
    s = arm_summary([row, {**row, "step": 4, "reward_mean": 1.0}])
    assert s["steps_completed"] == 2.0 and s["reward_mean_over_steps"] == 0.75
    assert s["truncated_frac_last"] == 0.125 and s["entropy_last"] == 0.5
    assert all(isinstance(v, float) for v in s.values())


@pytest.mark.parametrize(
    "loss, real, counterfactual",
    [
        (loss_registry.GRPO_LOSS, "ppo_clip_frac", "dppo_masked_frac"),
        (loss_registry.DPPO_LOSS, "dppo_masked_frac", "ppo_clip_frac"),
    ],
)
def test_the_rule_an_arm_does_not_train_with_is_labelled_counterfactual(loss, real, counterfactual):
    """A GRPO arm's DPPO masked fraction (and a DPPO arm's PPO clip fraction) is counted on the arm's
    own tensors but removes nothing from its gradient: its name says counterfactual, in the row, in
    metrics.arms and in the terminal line; the real rule keeps its plain name."""
    row = step_metrics(
        "arm", 0, SUMMARY, _recs(), loss=loss, seconds=1.0, sample_seconds=0.5, sampler_checkpoint="tinker://x"
    )
    assert counterfactual not in row and f"counterfactual_{counterfactual}" in row and real in row
    assert f"counterfactual_last_update_{counterfactual.split('_')[1]}_frac" in row
    summary = arm_summary([row])
    assert f"counterfactual_{counterfactual}_mean" in summary and f"{counterfactual}_mean" not in summary
    assert f"{real}_mean" in summary
    short = {"dppo_masked_frac": "masked", "ppo_clip_frac": "clip"}
    line = step_line(row, 3)
    assert f"cf {short[counterfactual]} " in line and f"cf {short[real]} " not in line


def _state(tmp_path, **arms):
    st = RunState(
        "r1",
        "p" * 64,
        "e" * 64,
        "c" * 64,
        "tinker://init",
        {a: ArmState(a, steps_done=n, state_path=f"tinker://{a}/{n}") for a, n in arms.items()},
    )
    st.save(state_path(tmp_path, "r1"))
    return RunState.load(state_path(tmp_path, "r1"))


def test_resume_refuses_changed_plan_evaluator_code_or_unpaired_steps(tmp_path):
    st = _state(tmp_path, grpo_seed0=2, dppo_seed0=2)
    ok = dict(plan_sha256="p" * 64, evaluator_id="e" * 64, code_rev="c" * 64)
    assert resume_problems(st, **ok) == []
    assert st.arms["dppo_seed0"].state_path == "tinker://dppo_seed0/2"
    for key, what in (("plan_sha256", "plan"), ("evaluator_id", "evaluator"), ("code_rev", "code and data revision")):
        problems = resume_problems(st, **{**ok, key: "x" * 64})
        assert len(problems) == 1 and what in problems[0]
    assert "apart" in resume_problems(_state(tmp_path, grpo_seed0=3, dppo_seed0=1), **ok)[0]
    # an arm replaced after a lost model retrains from its last save: it may lag by more than a step
    lagging = _state(tmp_path, grpo_seed0=3, dppo_seed0=1)
    lagging.arms["dppo_seed0"].lost_models.append({"model_id": "m", "at_steps_done": 3, "replaced_from_step": 0})
    assert resume_problems(lagging, **ok) == []
    lagging.arms["grpo_seed0"].steps_done, lagging.arms["dppo_seed0"].steps_done = 1, 3  # the other one may not
    assert "apart" in resume_problems(lagging, **ok)[0]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / STATE_FILE).write_text("{not json")
    with pytest.raises(ComparisonError, match="unreadable"):
        RunState.load(tmp_path / "bad" / STATE_FILE)


def test_resume_rewinds_every_arm_to_the_last_step_all_of_them_saved(tmp_path):
    """save_every > 1, or a kill between the arms' saves: both arms continue from the last common
    save (step 0: the shared initial checkpoint); later rows are dropped and recomputed."""
    st = RunState(
        "r1",
        "p",
        "e",
        "c",
        "tinker://init",
        {
            "grpo_seed0": ArmState(
                "grpo_seed0",
                steps_done=7,
                state_path="tinker://g/6",
                state_step=6,
                saves={"3": "tinker://g/3", "6": "tinker://g/6"},
                final_sampler="tinker://g/final",
            ),
            "dppo_seed0": ArmState(
                "dppo_seed0", steps_done=6, state_path="tinker://d/3", state_step=3, saves={"3": "tinker://d/3"}
            ),
        },
    )
    st.rows = [{"arm": a, "step": k} for k in range(7) for a in ("grpo_seed0", "dppo_seed0")]
    assert rewind_to_common_save(st, steps=9) == 3
    assert {a: (s.steps_done, s.state_step, s.state_path) for a, s in st.arms.items()} == {
        "grpo_seed0": (3, 3, "tinker://g/3"),
        "dppo_seed0": (3, 3, "tinker://d/3"),
    }
    assert st.arms["grpo_seed0"].final_sampler is None and max(r["step"] for r in st.rows) == 2
    st.arms["dppo_seed0"].saves = {}
    st.arms["dppo_seed0"].state_path = None
    assert rewind_to_common_save(st, steps=9) == 0
    assert all(s.state_path is None and s.steps_done == 0 for s in st.arms.values()) and st.rows == []


def test_code_revision_changes_with_the_sources(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    before = package_files_sha256(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    assert package_files_sha256(tmp_path) != before
    # the data the package carries counts too: a changed vendored item or its SHA256SUMS refuses a resume
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "SHA256SUMS").write_text("abc  train.jsonl\n")
    with_data = package_files_sha256(tmp_path)
    (tmp_path / "data" / "SHA256SUMS").write_text("abd  train.jsonl\n")
    assert package_files_sha256(tmp_path) != with_data
    changed = package_files_sha256(tmp_path)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert package_files_sha256(tmp_path) == changed  # bytecode does not count


def _crit(lower, upper, margin=0.0, cid="primary"):
    return CriterionDecision(
        cid, "accuracy", "dppo_seed0", "grpo_seed0", {"lower": lower, "upper": upper, "margin": margin}
    )


def test_verdict_rules_including_must_fail_inputs():
    assert verdict([_crit(0.01, 0.2)], rehearsal=False)[:2] == ("supported", "supported")
    assert verdict([_crit(-0.2, -0.01)], rehearsal=False)[:2] == ("refuted", "refuted")
    assert verdict([_crit(0.0, 0.2)], rehearsal=False)[:2] == (
        "inconclusive",
        "insufficient_evidence",
    )  # lower == margin
    assert verdict([_crit(-0.1, 0.1)], rehearsal=False)[:2] == ("inconclusive", "insufficient_evidence")
    assert verdict([_crit(0.01, 0.2), _crit(-0.3, -0.1, cid="b")], rehearsal=False)[:2] == (
        "inconclusive",
        "mixed_criteria",
    )
    assert verdict([_crit(0.01, 0.2), _crit(-0.1, 0.1, cid="b")], rehearsal=False)[:2] == (
        "inconclusive",
        "mixed_criteria",
    )
    v, reason, text = verdict([_crit(0.01, 0.2)], rehearsal=True)
    assert (v, reason) == ("inconclusive", "insufficient_evidence") and "supported" in text
    assert verdict([], rehearsal=False)[:2] == ("inconclusive", "incomplete_execution")


def _rows(t_vals, b_vals):
    rows = []
    for i, (t, b) in enumerate(zip(t_vals, b_vals)):
        rows += [
            {"item_id": f"i{i}", "arm": "dppo_seed0", "seed": 0, "metric": "accuracy", "value": t, "evaluator_id": "e"},
            {"item_id": f"i{i}", "arm": "grpo_seed0", "seed": 0, "metric": "accuracy", "value": b, "evaluator_id": "e"},
        ]
    return rows


def test_decide_criteria_uses_the_spec_rule_and_recomputes_from_file(tmp_path):
    rule = dict(criteria=SPEC.run.criteria, alpha=SPEC.run.alpha)
    rows = _rows([1] * 900 + [0] * 100, [0] * 1000)
    crit = decide_criteria(rows, rule["criteria"], alpha=rule["alpha"])
    assert crit[0].lower > 0 and verdict(crit, rehearsal=False)[0] == "supported"
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "obs.jsonl").write_bytes(data)
    again = decide_criteria(stats.read_observations(tmp_path / "obs.jsonl"), rule["criteria"], alpha=rule["alpha"])
    assert again[0].lower == crit[0].lower
    block = decision_block(data, crit, verdict(crit, rehearsal=False), rehearsal=False)
    assert block["version"] == 1 and block["observations_file"]["name"] == OBSERVATIONS_FILE
    with pytest.raises(stats.ObservationError, match="unpaired"):
        decide_criteria(rows[:-1], rule["criteria"], alpha=rule["alpha"])
    bad = copy.deepcopy(SPEC.raw)
    bad["decision_rule"]["method"] = "bootstrap"
    with pytest.raises(PlanError, match=": decision_rule.method: 'bootstrap' is not implemented"):
        parse_plan(json.dumps(bad).encode(), SPEC.path)


# ---- rehearsal plans (CONTRACTS.md) ------------------------------------------------------------


def test_rehearsal_plan_loads_and_declares_every_difference():
    assert REHEARSAL.kind == "rehearsal" and REHEARSAL.raw["label"] == "rehearsal"
    # loading checked that the leaves that differ from SPEC are exactly the declared differences
    assert all(d["reason"].strip() for d in REHEARSAL.raw["differences"])
    assert REHEARSAL.spec["activation_gate"]["checks"][:4] == SPEC.raw["activation_gate"]["checks"][:4]
    assert REHEARSAL.spec["decision_rule"] == SPEC.raw["decision_rule"]
    assert {d["field"] for d in REHEARSAL.deviations} <= set(plans.DEVIATION_FIELDS)


def _reparse(mutate):
    raw = copy.deepcopy(REHEARSAL.raw)
    mutate(raw)
    return parse_plan(json.dumps(raw).encode(), REHEARSAL.path)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r["spec"].update(max_seq_len=2048), "not listed in differences"),
        (
            lambda r: r["differences"].append({"field": "lora_rank", "spec": 32, "rehearsal": 32, "reason": "x"}),
            "does not differ",
        ),
        (lambda r: r["differences"][0].update(reason="  "), "reason"),
        (lambda r: r["derived_from"].update(sha256="0" * 64), "derived_from.sha256"),
        (
            lambda r: (
                r["spec"]["activation_gate"]["checks"][0].update(min=0.0),
                r["differences"].append(
                    {"field": "activation_gate.checks[0].min", "spec": 0.001, "rehearsal": 0.0, "reason": "relax"}
                ),
            ),
            "keeps the spec's gates",
        ),
        (
            lambda r: (
                r["spec"]["arms"][0].update(updates_per_batch=1),
                r["differences"].append(
                    {"field": "arms[0].updates_per_batch", "spec": 2, "rehearsal": 1, "reason": "x"}
                ),
            ),
            "keeps the spec's gates",
        ),
        (lambda r: r["spec"].pop("decision_rule"), "decision_rule"),
        (
            lambda r: (
                r["spec"]["activation_gate"]["checks"][0].update(one_of=["x"]),
                r["differences"].append(
                    {"field": "activation_gate.checks[0].one_of", "spec": None, "rehearsal": ["x"], "reason": "x"}
                ),
            ),
            "keeps the spec's gates",
        ),
        (lambda r: r.update(kind="rehearsal", label="final"), "label"),
    ],
)
def test_rehearsal_plan_violations_are_refused_naming_the_field(mutate, match):
    with pytest.raises(PlanError, match=match):
        _reparse(mutate)


def test_one_writer_per_run_a_second_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys
    import textwrap

    from run_env import harness_env

    from dppo_harness.stages.comparison.config import ComparisonError
    from dppo_harness.stages.comparison.resume import load_owned_state
    from dppo_harness.stages.comparison.state import hold_run_lock

    hold_run_lock(tmp_path, "20261203T000000Z-abc123", what="comparison run 20261203T000000Z-abc123")
    hold_run_lock(tmp_path, "20261203T000000Z-abc123", what="again")  # the holder itself: idempotent
    other = textwrap.dedent(f"""
        from dppo_harness.stages.comparison.config import ComparisonError
        from dppo_harness.stages.comparison.state import hold_run_lock
        try:
            hold_run_lock({str(tmp_path)!r}, "20261203T000000Z-abc123", what="--resume 20261203T000000Z-abc123")
        except ComparisonError as exc:
            print(exc)
    """)
    out = subprocess.run(
        [sys.executable, "-c", other],
        capture_output=True,
        text=True,
        timeout=120,
        env=harness_env(PYTHONPATH=str(Path(__file__).parents[2] / "src")),
    )
    line = out.stdout.strip()
    assert line.startswith(
        "--resume 20261203T000000Z-abc123 refused: run 20261203T000000Z-abc123 is being written "
        f"by pid {__import__('os').getpid()}"
    ), out.stdout + out.stderr
    # a state that names another run is refused, whoever wrote it where
    st = RunState("20261203T000000Z-other1", "p", "e", "c", "tinker://init", {"a": ArmState("a")})
    st.save(state_path(tmp_path, "20261203T000000Z-mine22"))
    with pytest.raises(ComparisonError, match="belongs to run 20261203T000000Z-other1"):
        load_owned_state(tmp_path, "20261203T000000Z-mine22")


def test_step_row_record_writes_the_jsonl_keys_in_their_order_and_decodes_back():
    """The JSONL keeps the labelled keys, in order, and `row_fraction` decodes the label back."""
    from dppo_harness.loss.terms import row_fraction

    row = step_metrics(
        "a",
        3,
        SUMMARY,
        _recs(),
        loss=loss_registry.GRPO_LOSS,
        seconds=2.0,
        sample_seconds=1.0,
        sampler_checkpoint="tinker://x",
        kl={"optim/entropy": 0.5, "optim/kl_sample_train_v1": 0.01},
        cookbook_env={"env/all/reward/total": 1.0},
        rollout_seconds=0.5,
    )
    assert list(row) == [
        "arm",
        "step",
        "loss",
        "reward_mean",
        "format_rate",
        "correct_rate",
        "truncated_frac",
        "no_answer_frac",
        "mean_response_tokens",
        "responses",
        "max_tokens",
        "counterfactual_dppo_masked_frac",
        "ppo_clip_frac",
        "counterfactual_last_update_masked_frac",
        "last_update_clip_frac",
        "drift_abs_p90",
        "drift_abs_p99",
        "drift_abs_max",
        "loss_tokens",
        "response_tokens",
        "updates",
        "seconds",
        "sample_seconds",
        "sampler_checkpoint",
        "entropy",
        "kl_sample_train_v1",
        "rollout_seconds",
        "cookbook_env",
    ]
    assert (
        row_fraction(row, "dppo_masked_frac").counterfactual and not row_fraction(row, "ppo_clip_frac").counterfactual
    )

"""Deviations are recorded only for changes that run, with reasons that fit the run: no CPU or
rehearsal wording on a real service, no fixed rehearsal size the stages never apply."""

from pathlib import Path

from dppo_harness.plans import load_plan
from dppo_harness.stages import feasibility
from dppo_harness.stages.comparison import evaluate as comparison_evaluate

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_plan(ROOT / "plans" / "exp_e6b0965af3.json")
REHEARSAL = load_plan(ROOT / "plans" / "rehearsal" / "comparison-local.json")


def test_the_evaluation_subset_reason_fits_what_served_the_run():
    real = comparison_evaluate.eval_subset_reason(REHEARSAL, embedded=False, n=50)
    assert "declared rehearsal size" in real and "first 50 gsm8k test items" in real
    assert "CPU" not in real and "minutes" not in real and "offline" not in real
    local = comparison_evaluate.eval_subset_reason(REHEARSAL, embedded=True, n=50)
    assert "declared rehearsal size" in local and "embedded server" in local
    own = comparison_evaluate.eval_subset_reason(SPEC, embedded=True, n=100)
    assert own.startswith("the plan states eval.n_examples = 100") and "rehearsal" not in own and "CPU" not in own


def test_the_saved_spec_on_the_embedded_server_is_projected_at_its_own_size():
    # The stages run a plan as written; a smaller run is a declared rehearsal plan,
    # so no fixed rehearsal size is projected or recorded as a deviation.
    assert not hasattr(feasibility, "rehearsal_sizing") and not hasattr(feasibility, "LOCAL_REHEARSAL_SIZE")
    sched = feasibility.schedule_json(SPEC.kind, SPEC.run)
    assert (sched["batches_per_arm"], sched["groups_per_batch"], sched["eval_items"]) == (50, 32, 2 * 1319)


def test_a_plan_too_big_for_the_embedded_server_is_told_how_to_rehearse_it():
    res = feasibility.FeasibilityResult(
        timings=None,
        projection=None,
        block={},
        passed=False,
        failures=["projected 40000 s > remaining budget 7200 s"],
        pilot={},
        wall_seconds=0.0,
    )
    assert "rehearsal plan" not in res.failure_message()
    local = feasibility.FeasibilityResult(
        timings=None,
        projection=None,
        block={},
        passed=False,
        failures=["projected 40000 s > remaining budget 7200 s"],
        pilot={},
        wall_seconds=0.0,
        embedded_server=True,
    )
    msg = local.failure_message()
    assert "projected 40000 s" in msg
    assert "a rehearsal plan (kind rehearsal, docs/plans.md) with its resolution file, then --plan PLAN" in msg


def test_the_feasibility_pilot_times_every_arm_with_its_own_loss_and_optimizer():
    import copy
    import json

    from dppo_harness.plans import parse_plan

    pilots = SPEC.run.arms
    assert [(p.name, p.loss) for p in pilots] == [
        ("grpo_seed0", "grpo_clip_eps0.2"),
        ("dppo_seed0", "dppo_divergence_mask"),
    ]
    assert all(p.adam["learning_rate"] == 2e-5 for p in pilots)
    raw = json.loads((ROOT / "plans" / "exp_e6b0965af3.json").read_text())
    other = copy.deepcopy(raw)
    other["restoration_preflight"]["groups"][0]["arms"][0]["optimizer_config"]["beta2"] = 0.99
    plan = parse_plan(json.dumps(other).encode(), ROOT / "plans" / "exp_e6b0965af3.json", repo_root=ROOT)
    by_arm = {p.name: p.adam for p in plan.run.arms}
    assert by_arm["grpo_seed0"]["beta2"] == 0.99 and by_arm["dppo_seed0"]["beta2"] == 0.95
    assert feasibility.schedule_json(SPEC.kind, SPEC.run)["arm_losses"] == ["grpo_clip_eps0.2", "dppo_divergence_mask"]


def test_the_local_backend_substitution_says_what_was_chosen_not_what_is_reachable():
    from dppo_harness.evidence.backend import Backend, backend_deviations

    info = Backend(kind="local", requested_model=SPEC.base_model, served_model="local/tiny-qwen3-gsm8k")
    (d,) = backend_deviations(SPEC, info)
    assert d["field"] == "model" and "reachable" not in d["reason"]  # the harness never tested reachability
    assert "local backend" in d["reason"] and "rehearsal" in d["reason"]

"""Feasibility projection math and the brief's `feasibility` shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dppo_harness.plans import PlanError, load_plan, parse_plan
from dppo_harness.stages import feasibility as feasibility_module
from dppo_harness.stages.write import PILOT_FILE, write_feasibility

PLANS = Path(__file__).resolve().parents[2] / "plans"


@pytest.fixture(scope="module")
def spec():
    return load_plan(PLANS / "exp_e6b0965af3.json")


@pytest.fixture(scope="module")
def small():
    """2 rollout steps x 2 groups and 4 evaluation items per arm: a plan that fits its budget."""
    return load_plan(PLANS.parent / "tests" / "fixtures" / "plans" / "comparison-ci-kill-resume.json")


def _timings(**kw) -> feasibility_module.PilotTimings:
    # 2 s per group, 4 s per update (mean of 3 and 5), 0.5 s per eval item, 10 s setup.
    args = dict(
        setup_seconds=10.0,
        sampling_seconds=4.0,
        sampled_groups=2,
        sampled_sequences=16,
        update_seconds=(3.0, 5.0),
        sequences_per_update=128,
        eval_seconds=2.0,
        eval_items=4,
    )
    args.update(kw)
    return feasibility_module.PilotTimings(**args)


def test_spec_schedule(spec):
    s = feasibility_module.schedule_json(spec.kind, spec.run)
    assert (s["trained_arms"], s["batches_per_arm"], s["updates_per_batch"]) == (2, 50, 2)
    assert (s["groups_per_batch"], s["group_size"], s["sequences_per_update"]) == (32, 8, 128)
    assert (s["max_tokens"], s["eval_items"], s["temperature"]) == (512, 2 * 1319, 1.0)
    assert feasibility_module.arm_steps(spec.run) == 100


def test_spec_projection_that_must_not_fit(spec):
    p = feasibility_module.project(spec.run, _timings(), spec.budget, gpu_count=0)
    assert p.arm_step_seconds == pytest.approx(2.0 * 32 + 2 * 4.0)  # 72
    assert p.training_seconds == pytest.approx(100 * 72.0)
    assert p.evaluation_seconds == pytest.approx(2638 * 0.5)
    work = 10.0 + 7200.0 + 1319.0
    assert p.recovery_seconds == pytest.approx(0.25 * work)
    assert p.total_seconds == pytest.approx(1.25 * work)  # 10661 s > 7200 s
    assert p.budget_seconds == 7200.0
    assert not p.fits
    assert "exceeds the remaining wall budget" in p.problems[0]
    assert p.gpu_hours == 0.0


def test_small_projection_fits(small):
    p = feasibility_module.project(small.run, _timings(), small.budget, gpu_count=0)
    assert p.arm_step_seconds == pytest.approx(2.0 * 2 + 2 * 4.0)  # 12
    assert p.total_seconds == pytest.approx((10.0 + 4 * 12.0 + 8 * 0.5) * 1.25)
    assert p.fits and p.problems == ()


def test_gpu_hours(small):
    s = small.run
    t = _timings()
    unknown = feasibility_module.project(s, t, small.budget, gpu_count=None)
    assert unknown.gpu_hours is None and unknown.fits  # wall fits; GPU-hours stay unknown
    assert any("GPU-hours not projected" in p for p in unknown.problems)
    # 8 GPUs for ~1.2 h of wall time exceed 2 GPU-hours even where the wall budget would allow it.
    slow = _timings(sampling_seconds=2 * 40.0, update_seconds=(60.0,))
    over = feasibility_module.project(s, slow, {"gpu_hours": 2.0, "max_wall_minutes": 600}, gpu_count=8)
    assert over.gpu_hours == pytest.approx(over.total_seconds / 3600 * 8)
    assert not over.fits and "GPU-hours exceeds" in over.problems[-1]


def test_bad_inputs_raise_clear_errors(spec):
    s = spec.run
    with pytest.raises(feasibility_module.FeasibilityError, match="update timings"):
        feasibility_module.project(s, _timings(update_seconds=()), spec.budget, gpu_count=0)
    with pytest.raises(feasibility_module.FeasibilityError, match="sampled no groups"):
        feasibility_module.project(s, _timings(sampled_groups=0), spec.budget, gpu_count=0)
    with pytest.raises(feasibility_module.FeasibilityError, match="timed no evaluation"):
        feasibility_module.project(s, _timings(eval_items=0, eval_seconds=0.0), spec.budget, gpu_count=0)
    with pytest.raises(feasibility_module.FeasibilityError, match="setup_seconds"):
        feasibility_module.project(s, _timings(setup_seconds=float("nan")), spec.budget, gpu_count=0)


def test_schedule_needs_stated_group_sizes(spec):
    raw = dict(spec.raw, method=spec.raw["method"].replace("group_size=8", "eight per group"))
    with pytest.raises(
        PlanError, match="values.groups_per_batch: the sentence .* is not verbatim in the spec's method"
    ):
        parse_plan(json.dumps(raw).encode(), spec.path)


def test_feasibility_block_shape_and_consistency(spec):
    t = _timings()
    p = feasibility_module.project(spec.run, t, spec.budget, gpu_count=0)
    block = feasibility_module.feasibility_block(
        spec.run,
        t,
        p,
        pilot_config={"pilot_groups": 2},
        effective_config={"base_model": "Qwen/Qwen3.5-2B"},
        primary_endpoint=spec.raw["primary_endpoint"],
        allocation_source="cpu",
    )
    assert block["source"] == PILOT_FILE
    assert set(block) == {
        "config",
        "effective_config",
        "primary_endpoint",
        "source",
        "measurements",
        "generation",
        "recovery",
    }
    m = block["measurements"]
    assert set(m) == {"setup", "training", "evaluation"}
    keys = {"seconds", "units", "planned_units", "samples", "gpu_count", "allocation_source"}
    assert all(set(m[k]) == keys for k in m)
    assert m["setup"] == {
        "seconds": 10.0,
        "units": 1,
        "planned_units": 1,
        "samples": 0,
        "gpu_count": 0,
        "allocation_source": "cpu",
    }
    tr = m["training"]
    assert tr["planned_units"] == 100 and tr["seconds"] == pytest.approx(4.0 + 8.0)
    # seconds per unit x planned units reproduces the projected training time
    assert tr["seconds"] / tr["units"] * tr["planned_units"] == pytest.approx(p.training_seconds)
    assert m["evaluation"]["planned_units"] == 2638 and m["evaluation"]["units"] == 4
    assert block["generation"] is None
    assert block["recovery"] == {"seconds": p.recovery_seconds, "gpu_count": 0, "allocation_source": "cpu"}
    check = feasibility_module.feasibility_check(p, known_gpu_hours=0.0)
    assert check["status"] == "exceeds_budget" and check["wall_seconds"] == p.total_seconds


def test_unknown_gpu_count_nulls_allocation_source(small):
    t = _timings()
    p = feasibility_module.project(small.run, t, small.budget, gpu_count=None)
    block = feasibility_module.feasibility_block(
        small.run, t, p, pilot_config={}, effective_config={}, primary_endpoint="x", allocation_source="ignored"
    )
    assert block["measurements"]["setup"]["gpu_count"] is None
    assert block["measurements"]["setup"]["allocation_source"] is None
    assert feasibility_module.gpu_allocation("tinker") == (None, None)


class _FakeEvidence:
    def __init__(self):
        self.files, self.fields = {}, {}

    def register_json(self, name, kind, obj):
        self.files[name] = (kind, obj)

    def update_result(self, **fields):
        self.fields.update(fields)


def test_run_feasibility_projects_each_plan_at_its_own_size(spec):
    """One way to run smaller: a smaller plan file (2 rollout steps x 2 groups, 4 test items)."""
    ev = _FakeEvidence()
    small = load_plan(PLANS.parent / "tests" / "fixtures" / "plans" / "comparison-ci-kill-resume.json")
    res = feasibility_module.run_feasibility(
        None, small, initial_checkpoint="tinker://x/weights/init", backend_kind="local", timings=_timings()
    )
    write_feasibility(ev, res)
    assert feasibility_module.planned_eval_items(small.run) == 8
    assert ev.files[PILOT_FILE][1]["schedule"]["eval_items"] == 8
    # arm-step: 2 groups x 2 s + 2 updates x 4 s = 12; 10 + 4 arm-steps x 12 + 8 x 0.5 = 62; x1.25
    assert res.projection.total_seconds == pytest.approx(62 * 1.25) and res.passed
    assert ev.files[PILOT_FILE][1]["projection"]["fits"] is True
    assert ev.fields["feasibility"]["config"]["plan_sha256"] == small.sha256
    assert ev.fields["metrics"]["feasibility/fits"] == 1.0
    full = feasibility_module.run_feasibility(
        None, spec, initial_checkpoint="i", backend_kind="local", timings=_timings()
    )
    assert not full.passed and "exceeds the remaining wall budget" in full.failure_message()


def test_stage_projections(spec):
    res = feasibility_module.run_feasibility(
        None, spec, initial_checkpoint="i", backend_kind="local", timings=_timings()
    )
    out = res.pilot["stage_projections_with_reserve"]
    assert out["gate"] == pytest.approx((10.0 + 5 * 72.0) * 1.25)  # the plan's 5-step gate pilot
    assert out["plan"] == pytest.approx((10.0 + 100 * 72.0 + 2638 * 0.5) * 1.25)


def test_a_diagnostic_plan_is_not_piloted():
    diagnostic = load_plan(PLANS / "exp_e6b0965af3-diagnostic-r1.json")
    with pytest.raises(feasibility_module.FeasibilityError, match="not piloted"):
        feasibility_module.run_feasibility(
            None, diagnostic, initial_checkpoint="i", backend_kind="local", timings=_timings()
        )


def test_measured_setup_parts_add_up(small):
    res = feasibility_module.run_feasibility(
        None,
        small,
        initial_checkpoint="i",
        backend_kind="local",
        timings=_timings(),
        measured_setup={"restoration_preflight": 30.0},
    )
    assert res.timings.setup_seconds == 40.0
    assert res.block["measurements"]["setup"]["seconds"] == 40.0
    assert res.block["config"]["setup_components_seconds"] == {
        "create_client_from_initial_checkpoint": 10.0,
        "restoration_preflight": 30.0,
    }
    with pytest.raises(feasibility_module.FeasibilityError, match="measured_setup"):
        feasibility_module.run_feasibility(
            None,
            small,
            initial_checkpoint="i",
            backend_kind="local",
            timings=_timings(),
            measured_setup={"x": -1.0},
        )

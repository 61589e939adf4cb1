"""Activation-gate checks: ranges from the frozen spec, missing values fail, pilot aggregation."""

import json
from pathlib import Path

import pytest

from dppo_harness.instrument.instrumentation import LossCallRecord
from dppo_harness.loss.terms import LossStats
from dppo_harness.plans import load_plan
from dppo_harness.plans.models import GateCheck
from dppo_harness.stages import gate

SPEC_PLAN = load_plan(Path(__file__).parents[2] / "plans" / "exp_e6b0965af3.json")
SPEC = json.loads((Path(__file__).parents[2] / "plans" / "exp_e6b0965af3.json").read_text())
CHECKS = [GateCheck.model_validate(c) for c in SPEC["activation_gate"]["checks"]]
GOOD = {
    "dppo_masked_token_fraction": 0.01,
    "policy_drift_abs_p_q90": 0.02,
    "grpo_clip_fraction": 0.003,
    "executed_updates_per_batch": 2,
    "executed_base_model": "Qwen/Qwen3.5-2B",
}


def _by_metric(results):
    return {r.metric: r for r in results}


def test_all_in_range_passes_every_check_of_the_plan():
    results = gate.evaluate_gate(CHECKS, GOOD)
    assert [r.metric for r in results] == [c.metric for c in CHECKS]
    assert all(r.passed for r in results), [r.reason for r in results]


@pytest.mark.parametrize(
    "metric,value,needle",
    [
        ("dppo_masked_token_fraction", 0.0, "< min"),  # the zero-mask failure of the earlier pilot
        ("dppo_masked_token_fraction", 0.31, "> max"),
        ("policy_drift_abs_p_q90", 0.004, "< min"),
        ("grpo_clip_fraction", 0.0, "< min"),
        ("executed_updates_per_batch", 1, "< min"),
        ("executed_updates_per_batch", [2, 1], "not a finite number"),
        ("executed_base_model", "tiny-qwen3-gsm8k", "not in"),
        ("policy_drift_abs_p_q90", None, "missing"),
        ("policy_drift_abs_p_q90", float("nan"), "not a finite number"),
        ("executed_updates_per_batch", True, "not a finite number"),
    ],
)
def test_out_of_range_or_missing_fails_that_check(metric, value, needle):
    results = _by_metric(gate.evaluate_gate(CHECKS, {**GOOD, metric: value}))
    assert not results[metric].passed and needle in results[metric].reason
    assert all(r.passed for m, r in results.items() if m != metric)


def test_unmeasured_metric_and_boundless_check_fail():
    values = dict(GOOD)
    del values["grpo_clip_fraction"]
    assert not _by_metric(gate.evaluate_gate(CHECKS, values))["grpo_clip_fraction"].passed
    assert not gate.evaluate_check(GateCheck.model_construct(metric="x", measures=""), 1.0).passed
    # Bounds are inclusive, as the spec writes them.
    assert gate.evaluate_check(GateCheck(metric="x", measures="", min=2, max=2), 2).passed


def _rec(step, u, frac, q90, clip):
    stats = dict.fromkeys(LossStats.scalar_names(), 0.0)  # the gate reads the scalars by recorded name
    stats.update({"dppo/masked_frac_loss_tokens": frac, "drift/abs_p90": q90, "ppo/clip_frac_loss_tokens": clip})
    return LossCallRecord(
        call_index=2 * step + u - 1,
        context={"step": step, "update_in_batch": u},
        dtype="float32",
        tensors={},
        stats=stats,
    )


def test_gate_values_use_the_second_update_mean_over_steps():
    recs = []
    for s in range(5):
        recs += [_rec(s, 1, 0.9, 0.9, 0.9), _rec(s, 2, 0.01 * (s + 1), 0.001 * (s + 1), 0.002)]
    values, rows = gate.gate_values(recs, [2] * 5, "Qwen/Qwen3.5-2B", 5)
    assert values["dppo_masked_token_fraction"] == pytest.approx(0.03)
    assert values["policy_drift_abs_p_q90"] == pytest.approx(0.003)
    assert values["grpo_clip_fraction"] == pytest.approx(0.002)
    assert values["executed_updates_per_batch"] == 2
    assert len(rows) == 5 and all(r["second_update_recorded"] for r in rows)
    # A step without its 2nd update makes the metrics missing, and uneven counts fail.
    values, _ = gate.gate_values(recs[:-1], [2, 2, 2, 2, 1], "Qwen/Qwen3.5-2B", 5)
    assert values["dppo_masked_token_fraction"] is None
    results = _by_metric(gate.evaluate_gate(CHECKS, values))
    assert not results["dppo_masked_token_fraction"].passed
    assert not results["executed_updates_per_batch"].passed


def test_the_gate_pilots_the_plans_treatment_at_the_plans_schedule():
    run = SPEC_PLAN.run
    arm = gate.pilot_arm(SPEC_PLAN.name, run)
    assert (arm.name, arm.loss, arm.role) == ("dppo_seed0", "dppo_divergence_mask", "treatment")
    assert run.gate_pilot_steps == 5 and "5-step pilot" in run.stated["gate_pilot_steps"].source
    assert arm.updates_per_batch == 2 and arm.adam["learning_rate"] == 2e-5 and arm.adam["eps"] == 1e-8


def test_the_executed_model_check_fails_on_the_stand_ins_name():
    check = next(c for c in CHECKS if c.metric == "executed_base_model")
    assert not gate.evaluate_check(check, "local/tiny-qwen3-gsm8k").passed
    assert gate.evaluate_check(check, "Qwen/Qwen3.5-2B").passed


def test_gate_rows_carry_each_steps_truncation_and_answer_yield():
    from dppo_harness.evaluation import answer_yield

    yields = [
        answer_yield.response_yield(["length", "stop"], [False, True], [512, 100], max_tokens=512),
        answer_yield.response_yield(["stop", "stop"], [True, True], [50, 70], max_tokens=512),
    ]
    _, out = gate.gate_values([], [2, 2], "m", 3, yields=yields)
    assert out[0]["truncated_frac"] == 0.5 and out[0]["no_answer_frac"] == 0.5 and out[0]["mean_response_tokens"] == 306
    assert out[1]["truncated_frac"] == 0.0 and out[1]["responses"] == 2
    assert "truncated_frac" not in out[2]  # a step that never sampled reports nothing, not zeros


def _report_definitions(updates_per_batch: int) -> dict[str, str]:
    pilot = {"updates_per_batch": updates_per_batch, "loss": "dppo_divergence_mask", "normalization": "token_mean"}
    report = gate.GateReport(
        passed=True,
        checks=gate.evaluate_gate(CHECKS, GOOD),
        values=dict(GOOD),
        per_step=[],
        pilot=pilot,
        plan={},
        wall_seconds=0.0,
    )
    return report.to_json()["definitions"]


def test_gate_definitions_state_the_pilots_own_update_count_and_clip_eps():
    from dppo_harness.loss import losses

    eps = losses.LossConfig.for_loss("dppo_divergence_mask", "token_mean").ppo_eps
    four = _report_definitions(4)
    assert "last (4th) minibatch update" in four["dppo_masked_token_fraction"]
    assert "last (4th) minibatch update" in four["policy_drift_abs_p_q90"]
    assert "2nd" not in " ".join(four.values())
    assert f"eps={eps:g} clip" in four["grpo_clip_fraction"]
    assert "last (2nd) minibatch update" in _report_definitions(2)["dppo_masked_token_fraction"]
    assert "last (3rd) minibatch update" in _report_definitions(3)["dppo_masked_token_fraction"]
    assert "last (1st) minibatch update" in _report_definitions(1)["dppo_masked_token_fraction"]
    assert "last (11th) minibatch update" in _report_definitions(11)["dppo_masked_token_fraction"]
    # the counterfactual clip's eps is the one the pilot's loss call counted with, not a constant
    assert gate.definition("grpo_clip_fraction", updates_per_batch=2, ppo_eps=0.3).startswith(
        "ppo/clip_frac_loss_tokens: eps=0.3 clip"
    )


def test_bounds_record_writes_the_keys_the_plan_check_declares_in_report_order():
    from dppo_harness.stages.checks import Bounds

    for c in CHECKS:
        dumped = c.model_dump(exclude_none=True)
        assert Bounds.of(c).as_json() == {k: dumped[k] for k in ("min", "max", "one_of") if k in dumped}
    assert list(Bounds(min=0.0, max=1.0, min_exclusive=0.0).as_json()) == ["min", "max", "min_exclusive"]


class _Bundle:
    def __init__(self):
        self.result, self.files, self.fields = {"backend": None}, {}, {}

    def register_json(self, name, kind, obj):
        self.files[name] = obj

    def register_bytes(self, name, kind, data):
        self.files[name] = data

    def update_result(self, **fields):
        self.fields.update(fields)


def test_a_pilot_client_not_shown_loaded_from_the_initial_checkpoint_fails_the_gate(monkeypatch):
    from types import SimpleNamespace as NS

    from tinker import types

    from dppo_harness.train.restore import Restore

    init, other = "tinker://m/weights/initial", "tinker://m/weights/other"
    info = NS(model_data=NS(model_name="Qwen/Qwen3.5-2B", arch=""))
    restored = lambda sc, path, name: Restore(name, NS(), path, types.LoadWeightsResponse(path=other), info, 0.0)  # noqa: E731
    monkeypatch.setattr(gate, "restore", restored)

    def no_renderer():  # the pilot stops after the load: nothing to sample with
        raise RuntimeError("no renderer here")

    monkeypatch.setattr(gate.tokenizer, "make_renderer", no_renderer)
    bundle = _Bundle()
    report = gate.run_activation_gate(None, SPEC_PLAN, bundle, init, backend="tinker")
    assert not report.passed and f"pilot client: the load of {init} loaded {other!r}" in report.errors
    assert "pilot stopped: RuntimeError: no renderer here" in report.errors
    assert report.pilot["loaded_checkpoint"] == other and report.pilot["initial_checkpoint"] == init
    assert report.to_json()["passed"] is False


def test_a_stopped_pilot_keeps_each_finished_step_in_the_journal_and_its_writer_registers_it(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from tinker import types

    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.evidence.journal import Journal
    from dppo_harness.stages import write
    from dppo_harness.train.restore import Restore

    init, info = "tinker://m/weights/initial", NS(model_data=NS(model_name="m"))
    loaded = lambda sc, path, name: Restore(name, NS(), path, types.LoadWeightsResponse(path=init), info, 0.0)  # noqa: E731
    monkeypatch.setattr(gate, "restore", loaded)
    monkeypatch.setattr(gate.tokenizer, "make_renderer", lambda: NS(renderer=None))
    monkeypatch.setattr(gate.dataset, "get", lambda name: NS(load_split=lambda split, seed: NS(batch=lambda s, n: [])))

    def step_then_killed(*args, **kw):  # step 0 ends, step 1 is killed
        if args[4]:
            raise RuntimeError("killed")
        return NS(batch=NS(response_yield=lambda: NS(truncated_frac=0.0, no_answer_frac=0.0))), None

    monkeypatch.setattr(gate, "run_arm_step", step_then_killed)
    bundle = EvidenceBundle.create(tmp_path)
    report = gate.run_activation_gate(None, SPEC_PLAN, bundle, init, backend="tinker")
    (entry,) = Journal(bundle).entries("record", "gate")
    assert "pilot stopped: RuntimeError: killed" in report.errors and entry.label == "pilot step 0" and entry.blob
    assert bundle.entry("gate-pilot-step0.npz") is None  # the stage names no file
    write.write_gate(bundle, report)
    assert bundle.file_path("gate-pilot-step0.npz").read_bytes() == entry.blob
    assert bundle.result["activation_calibration"]["note"].endswith("gate FAILED")

"""Plan loading/validation: shipped plans, malformed plans, deviations, effective config."""

import copy
import json
from pathlib import Path

import pytest

from dppo_harness import constants
from dppo_harness.plans import (
    BackendInfo,
    PlanError,
    backend_deviations,
    check_original_plan,
    effective_config,
    generation_audit_applicability,
    load_plan,
    parse_plan,
)

PLANS = Path(__file__).resolve().parents[2] / "plans"
SPEC = PLANS / "exp_e6b0965af3.json"
DIAG = PLANS / "exp_e6b0965af3-diagnostic-r1.json"
# sha256 of the spec object extracted verbatim from the brief (plus a trailing newline).
SPEC_SHA256 = "f2135b3e6474170da93cdf27901d4a16aa989ea35817c190f7ffa27de24185fc"


def _bytes(obj) -> bytes:
    return json.dumps(obj).encode()


def test_spec_is_the_saved_spec():
    plan = load_plan(SPEC)
    assert plan.kind == "experiment_spec"
    assert plan.sha256 == SPEC_SHA256
    raw = plan.raw
    assert raw["base_model"] == constants.BASE_MODEL and raw["lora_rank"] == 32
    assert [a["name"] for a in raw["arms"]] == ["grpo_seed0", "dppo_seed0"]
    assert [c["metric"] for c in raw["activation_gate"]["checks"]] == [
        "dppo_masked_token_fraction", "policy_drift_abs_p_q90", "grpo_clip_fraction",
        "executed_updates_per_batch", "executed_base_model"]
    assert raw["budget"] == {"gpu_hours": 2.0, "max_wall_minutes": 120}
    assert raw["experiment_features"]["generated_training_data"] is False
    assert "kind" not in raw  # verbatim: the saved spec has no kind field


def test_diagnostic_plan_validates_and_pins_its_settings():
    plan = load_plan(DIAG)
    assert plan.kind == "bounded_diagnostic"
    fs, sch = plan.raw["fixed_settings"], plan.raw["schedule"]
    assert fs["base_model"] == constants.BASE_MODEL and fs["lora_rank"] == 32 and fs["seed"] == 0
    assert fs["treatment"]["delta"] == constants.DPPO_DELTA
    assert fs["treatment"]["ratio_cap"] == constants.DPPO_RATIO_CAP
    assert fs["counterfactual_baseline"]["ppo_eps"] == constants.PPO_EPS
    assert fs["sampling"]["renderer"] == constants.RENDERER_NAME
    assert fs["optimizer"] == {"name": "adamw", "learning_rate": 2e-5, "beta1": 0.9, "beta2": 0.95,
                               "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    assert fs["loss_normalization"]["mode"] == "token_mean"
    assert (sch["groups_per_batch"], sch["group_size"], sch["minibatches_per_epoch"],
            sch["groups_per_minibatch"], sch["epochs"], sch["max_optimizer_updates"]) == (32, 8, 8, 4, 2, 16)
    assert plan.raw["recording"]["sentinels"]["after_updates"] == [0, 1, 2, 4, 8, 16]
    assert plan.budget == {"gpu_hours": 2.0, "max_wall_minutes": 12.0}
    assert plan.raw["original_hypothesis_tested"] is False and plan.raw["tested_instead"]
    crit = {c["id"]: c for c in plan.raw["analysis"]["criteria"]}
    assert (crit["dppo_masked_fraction"]["min"], crit["dppo_masked_fraction"]["max"]) == (0.001, 0.3)
    assert crit["ppo_counterfactual_clip_fraction"]["min"] == 0.0005
    assert crit["pooled_abs_drift_q90"]["min"] == 0.005
    fields = {d["field"] for d in plan.deviations}
    assert {"steps", "effective_batch", "endpoint", "evaluator"} <= fields
    assert check_original_plan(plan).sha256 == SPEC_SHA256


def _spec_raw():
    return json.loads(SPEC.read_text())


def _diag_raw():
    return json.loads(DIAG.read_text())


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r["activation_gate"]["checks"][2].__setitem__("min", "0.0005"),
     "activation_gate.checks[2].min: expected number, got str"),
    (lambda r: r["activation_gate"]["checks"][0].__setitem__("bogus", 1),
     "activation_gate.checks[0].bogus: unknown key"),
    (lambda r: r.__setitem__("extra_top", True), "extra_top: unknown key"),
    (lambda r: r["optimizer"].pop("lr"), "optimizer.lr: missing required key"),
    (lambda r: r.__setitem__("lora_rank", 32.0), "lora_rank: expected integer, got float"),
    (lambda r: r["experiment_features"].__setitem__("custom_loss", 1),
     "experiment_features.custom_loss: expected bool, got int"),
    (lambda r: r["arms"][1].__setitem__("lr", True), "arms[1].lr: expected number, got bool"),
    (lambda r: r["activation_gate"]["checks"][1].pop("min"),
     "activation_gate.checks[1]: expected at least one of"),
])
def test_malformed_spec_names_the_field(mutate, message):
    raw = _spec_raw()
    mutate(raw)
    with pytest.raises(PlanError) as e:
        parse_plan(_bytes(raw))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r["schedule"].pop("epochs"), "schedule.epochs: missing required key"),
    (lambda r: r["fixed_settings"]["optimizer"].__setitem__("momentum", 0.9),
     "fixed_settings.optimizer.momentum: unknown key"),
    (lambda r: r["analysis"]["criteria"][0].__setitem__("max", "0.3"),
     "analysis.criteria[0].max: expected number, got str"),
    (lambda r: r["schedule"].__setitem__("old_logprob_refresh", True),
     "schedule.old_logprob_refresh: expected false, got true"),
    (lambda r: r["schedule"].__setitem__("groups_per_minibatch", 5), "schedule.groups_per_minibatch: "),
    (lambda r: r["deviations"][0].__setitem__("field", "schedule"), "deviations[0].field: expected one of"),
    (lambda r: r["original_plan"].__setitem__("sha256", "abc"), "original_plan.sha256: expected a string matching"),
    (lambda r: r.__setitem__("kind", "full_training"), "kind: expected one of"),
    (lambda r: r["recording"]["sentinels"].__setitem__("after_updates", [0, 32]),
     "recording.sentinels.after_updates: an update index exceeds"),
])
def test_malformed_diagnostic_names_the_field(mutate, message):
    raw = _diag_raw()
    mutate(raw)
    with pytest.raises(PlanError) as e:
        parse_plan(_bytes(raw))
    assert str(e.value).startswith(message)


def test_invalid_json_and_non_finite_numbers(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "bounded_diagnostic",\n  "version": }')
    with pytest.raises(PlanError, match=r"bad.json: <root>: invalid JSON at line 2"):
        load_plan(bad)
    with pytest.raises(PlanError, match="non-finite number NaN"):
        parse_plan(b'{"lr": NaN}')
    with pytest.raises(PlanError, match="cannot read plan file"):
        load_plan(tmp_path / "missing.json")


def test_original_plan_hash_mismatch_is_refused(tmp_path):
    (tmp_path / "exp_e6b0965af3.json").write_bytes(SPEC.read_bytes().replace(b'"steps": 100', b'"steps": 101'))
    diag = load_plan(DIAG)
    with pytest.raises(PlanError, match="original_plan.sha256: recorded"):
        check_original_plan(diag, tmp_path)


def test_backend_deviations_local_and_tinker():
    plan = load_plan(DIAG)
    local = BackendInfo("local", constants.BASE_MODEL, "tiny-qwen3-gsm8k",
                        size_reductions=[{"field": "effective_batch", "original": "32 groups", "effective": "4 groups",
                                          "reason": "CPU rehearsal"}])
    devs = backend_deviations(plan, local)
    assert [d["field"] for d in devs] == ["model", "effective_batch"]
    assert "tiny-qwen3-gsm8k" in devs[0]["effective"] and devs[0]["original"] == constants.BASE_MODEL
    assert backend_deviations(plan, BackendInfo("tinker", constants.BASE_MODEL, constants.BASE_MODEL)) == []
    other = backend_deviations(plan, {"backend": "tinker", "requested_model": constants.BASE_MODEL,
                                      "served_model": "Qwen/Qwen3.5-4B"})
    assert other[0]["effective"] == "Qwen/Qwen3.5-4B"
    with pytest.raises(PlanError, match="size_reductions.field"):
        backend_deviations(plan, BackendInfo("local", "a", "b", size_reductions=[
            {"field": "size", "original": "1", "effective": "2", "reason": "r"}]))


def test_effective_config_carries_plan_hash_and_all_deviations():
    plan = load_plan(DIAG)
    cfg = effective_config(plan, BackendInfo("local", constants.BASE_MODEL, "tiny", sdk_versions={"tinker": "0.38.0"}))
    assert cfg["plan"] == {"name": plan.name, "kind": "bounded_diagnostic", "sha256": plan.sha256}
    assert cfg["config"]["steps"] == 16 and cfg["config"]["sequences_per_update"] == 32
    assert cfg["config"]["n_eval"] == 0 and cfg["config"]["max_tokens"] == 512
    assert len(cfg["deviations"]) == len(plan.deviations) + 1
    assert cfg["generation_audit"]["applicable"] is False
    json.dumps(cfg, allow_nan=False)
    spec_cfg = effective_config(load_plan(SPEC), BackendInfo("tinker", constants.BASE_MODEL, constants.BASE_MODEL))
    assert (spec_cfg["config"]["steps"], spec_cfg["config"]["batch_size"], spec_cfg["config"]["n_eval"]) == (100, 256, 1319)
    assert spec_cfg["deviations"] == []


def test_generation_audit_applicability_follows_features():
    plan = load_plan(SPEC)
    res = generation_audit_applicability(plan)
    assert res["applicable"] is False and res["status"] == "not_applicable"
    assert "generated_training_data is false" in res["reason"]
    raw = copy.deepcopy(plan.raw)
    raw["experiment_features"]["generated_training_data"] = True
    assert generation_audit_applicability(parse_plan(_bytes(raw)))["status"] == "required"
    raw["experiment_features"]["generated_training_data"] = False
    raw["generation_audit"]["required"] = True
    assert generation_audit_applicability(parse_plan(_bytes(raw)))["applicable"] is True
    diag = load_plan(DIAG)
    raw = copy.deepcopy(diag.raw)
    del raw["experiment_features"]["generated_training_data"]
    object.__setattr__(diag, "raw", raw)  # bypass schema: a missing feature must stay unknown
    assert generation_audit_applicability(diag)["status"] == "unknown"

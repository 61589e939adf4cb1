"""Plan loading/validation: shipped plans, malformed plans, deviations, effective config."""

import copy
import json
from pathlib import Path

import pytest

from dppo_harness import constants
from dppo_harness.evidence.backend import Backend, backend_deviations
from dppo_harness.evidence.session import effective_config
from dppo_harness.loss.loss_registry import DPPO_LOSS, get_loss
from dppo_harness.plans import PlanError, load_plan, parse_plan
from dppo_harness.plans.plan import generation_audit_applicability

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
        "dppo_masked_token_fraction",
        "policy_drift_abs_p_q90",
        "grpo_clip_fraction",
        "executed_updates_per_batch",
        "executed_base_model",
    ]
    assert raw["budget"] == {"gpu_hours": 2.0, "max_wall_minutes": 120}
    assert raw["experiment_features"]["generated_training_data"] is False
    assert "kind" not in raw  # verbatim: the saved spec has no kind field


def test_diagnostic_plan_validates_and_pins_its_settings():
    plan = load_plan(DIAG)
    assert plan.kind == "bounded_diagnostic"
    fs, sch = plan.raw["fixed_settings"], plan.raw["schedule"]
    assert fs["base_model"] == constants.BASE_MODEL and fs["lora_rank"] == 32 and fs["seed"] == 0
    assert fs["treatment"]["delta"] == get_loss(DPPO_LOSS).params["dppo_delta"]  # the rule's delta is the plan's
    assert fs["treatment"]["ratio_cap"] == constants.DPPO_RATIO_CAP
    assert fs["counterfactual_baseline"]["ppo_eps"] == constants.PPO_EPS
    assert fs["sampling"]["renderer"] == constants.RENDERER_NAME
    assert fs["optimizer"] == {
        "name": "adamw",
        "learning_rate": 2e-5,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
    assert fs["loss_normalization"]["mode"] == "token_mean"
    assert (
        sch["groups_per_batch"],
        sch["group_size"],
        sch["minibatches_per_epoch"],
        sch["groups_per_minibatch"],
        sch["epochs"],
        sch["max_optimizer_updates"],
    ) == (32, 8, 8, 4, 2, 16)
    assert plan.raw["recording"]["sentinels"]["after_updates"] == [0, 1, 2, 4, 8, 16]
    assert plan.budget == {"gpu_hours": 2.0, "max_wall_minutes": 12.0}
    assert plan.raw["original_hypothesis_tested"] is False and plan.raw["tested_instead"]
    crit = {c["id"]: c for c in plan.raw["analysis"]["criteria"]}
    assert (crit["dppo_masked_fraction"]["min"], crit["dppo_masked_fraction"]["max"]) == (0.001, 0.3)
    assert crit["ppo_counterfactual_clip_fraction"]["min"] == 0.0005
    assert crit["pooled_abs_drift_q90"]["min"] == 0.005
    fields = {d["field"] for d in plan.deviations}
    assert {"steps", "effective_batch", "endpoint", "evaluator"} <= fields
    assert plan.original.sha256 == SPEC_SHA256


def _spec_raw():
    return json.loads(SPEC.read_text())


def _diag_raw():
    return json.loads(DIAG.read_text())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda r: r["activation_gate"]["checks"][2].__setitem__("min", "0.0005"),
            "activation_gate.checks[2].min: expected number, got str",
        ),
        (
            lambda r: r["activation_gate"]["checks"][0].__setitem__("bogus", 1),
            "activation_gate.checks[0].bogus: unknown key",
        ),
        (lambda r: r.__setitem__("extra_top", True), "extra_top: unknown key"),
        (lambda r: r["optimizer"].pop("lr"), "optimizer.lr: missing required key"),
        (lambda r: r.__setitem__("lora_rank", 32.0), "lora_rank: expected integer, got float"),
        (
            lambda r: r["experiment_features"].__setitem__("custom_loss", 1),
            "experiment_features.custom_loss: expected bool, got int",
        ),
        (lambda r: r["arms"][1].__setitem__("lr", True), "arms[1].lr: expected number, got bool"),
        (lambda r: r["activation_gate"]["checks"][1].pop("min"), "activation_gate.checks[1]: expected at least one of"),
    ],
)
def test_malformed_spec_names_the_field(mutate, message):
    raw = _spec_raw()
    mutate(raw)
    with pytest.raises(PlanError) as e:
        parse_plan(_bytes(raw))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r["schedule"].pop("epochs"), "schedule.epochs: missing required key"),
        (
            lambda r: r["fixed_settings"]["optimizer"].__setitem__("momentum", 0.9),
            "fixed_settings.optimizer.momentum: unknown key",
        ),
        (
            lambda r: r["analysis"]["criteria"][0].__setitem__("max", "0.3"),
            "analysis.criteria[0].max: expected number, got str",
        ),
        (
            lambda r: r["schedule"].__setitem__("old_logprob_refresh", True),
            "schedule.old_logprob_refresh: expected false, got true",
        ),
        (lambda r: r["schedule"].__setitem__("groups_per_minibatch", 5), "schedule.groups_per_minibatch: "),
        (lambda r: r["deviations"][0].__setitem__("field", "schedule"), "deviations[0].field: expected one of"),
        (lambda r: r["original_plan"].__setitem__("sha256", "abc"), "original_plan.sha256: expected a string matching"),
        (lambda r: r.__setitem__("kind", "full_training"), "kind: expected one of"),
        (
            lambda r: r["recording"]["sentinels"].__setitem__("after_updates", [0, 32]),
            "recording.sentinels.after_updates: an update index exceeds",
        ),
    ],
)
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
    (tmp_path / "exp_e6b0965af3.json").write_bytes(SPEC.read_bytes().replace(b'"gpu_hours": 2.0', b'"gpu_hours": 2.5'))
    resolution = SPEC.name + ".resolution.json"
    (tmp_path / resolution).write_bytes((PLANS / resolution).read_bytes())
    (tmp_path / DIAG.name).write_bytes(DIAG.read_bytes())  # its original is the one beside it
    with pytest.raises(PlanError, match="original_plan.sha256: recorded"):
        load_plan(tmp_path / DIAG.name)


def test_backend_deviations_local_and_tinker():
    plan = load_plan(DIAG)
    devs = backend_deviations(
        plan, Backend(kind="local", requested_model=constants.BASE_MODEL, served_model="tiny-qwen3-gsm8k")
    )
    assert [d["field"] for d in devs] == ["model"]
    assert "tiny-qwen3-gsm8k" in devs[0]["effective"] and devs[0]["original"] == constants.BASE_MODEL
    assert (
        backend_deviations(
            plan, Backend(kind="tinker", requested_model=constants.BASE_MODEL, served_model=constants.BASE_MODEL)
        )
        == []
    )
    other = backend_deviations(
        plan, Backend(kind="tinker", requested_model=constants.BASE_MODEL, served_model="Qwen/Qwen3.5-4B")
    )
    assert other[0]["effective"] == "Qwen/Qwen3.5-4B"


def test_effective_config_carries_plan_hash_and_all_deviations():
    plan = load_plan(DIAG)
    cfg = effective_config(
        plan,
        Backend(
            kind="local", requested_model=constants.BASE_MODEL, served_model="tiny", sdk_versions={"tinker": "0.38.0"}
        ),
    )
    assert cfg["plan"] == {
        "name": plan.name,
        "kind": "bounded_diagnostic",
        "sha256": plan.sha256,
        "launch": plan.raw["launch"],
    }
    assert cfg["config"]["steps"] == 16 and cfg["config"]["sequences_per_update"] == 32
    assert cfg["config"]["n_eval"] == 0 and cfg["config"]["max_tokens"] == 512
    assert len(cfg["deviations"]) == len(plan.deviations) + 1
    assert cfg["generation_audit"]["applicable"] is False
    json.dumps(cfg, allow_nan=False)
    spec_cfg = effective_config(
        load_plan(SPEC), Backend(kind="tinker", requested_model=constants.BASE_MODEL, served_model=constants.BASE_MODEL)
    )
    assert (spec_cfg["config"]["steps"], spec_cfg["config"]["batch_size"], spec_cfg["config"]["n_eval"]) == (
        100,
        256,
        1319,
    )
    assert spec_cfg["deviations"] == []


def test_generation_audit_applicability_follows_features():
    plan = load_plan(SPEC)
    res = generation_audit_applicability(plan)
    assert res["applicable"] is False and res["status"] == "not_applicable"
    assert "generated_training_data is false" in res["reason"]
    raw = copy.deepcopy(plan.raw)
    raw["experiment_features"]["generated_training_data"] = True
    assert generation_audit_applicability(parse_plan(_bytes(raw), SPEC))["status"] == "required"
    raw["experiment_features"]["generated_training_data"] = False
    raw["generation_audit"]["required"] = True
    assert generation_audit_applicability(parse_plan(_bytes(raw), SPEC))["applicable"] is True
    del raw["experiment_features"]["generated_training_data"]  # the schema requires every feature
    with pytest.raises(PlanError, match="experiment_features.generated_training_data: missing required key"):
        parse_plan(_bytes(raw))


# ---- rehearsal plans (kind "rehearsal", CONTRACTS.md "Rehearsal plans") ----------------------

LOCAL_MODEL = "local/tiny-qwen3-gsm8k"


SHIPPED = PLANS / "rehearsal" / "comparison-local.json"


def _rehearsal(tmp_path, mutate=None):
    """The shipped rehearsal of the saved spec (3 rollout steps x 4 groups, 50 test items, lr 1e-2)
    and its resolution file, copied under a scratch repo and changed by `mutate`; returns its path."""
    (tmp_path / "plans" / "rehearsal").mkdir(parents=True, exist_ok=True)
    (tmp_path / "plans" / SPEC.name).write_bytes(SPEC.read_bytes())
    path = tmp_path / "plans" / "rehearsal" / "comparison-local.json"
    resolution = SHIPPED.name + ".resolution.json"
    (path.parent / resolution).write_bytes((SHIPPED.parent / resolution).read_bytes())
    raw = json.loads(SHIPPED.read_text())
    assert raw["derived_from"] == {"path": f"plans/{SPEC.name}", "sha256": SPEC_SHA256}
    if mutate:
        mutate(raw)
    path.write_text(json.dumps(raw, indent=2))
    return path


def test_rehearsal_plan_loads_and_exposes_its_spec(tmp_path):
    plan = load_plan(_rehearsal(tmp_path))
    assert plan.kind == "rehearsal" and plan.spec["steps"] == 6 and plan.spec["base_model"] == LOCAL_MODEL
    assert plan.base_model == LOCAL_MODEL and plan.budget == {"gpu_hours": 2.0, "max_wall_minutes": 120.0}
    devs = {d["original"].split(" = ")[0]: d["field"] for d in plan.deviations}
    assert devs["steps"] == "steps" and devs["batch_size"] == "effective_batch" and devs["base_model"] == "model"
    assert devs["eval.n_examples"] == "evaluator" and devs["optimizer.lr"] == "objective"
    cfg = effective_config(plan, Backend(kind="local", requested_model=LOCAL_MODEL, served_model=LOCAL_MODEL))
    assert cfg["plan"]["kind"] == "rehearsal" and cfg["plan"]["label"] == "rehearsal"
    assert cfg["plan"]["derived_from"]["sha256"] == SPEC_SHA256
    assert (cfg["config"]["steps"], cfg["config"]["batch_size"], cfg["config"]["n_eval"]) == (6, 32, 50)
    # given as bytes, it needs the repo root to find the derived-from spec, and a path to find its
    # resolution file
    again = parse_plan(plan.data, plan.path, repo_root=tmp_path)
    assert again.sha256 == plan.sha256
    with pytest.raises(PlanError, match="derived_from.path: a rehearsal given as bytes needs repo_root"):
        parse_plan(plan.data)
    with pytest.raises(PlanError, match=r"^<plan file>.resolution.json: no such file beside the plan"):
        parse_plan(plan.data, repo_root=tmp_path)


def _add_difference(field, spec, rehearsal):
    return lambda r: r["differences"].append({"field": field, "spec": spec, "rehearsal": rehearsal, "reason": "r"})


@pytest.mark.parametrize(
    "mutate, message",
    [
        # an undeclared difference
        (
            lambda r: r["spec"].__setitem__("max_seq_len", 512),
            "spec.max_seq_len: differs from plans/exp_e6b0965af3.json (1024 -> 512) but is not listed in differences",
        ),
        # a phantom difference (listed, but both specs agree)
        (_add_difference("lora_rank", 32, 32), "differences[11]: 'lora_rank' does not differ"),
        # a gate threshold changed (even when declared)
        (
            lambda r: (
                r["spec"]["activation_gate"]["checks"][0].__setitem__("min", 0.01),
                _add_difference("activation_gate.checks[0].min", 0.001, 0.01)(r),
            ),
            "spec.activation_gate.checks[0].min: a rehearsal keeps the spec's gates and thresholds",
        ),
        (
            lambda r: (
                r["spec"]["arms"][1].__setitem__("loss", "grpo_clip_eps0.2"),
                _add_difference("arms[1].loss", "dppo_divergence_mask", "grpo_clip_eps0.2")(r),
            ),
            "spec.arms[1].loss: a rehearsal keeps",
        ),
        (lambda r: r["spec"]["decision_rule"].__setitem__("alpha", 0.5), "spec.decision_rule.alpha: a rehearsal keeps"),
        # the restoration learning rate may only follow optimizer.lr
        (
            lambda r: r["spec"]["restoration_preflight"]["groups"][0]["arms"][0]["optimizer_config"].__setitem__(
                "learning_rate", 0.5
            ),
            "spec.restoration_preflight.groups[0].arms[0].optimizer_config.learning_rate: ",
        ),
        # a wrong derived_from sha256
        (lambda r: r["derived_from"].__setitem__("sha256", "0" * 64), "derived_from.sha256: recorded 0000"),
        # declared values that do not match the specs
        (lambda r: r["differences"][2].__setitem__("spec", 99), "differences[2].spec: expected 100"),
        (lambda r: r["differences"][2].__setitem__("rehearsal", 5), "differences[2].rehearsal: expected 6"),
        (lambda r: r["differences"][0].__setitem__("reason", " "), "differences[0].reason: expected a string matching"),
        (_add_difference("no_such.key", 1, 2), "differences[11].field: 'no_such.key' is not a field of both specs"),
        (lambda r: r["spec"].__setitem__("lora_rank", "32"), "spec.lora_rank: expected integer, got str"),
        (lambda r: r.__setitem__("label", "comparison"), "label: expected one of"),
        (
            lambda r: r["derived_from"].__setitem__("path", "plans/missing.json"),
            "derived_from.path: plans/missing.json",
        ),
    ],
)
def test_malformed_rehearsal_names_the_field(tmp_path, mutate, message):
    with pytest.raises(PlanError) as e:
        load_plan(_rehearsal(tmp_path, mutate))
    assert str(e.value).split(": ", 1)[1].startswith(message), str(e.value)


def test_rehearsal_list_length_change_must_be_declared_at_the_list(tmp_path):
    def drop_seed(r):
        r["spec"]["decision_rule"]["seeds"] = r["spec"]["decision_rule"]["seeds"][:0]

    with pytest.raises(PlanError, match=r"spec\.decision_rule\.seeds"):
        load_plan(_rehearsal(tmp_path, drop_seed))

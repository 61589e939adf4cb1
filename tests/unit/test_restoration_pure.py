"""Pure helpers of the restoration preflight: hashes, comparisons, optimizer checks, provenance."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import tinker

from dppo_harness.loss.correctness import lr_scaling_error
from dppo_harness.plans import load_plan
from dppo_harness.stages import restoration
from dppo_harness.stages.restoration import (
    LrScalingMeasured,
    LrScalingUnavailable,
    attach_lr_scaling,
    check_provenance,
    reference_completion,
    reweighted,
)
from dppo_harness.stages.write import LR_SCALING_FILE
from dppo_harness.train.clients import RestorationError, datum_arrays, make_datum
from dppo_harness.train.fingerprints import batch_sha256, compare_logprobs, logprobs_sha256
from dppo_harness.train.optimizer_checks import echoed_config, optimizer_check, server_optimizer_family


def _batch() -> list[tinker.Datum]:
    return [make_datum([1, 2, 3], [4, 5]), make_datum([7, 8], [9, 10, 11])]


def test_make_datum_shifts_and_weights_completion_only():
    d = make_datum([1, 2, 3], [4, 5])
    tokens_T, targets_T, mask_T = datum_arrays(d)
    assert tokens_T.tolist() == [1, 2, 3, 4]
    assert targets_T.tolist() == [2, 3, 4, 5]
    assert mask_T.tolist() == [0.0, 0.0, 1.0, 1.0]  # targets 4 and 5 are the completion
    with pytest.raises(ValueError, match="non-empty completion"):
        make_datum([1, 2], [])


def test_batch_sha256_is_stable_and_sensitive_to_tokens_targets_and_mask():
    h = batch_sha256(_batch())
    assert h == batch_sha256(_batch())
    assert len(h) == 64
    changed_token = [make_datum([1, 2, 6], [4, 5]), _batch()[1]]
    assert batch_sha256(changed_token) != h
    d = _batch()[0]
    _tokens_T, targets_T, _mask_T = datum_arrays(d)
    other_mask = tinker.Datum(
        model_input=d.model_input,
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(targets_T),
            "weights": tinker.TensorData.from_numpy(np.array([0, 1, 1, 1], dtype=np.float32)),
        },
    )
    assert batch_sha256([other_mask, _batch()[1]]) != h
    # Splitting the same tokens differently across datums must not collide.
    assert batch_sha256([make_datum([1, 2, 3], [4, 5])]) != batch_sha256(
        [make_datum([1, 2], [3]), make_datum([4], [5])]
    )


def test_datum_arrays_rejects_missing_mask_and_length_mismatch():
    no_mask = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": tinker.TensorData.from_numpy(np.array([2, 3]))},
    )
    with pytest.raises(ValueError, match="neither 'mask' nor 'weights'"):
        batch_sha256([no_mask])
    short = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.array([2, 3])),
            "weights": tinker.TensorData.from_numpy(np.ones(2, dtype=np.float32)),
        },
    )
    with pytest.raises(ValueError, match="lengths differ"):
        batch_sha256([short])


def test_logprobs_sha256_detects_one_ulp():
    lp = [np.array([-1.5, -0.25], dtype=np.float32), np.array([-3.0], dtype=np.float32)]
    h = logprobs_sha256(lp)
    assert h == logprobs_sha256([x.copy() for x in lp])
    bumped = [np.nextafter(lp[0], np.float32(0)), lp[1]]
    assert logprobs_sha256(bumped) != h
    assert logprobs_sha256([x.astype(np.float64) for x in lp]) != h  # precision is part of the hash


def test_compare_logprobs_bitwise_tolerance_and_failures():
    a = [np.array([-1.0, -2.0], dtype=np.float32)]
    same = compare_logprobs(a, [a[0].copy()])
    assert same["bitwise_equal"] and same["within_tolerance"] and same["max_abs_diff"] == 0.0
    near = compare_logprobs(a, [a[0] + np.float32(5e-7)])
    assert not near["bitwise_equal"] and near["within_tolerance"]
    far = compare_logprobs(a, [a[0] + np.float32(2e-6)])
    assert not far["within_tolerance"] and far["max_abs_diff"] > 1e-6
    assert not compare_logprobs(a, [np.array([-1.0], dtype=np.float32)])["within_tolerance"]
    assert not compare_logprobs(a, a + a)["within_tolerance"]
    assert not compare_logprobs(a, [np.array([np.nan, -2.0], dtype=np.float32)])["within_tolerance"]


def _info(**extra) -> tinker.types.GetInfoResponse:
    """get_info as tinker 0.25's SDK hands it over (its GetInfoResponse drops `optimizer_config`)."""
    return tinker.types.GetInfoResponse.model_validate(_raw_info(**extra))


def _raw_info(**extra) -> dict:
    """get_info's JSON as the server sent it: the only place a 0.25 client can see `optimizer_config`."""
    return {"model_data": {"model_name": "Qwen/Qwen3.5-2B"}, "model_id": "m1", **extra}


def test_server_optimizer_family_only_from_what_the_server_sent():
    assert server_optimizer_family(_raw_info()) is None  # nothing sent: not evidence
    assert server_optimizer_family(_raw_info(optimizer_config={"type": "adamw"})) == "adamw"
    assert server_optimizer_family(_raw_info(optimizer_config={"version": 1})) is None  # no family named
    assert server_optimizer_family(None) is None


def test_server_optimizer_family_from_an_sdk_get_info_is_declared():
    """tinker 0.25's GetInfoResponse has no optimizer_config field: even when the server sent one,
    the SDK response carries nothing, so the family stays unknown (declared), never a default."""
    sent = _info(optimizer_config={"type": "adamw"})
    assert not hasattr(sent, "optimizer_config")
    assert server_optimizer_family(sent) is None
    assert server_optimizer_family(_info()) is None
    check = optimizer_check(
        after_restore=0,
        requested_optimizer="adam",
        requested_config=REQ,
        info=sent,
        info_ref="x#info",
        echoed=dict(REQ),
        echo_ref="x#opt",
        echo_observed_on="probe",
    )
    assert check["actual_optimizer"] is None and check["actual_optimizer_source"] == "declared"
    assert not check["verified"] and check["matches"]
    assert "optimizer family not exposed by any server response" in check["unverified_reasons"]


REQ = {"learning_rate": 2e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def test_optimizer_check_verified_only_with_full_server_evidence():
    ok = optimizer_check(
        after_restore=0,
        requested_optimizer="adam",
        requested_config=REQ,
        info=_raw_info(optimizer_config={"type": "adamw"}),
        info_ref="x#info",
        echoed=dict(REQ),
        echo_ref="x#opt",
        echo_observed_on="probe",
    )
    assert ok["verified"] and ok["matches"] and ok["actual_optimizer"] == "adamw"
    assert ok["actual_config"] == REQ and ok["before_next_update"] is True

    declared = optimizer_check(
        after_restore=1,
        requested_optimizer="adam",
        requested_config=REQ,
        info=_info(),
        info_ref="x#info",
        echoed=None,
        echo_ref=None,
        echo_observed_on=None,
    )
    assert declared["source"] == "declared" and declared["actual_config"] is None
    assert declared["actual_optimizer"] is None and not declared["verified"]

    partial = optimizer_check(
        after_restore=1,
        requested_optimizer="adam",
        requested_config=REQ,
        info=_raw_info(optimizer_config={"type": "adamw"}),
        info_ref="x#info",
        echoed={"learning_rate": 2e-5},
        echo_ref="x#opt",
        echo_observed_on="probe",
    )
    assert not partial["verified"] and partial["matches"]
    assert any("beta1" in u for u in partial["unverified_reasons"])


def test_optimizer_check_reports_mismatches():
    wrong_lr = optimizer_check(
        after_restore=0,
        requested_optimizer="adam",
        requested_config=REQ,
        info=_raw_info(optimizer_config={"type": "adamw"}),
        info_ref="i",
        echoed={**REQ, "learning_rate": 1e-4},
        echo_ref="o",
        echo_observed_on="p",
    )
    assert not wrong_lr["matches"] and not wrong_lr["verified"]
    assert "learning_rate" in wrong_lr["mismatches"][0]
    wrong_family = optimizer_check(
        after_restore=0,
        requested_optimizer="adam",
        requested_config=REQ,
        info=_raw_info(optimizer_config={"type": "dimuon", "version": 1}),
        info_ref="i",
        echoed=dict(REQ),
        echo_ref="o",
        echo_observed_on="p",
    )
    assert not wrong_family["matches"] and "family" in wrong_family["mismatches"][0]


def test_echoed_config_reads_the_embedded_servers_names():
    metrics = {"optim/learning_rate": 2e-5, "optim/beta1": 0.9, "beta2:mean": 0.95, "loss:sum": 1.0}
    assert echoed_config(metrics, list(REQ)) == {"learning_rate": 2e-5, "beta1": 0.9}
    assert echoed_config(None, list(REQ)) == {}


def test_lr_scaling_error():
    good = [
        {"learning_rate": 1e-5, "update_norm": 0.1},
        {"learning_rate": 2e-5, "update_norm": 0.2},
        {"learning_rate": 4e-5, "update_norm": 0.4000001},
    ]
    assert max(lr_scaling_error(good)) < 1e-5
    flat = [{"learning_rate": 1e-5, "update_norm": 0.1}, {"learning_rate": 2e-5, "update_norm": 0.1}]
    assert lr_scaling_error(flat)[1] == pytest.approx(0.5)
    assert lr_scaling_error([{"learning_rate": 1e-5, "update_norm": 0.0}]) == [float("inf")]


def _entry(loaded="tinker://a/weights/init", adapter_sha256=None, **init) -> dict:
    """An arm's initialization_provenance entry in the shape the preflight writes."""
    checks = [
        optimizer_check(
            after_restore=i,
            requested_optimizer="adam",
            requested_config=REQ,
            info=_raw_info(optimizer_config={"type": "adamw"}),
            info_ref="i",
            echoed=dict(REQ),
            echo_ref="o",
            echo_observed_on="p",
        )
        for i in (0, 1)
    ]
    initialization = {
        "checkpoint_uri": "tinker://a/weights/init",
        "checkpoint_immutable": True,
        "loaded_checkpoint_uri": loaded,
        **init,
    }
    if adapter_sha256 is not None:
        initialization["adapter_sha256"] = adapter_sha256
    return {"initialization": initialization, "restore_count": 1, "optimizer_checks": checks}


def test_check_provenance_accepts_a_shared_proof():
    assert check_provenance({"a": _entry(), "b": _entry()}) == []


@pytest.mark.parametrize(
    "b_entry, expected",
    [
        (lambda: _entry(loaded="tinker://a/weights/elsewhere"), "server loaded"),
        (lambda: _entry(loaded="tinker://a/weights/elsewhere"), "do not share one loaded checkpoint"),
        (lambda: _entry(loaded=None), "no loaded checkpoint URI"),
        (lambda: _entry(checkpoint_immutable=False), "not shown immutable"),
        (lambda: _entry(adapter_sha256="d" * 64), None),  # one-sided hash: nothing to compare
    ],
)
def test_check_provenance_failures(b_entry, expected):
    failures = check_provenance({"a": _entry(), "b": b_entry()})
    if expected is None:
        assert failures == []
    else:
        assert any(expected in f for f in failures), failures


def test_check_provenance_flags_hash_and_optimizer_mismatch():
    hashed = {"a": _entry(adapter_sha256="1" * 64), "b": _entry(adapter_sha256="2" * 64)}
    assert any("adapter_sha256 differ" in f for f in check_provenance(hashed))
    bad_opt = _entry()
    bad_opt["optimizer_checks"][1] = copy.deepcopy(bad_opt["optimizer_checks"][1])
    bad_opt["optimizer_checks"][1]["mismatches"] = ["learning_rate: requested 2e-05, server applied 0.001"]
    assert any("optimizer mismatch" in f for f in check_provenance({"a": _entry(), "b": bad_opt}))


def test_reweighted_is_a_fixed_gradient_selection():
    batch = _batch()
    even = reweighted(batch, 2.0, lambda i: i % 2 == 0)
    assert datum_arrays(even[0])[2].tolist() == [0.0, 0.0, 2.0, 2.0]
    assert datum_arrays(even[1])[2].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_reference_completion_boxes_the_final_answer():
    sol = "He has 3+4=<<3+4=7>>7 apples.\n#### 7"
    assert reference_completion(sol, "7") == "He has 3+4=7 apples. \\boxed{7}"


def test_restoration_arms_requires_one_group_of_two():
    spec = load_plan(Path(__file__).parents[2] / "plans" / "exp_e6b0965af3.json").experiment
    assert [a.name for a in restoration.restoration_arms(spec)] == ["grpo_seed0", "dppo_seed0"]
    rp = spec.restoration_preflight
    one = rp.model_copy(update={"groups": [rp.groups[0].model_copy(update={"arms": rp.groups[0].arms[:1]})]})
    with pytest.raises(RestorationError, match="at least two arms"):
        restoration.restoration_arms(spec.model_copy(update={"restoration_preflight": one}))
    with pytest.raises(RestorationError, match="no applicable"):
        restoration.restoration_arms(
            spec.model_copy(update={"restoration_preflight": rp.model_copy(update={"applicable": False})})
        )


def test_attach_lr_scaling_fills_or_explains():
    block = {"required": True, "paths": [{"id": "p", "lr_scaling": []}]}
    measured = LrScalingMeasured(
        passed=True,
        rtol=0.05,
        relative_error=[0.0, 1e-9],
        measure="m",
        reset="r",
        lr_scaling=[{"learning_rate": 1e-5, "update_norm": 0.1}, {"learning_rate": 2e-5, "update_norm": 0.2}],
    )
    out = attach_lr_scaling(block, measured)
    assert out["paths"][0]["lr_scaling"] == measured.lr_scaling
    assert out["paths"][0]["lr_scaling_status"]["available"] is True
    assert block["paths"][0]["lr_scaling"] == []  # input untouched
    missing = attach_lr_scaling(block, LrScalingUnavailable("no parameters over the API", [2e-5]))
    # Never an empty list: the brief's block says each planned LR is unmeasured, and why.
    assert missing["paths"][0]["lr_scaling"] == [
        {"learning_rate": 2e-5, "update_norm": None, "available": False, "reason": "no parameters over the API"}
    ]
    assert missing["paths"][0]["lr_scaling_status"] == {
        "available": False,
        "evidence_ref": LR_SCALING_FILE,
        "reason": "no parameters over the API",
    }


def test_probe_and_lr_records_write_the_evidence_dicts_key_for_key():
    import dataclasses

    from dppo_harness.stages.restoration import RestoreProbeResult

    cmp = {"bitwise_equal": True, "max_abs_diff": 0.0, "within_tolerance": True, "atol": 1e-4}
    probe = RestoreProbeResult(
        initial_checkpoint="tinker://m/weights/a",
        mid_checkpoint="tinker://m/weights/b",
        loaded_checkpoint_uri=None,
        adam_params={"learning_rate": 1e-5},
        restored_vs_uninterrupted=cmp,
        second_update_effect=cmp,
        optim_metrics={"update1": {}, "update2_uninterrupted": {}, "update2_restored": {}},
        echoed_config={},
        echo_ref="r#x",
        base_lr_update_norm=None,
        failures=[],
    )
    keys = [
        "initial_checkpoint",
        "mid_checkpoint",
        "loaded_checkpoint_uri",
        "updates",
        "adam_params",
        "restored_vs_uninterrupted",
        "second_update_effect",
        "optim_metrics",
        "echoed_config",
        "echo_ref",
        "echo_observed_on",
        "uninterrupted_client",
        "base_lr_update_norm",
        "failures",
    ]
    assert list(probe.to_json()) == keys
    probe.own_config_probes = {"b": dataclasses.replace(probe)}
    assert list(probe.to_json()) == [*keys, "own_config_probes"]
    assert LrScalingUnavailable("why", [1e-5]).to_json() == {
        "available": False,
        "reason": "why",
        "learning_rates": [1e-5],
        "lr_scaling": [],
        "passed": None,
    }
    measured = LrScalingMeasured(
        lr_scaling=[{"learning_rate": 1e-5, "update_norm": 0.1}],
        passed=True,
        rtol=0.05,
        relative_error=[0.0],
        measure="m",
        reset="r",
        gradient="g",
    )
    assert list(measured.to_json().items()) == [
        ("available", True),
        ("measure", "m"),
        ("reset", "r"),
        ("gradient", "g"),
        ("lr_scaling", [{"learning_rate": 1e-5, "update_norm": 0.1}]),
        ("relative_error", [0.0]),
        ("rtol", 0.05),
        ("passed", True),
        ("problem", None),
    ]


def test_a_restore_counts_as_observed_only_when_the_service_names_the_path_asked_for(monkeypatch):
    """`train.restore`: the one observed restore every stage uses; a load response without the path,
    or naming another one, is reported in one line."""
    from types import SimpleNamespace

    from tinker import types

    from dppo_harness.train import restore as restore_module

    init, info = "tinker://m/weights/initial", types.GetInfoResponse.model_construct(model_id="m")
    client = SimpleNamespace(get_info=lambda: info)
    asked = []

    def create(sc, path, name):
        asked.append((path, name))
        return client, types.LoadWeightsResponse(path=loaded)

    monkeypatch.setattr(restore_module, "create_from_state_with_response", create)
    loaded = init
    restored = restore_module.restore(object(), init, "dppo_seed0")
    assert asked == [(init, "dppo_seed0")] and restored.client is client and restored.info is info
    assert restored.mismatch() is None and restored.seconds >= 0
    record = restored.record()
    assert record["loaded_checkpoint_uri"] == record["initial_checkpoint"] == init and record["before_first_update"]
    loaded = None
    assert "its response has no path" in restore_module.restore(object(), init, "a").mismatch()
    loaded = "tinker://m/weights/other"
    assert restore_module.restore(object(), init, "a").mismatch() == f"the load of {init} loaded {loaded!r}"

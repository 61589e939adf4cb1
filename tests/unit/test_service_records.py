"""The typed records service/ and train/ hand to other packages serialise key for key as the
dicts they replace did (same keys, same order, same null-vs-absent)."""

import json
from types import SimpleNamespace

from dppo_harness.service.connectivity import ConnectivityReport
from dppo_harness.stages.write import CONNECTIVITY_FILE, write_connectivity
from dppo_harness.train.fingerprints import compare_logprobs
from dppo_harness.train.optimizer_checks import OptimizerCheck, optimizer_check, own_response_only


def test_connectivity_evidence_keeps_its_keys_in_order():
    report = ConnectivityReport(
        "tinker",
        "https://x.invalid/api",
        "Qwen/Qwen3.5-2B",
        "Qwen/Qwen3.5-2B",
        ["Qwen/Qwen3.5-2B"],
        None,
        None,
        {"supported_models": []},
        {"sdk": "tinker 0.25.0"},
        [{"check": "variables", "passed": True, "detail": "set"}],
        1.23456,
    )
    files: dict[str, object] = {}
    bundle = SimpleNamespace(result={}, register_json=lambda name, kind, obj: files.update({name: obj}))
    write_connectivity(bundle, report, "tinker")  # type: ignore[arg-type]  # records the file only
    assert json.dumps(files[CONNECTIVITY_FILE]) == json.dumps(
        {
            "backend": "tinker",
            "base_url": "https://x.invalid/api",
            "requested_model": "Qwen/Qwen3.5-2B",
            "model": "Qwen/Qwen3.5-2B",
            "served_models": ["Qwen/Qwen3.5-2B"],
            "substitution": None,
            "embedded_server": None,
            "get_server_capabilities": {"supported_models": []},
            "first_contact": {"sdk": "tinker 0.25.0"},  # client/config, dynamic_config, deployments as sent
            "checks": [{"check": "variables", "passed": True, "detail": "set"}],
            "seconds": 1.235,
        }
    )


def test_optimizer_check_keeps_its_keys_in_order_and_probe_reduction_appends_nothing():
    check = optimizer_check(
        after_restore=1,
        requested_optimizer="adam",
        requested_config={"learning_rate": 1e-4},
        info=None,
        info_ref="r.json#info",
        echoed={"learning_rate": 1e-4},
        echo_ref="r.json#echo",
        echo_observed_on="the probe client's optim_step",
    )
    assert list(check) == list(OptimizerCheck.__annotations__)
    reduced = own_response_only(check)
    assert list(reduced) == list(check) and reduced["actual_config"] is None and reduced["verified"] is False


def test_logprob_comparison_names_a_problem_only_when_there_is_one():
    assert list(compare_logprobs([[0.0]], [[0.0]])) == ["bitwise_equal", "max_abs_diff", "within_tolerance", "atol"]
    assert compare_logprobs([[0.0]], [])["problem"] == "datum count differs: 1 vs 0"

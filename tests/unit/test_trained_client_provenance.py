"""Issue 11 point 4: provenance covers the client that trained (one more restore, an optimizer check
from its OWN response, its own initial output); probe-echoed configs stay declared for other checks."""

from dppo_harness.stages.diagnostic import write
from dppo_harness.train.optimizer_checks import echoed_config, optimizer_check

REQ = {"learning_rate": 2e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def _probe_check(n):
    return optimizer_check(
        after_restore=n,
        requested_optimizer="adam",
        requested_config=REQ,
        info=None,
        info_ref="responses#get_info",
        echoed=REQ,
        echo_ref="responses#probe_optim_step_1",
        echo_observed_on="probe client created from the initial checkpoint (optim_step response metrics)",
    )


PRIOR = {
    "initialization": {
        "checkpoint_uri": "tinker://m:train:0/weights/init",
        "loaded_checkpoint_uri": "tinker://m:train:0/weights/init",
        "load_succeeded": True,
        "base_checkpoint": "Qwen/Qwen3.5-2B",
    },
    "restore_count": 1,
    "optimizer_checks": [_probe_check(0), _probe_check(1)],
    "initial_output": {"available": True, "output_sha256": "a" * 64},
}


def test_trained_client_gets_its_own_restore_check_and_initial_output():
    own_metrics = {
        "optim/learning_rate": 2e-5,
        "optim/beta1": 0.9,
        "optim/beta2": 0.95,
        "optim/eps": 1e-8,
        "optim/weight_decay": 0.0,
        "optim/grad_clip_norm": 0.0,
    }
    own = optimizer_check(
        after_restore=0,
        requested_optimizer="adam",
        requested_config=REQ,
        info=None,
        info_ref="a#get_info",
        echoed=echoed_config(own_metrics, list(REQ)),
        echo_ref="a#optim_1",
        echo_observed_on="the trained client's own optim_step response of update 1",
    )
    init_out = {
        "available": True,
        "batch_sha256": "b" * 64,
        "output_sha256": "a" * 64,
        "evidence_ref": "x",
        "before_first_update": True,
    }
    e = write.trained_client_entry(
        PRIOR,
        restore={"loaded_checkpoint_uri": "tinker://m:train:3/w", "load_succeeded": True},
        initial_output=init_out,
        own_check=own,
    )
    assert e["restore_count"] == 2
    assert [c["after_restore"] for c in e["optimizer_checks"]] == [0, 1, 2]
    last = e["optimizer_checks"][-1]
    assert last["actual_config"] == REQ  # weight_decay and grad_clip_norm included: the response carried them
    assert "own optim_step" in last["actual_config_observed_on"]
    for c in e["optimizer_checks"][:2]:  # echoed only by a probe client: declared, null, unverified
        assert c["actual_config"] is None and c["actual_config_source"] == "declared" and not c["verified"]
    assert e["initial_output"]["before_first_update"] and e["initialization"]["loaded_checkpoint_uri"].endswith(
        "train:3/w"
    )


def test_missing_echo_stays_declared():
    c = optimizer_check(
        after_restore=2,
        requested_optimizer="adam",
        requested_config=REQ,
        info=None,
        info_ref="x",
        echoed=echoed_config({"loss": 1.0}, list(REQ)),
        echo_ref="y",
        echo_observed_on="own",
    )
    assert c["actual_config"] is None and c["source"] == "declared" and not c["verified"]

"""Pure rules of the embedded server's spindle profile (read from Spindle's source, see
docs/local-server.md "Spindle profile"): Miles' LoRA refusals and their order, the deployment and
capabilities listings, the spindle-only options and the fault specs they take."""

from __future__ import annotations

import dataclasses

import pytest

from dppo_harness import constants
from dppo_harness.local_server.cli import build_parser, check_profile_options, fault_config, spindle_settings
from dppo_harness.local_server.faults import FaultSpecError, Nth, parse_model_lost, parse_queue_pause
from dppo_harness.local_server.http.spindle import lora_refusal
from dppo_harness.local_server.profiles import (
    DEFAULT_SESSION_IDLE_TIMEOUT_S,
    DEFAULT_SWEEP_INTERVAL_S,
    DEFAULT_TRAINER_SLOTS,
    SpindleSettings,
    spindle_deployments,
)

ALL = (True, True, True)  # (train_mlp, train_attn, train_unembed)


def test_miles_refusals_in_its_order():
    assert lora_refusal(32, None, ALL) is None
    assert lora_refusal(33, 1, (False, True, True)) == "accept model: LoRA rank must be between 1 and 32"
    assert lora_refusal(0, None, ALL) == "accept model: LoRA rank must be between 1 and 32"
    assert lora_refusal(8, 0, (False, True, True)) == "accept model: Miles multi-LoRA does not support per-model seeds"
    for switches in ((False, True, True), (True, False, True), (True, True, False)):
        assert lora_refusal(8, None, switches) == (
            "accept model: Miles uses deployment-wide LoRA targets; model train_attn, train_mlp, "
            "and train_unembed must match the deployment"
        )


def test_deployments_listing():
    listed = [dataclasses.asdict(d) for d in spindle_deployments(2048)]
    assert [(d["base_model"], d["parameterization"], d["max_context_length"]) for d in listed] == [
        (constants.BASE_MODEL, "lora", 2048),
        ("Qwen/Qwen3.5-4B", "full", 32768),
    ]
    assert all(
        set(d) == {"name", "definition_id", "base_model", "parameterization", "max_context_length"} for d in listed
    )


def test_fault_specs_for_spindle():
    assert parse_model_lost("forward_backward:6") == Nth("forward_backward", 6)
    with pytest.raises(FaultSpecError, match="--fault-model-lost"):
        parse_model_lost("forward_backward:0")
    assert parse_queue_pause("create_model:1:forever:active").queue_state == "active"
    with pytest.raises(FaultSpecError, match="'moving' needs a paused STATE"):
        parse_queue_pause("create_model:1:5:active:moving")


def _args(*argv: str):
    args = build_parser(None).parse_args(list(argv))
    return args, fault_config(args)


def test_spindle_options_defaults_and_refusals():
    args, faults = _args("--profile", "spindle")
    assert spindle_settings(args) == SpindleSettings(
        0.0, DEFAULT_TRAINER_SLOTS, DEFAULT_SESSION_IDLE_TIMEOUT_S, DEFAULT_SWEEP_INTERVAL_S
    )
    assert (DEFAULT_TRAINER_SLOTS, DEFAULT_SESSION_IDLE_TIMEOUT_S, DEFAULT_SWEEP_INTERVAL_S) == (6, 300.0, 300.0)
    assert check_profile_options(args, faults) is None
    args, faults = _args(
        "--profile", "spindle", "--cold-start-s", "2", "--trainer-slots", "0", "--sweep-interval-s", "0.5"
    )
    assert spindle_settings(args) == SpindleSettings(2.0, 0, 300.0, 0.5)
    args, faults = _args("--profile", "spindle", "--fault-queue-pause", "optim_step:2:forever:paused_rate_limit")
    assert "never sends queue_state paused_rate_limit" in (check_profile_options(args, faults) or "")
    args, faults = _args("--profile", "spindle", "--fault-queue-pause", "optim_step:2:30:active")
    assert check_profile_options(args, faults) is None
    args, faults = _args("--trainer-slots", "2", "--fault-model-lost", "optim_step:1")
    assert check_profile_options(args, faults) == (
        "--trainer-slots, --fault-model-lost: only with --profile spindle "
        "(Spindle's capacity, sweep and trainer faults)"
    )
    args, faults = _args("--fault-queue-pause", "optim_step:2:30")  # the default profile keeps paused holds
    assert check_profile_options(args, faults) is None
    with pytest.raises(ValueError, match="--trainer-slots"):
        SpindleSettings(trainer_slots=-1)
    with pytest.raises(ValueError, match="--sweep-interval-s"):
        SpindleSettings(sweep_interval_s=0)

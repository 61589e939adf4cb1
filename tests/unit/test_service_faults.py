"""The embedded server's service faults: queue pauses, requests that never complete, refusals for a
while (parsing, and which request each one holds)."""

import time

import pytest

from dppo_harness.local_server.faults import (
    FaultConfig,
    FaultInjector,
    FaultSpecError,
    parse_queue_pause,
    parse_reject_for,
)


def test_the_kth_request_of_a_kind_is_held_with_its_state_and_reason():
    inj = FaultInjector(
        FaultConfig(
            queue_pause=(
                parse_queue_pause("optim_step:2:30"),
                parse_queue_pause("create_model:1:forever:paused_rate_limit"),
                parse_queue_pause("save_weights:1:forever:active"),
            ),
        )
    )
    assert inj.take_hold("optim_step") is None
    hold = inj.take_hold("optim_step")
    assert hold.queue_state == "paused_capacity" and hold.reason.endswith("optim_step request 2; paused for 30 s")
    assert 29 < hold.remaining(time.monotonic()) <= 30
    assert inj.take_hold("optim_step") is None
    forever = inj.take_hold("create_model")
    assert (forever.queue_state, forever.until, forever.remaining(0.0)) == ("paused_rate_limit", None, None)
    hang = inj.take_hold("save_weights")
    assert (hang.queue_state, hang.reason, hang.until) == ("active", None, None)
    assert inj.snapshot()["injected"] == {
        "optim_step:queue_pause": 1,
        "create_model:queue_pause": 1,
        "save_weights:queue_pause": 1,
    }


def test_refusal_for_a_while_counts_from_the_first_request():
    inj = FaultInjector(FaultConfig(reject_for=(parse_reject_for("asample:429:0.3"),)))
    first = inj.decide("asample")
    assert first.reject_status == 429 and "asample refused for 0.3 s" in first.reject_reason
    assert inj.decide("forward_backward").reject_status is None
    time.sleep(0.35)
    assert inj.decide("asample").reject_status is None
    assert parse_reject_for("retrieve_future:401:5").status == 401


@pytest.mark.parametrize(
    "parse, spec, needle",
    [
        (parse_queue_pause, "optim_step:1", "expected KIND:N:SECONDS"),
        (parse_queue_pause, "optim_step:0:5", "counts requests from 1"),
        (parse_queue_pause, "optim_step:1:soon", "SECONDS must be a number or forever"),
        (parse_queue_pause, "optim_step:1:5:paused", "STATE must be one of"),
        (parse_queue_pause, "save_weights:x:forever:active", "N must be an integer"),
        (parse_reject_for, "asample:418:5", "status must be one of"),
        (parse_reject_for, "asample:429:forever", "SECONDS must be a number"),
    ],
)
def test_bad_specs_name_the_option_and_the_problem(parse, spec, needle):
    with pytest.raises(FaultSpecError, match=needle):
        parse(spec)

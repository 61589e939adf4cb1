"""`--fault-capacity-fail KIND:N1[,N2...]`: parsing and which ordered calls it refuses."""

import pytest

from dppo_harness.local_server.faults import FaultConfig, FaultInjector, FaultSpecError, parse_capacity_fail


def test_only_the_listed_calls_of_the_kind_are_refused_and_counted():
    inj = FaultInjector(FaultConfig(capacity_fail=(parse_capacity_fail("optim_step:2,4"),)))
    got = [inj.take_call_capacity_failure("optim_step") for _ in range(5)]
    assert got == [False, True, False, True, False]
    assert [inj.take_call_capacity_failure("forward_backward") for _ in range(4)] == [False] * 4
    snap = inj.snapshot()
    assert snap["injected"] == {"optim_step:capacity_exhausted": 2}
    assert snap["executed"] == {"optim_step": 5, "forward_backward": 4}


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("optim_step", "2 ':'-separated"),
        ("optim_step:x", "integers"),
        ("optim_step:0", "start at 1"),
        ("optim_step:1:2", "2 ':'-separated"),
    ],
)
def test_bad_specs_name_the_problem(spec, needle):
    with pytest.raises(FaultSpecError, match="--fault-capacity-fail") as info:
        parse_capacity_fail(spec)
    assert needle in str(info.value)

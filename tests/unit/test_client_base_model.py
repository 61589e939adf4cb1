"""Issue 10 leftover: the stages create clients with the connectivity preflight's model choice
(a served same-family substitute, recorded as a deviation), else with the plan's base model."""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import pytest
import tinker

from dppo_harness.pytest_plugin import fixtures
from dppo_harness.service.connectivity import ConnectivityReport
from dppo_harness.stages import restoration as checkpoint

PLANNED = "Qwen/Qwen3.5-2B"
SUBSTITUTE = "Qwen/Qwen3.5-4B"


def _report(model: str, substitution: dict | None) -> ConnectivityReport:
    return ConnectivityReport(
        "tinker",
        "http://127.0.0.1:9",
        PLANNED,
        model,
        [model],
        substitution,
        None,
        {"supported_models": [{"model_name": model}]},
    )


SUBSTITUTED = _report(SUBSTITUTE, {"field": "model", "original": PLANNED, "effective": SUBSTITUTE, "reason": "x"})
SERVED = _report(PLANNED, None)


class _Future:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class _Client:
    def __init__(self):
        self.saved: set[str] = set()

    def get_info(self):
        return {"model_name": "recorded"}

    def save_state(self, name):
        if name in self.saved:  # the service's explicit refusal to overwrite
            raise tinker.RequestFailedError(
                f"Request failed: save_weights: checkpoint {name!r} already exists",
                request_id="r",
                category=tinker.types.RequestErrorCategory.User,
            )
        self.saved.add(name)
        return _Future(SimpleNamespace(path=f"tinker://m/weights/{name}"))


class _ServiceClient:
    """Records the base model of every LoRA client it is asked to create."""

    def __init__(self):
        self.created: list[str] = []

    def create_lora_training_client(self, *, base_model, rank):  # no seed: Spindle refuses one
        self.created.append(base_model)
        return _Client()  # tinker 0.25: the creation returns the client


@pytest.mark.parametrize(("report", "want"), [(SUBSTITUTED, SUBSTITUTE), (SERVED, PLANNED)])
def test_the_resolved_model_is_the_one_passed_to_client_creation(report, want):
    model = report.client_base_model(PLANNED)
    assert model == want
    sc = _ServiceClient()
    initial = checkpoint.fresh_checkpoint(sc, model, 8, 0, "t", checkpoint.Recorder(), lambda fn: fn())
    assert sc.created == [want] and initial.immutable


def test_a_model_the_preflight_did_not_check_is_passed_unchanged():
    assert SUBSTITUTED.client_base_model("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"


def test_the_restoration_fixture_creates_clients_with_the_resolved_model():
    """The session's restoration passes the `client_base_model` fixture, not the spec's name."""
    fn = fixtures.restoration
    fn = getattr(fn, "__wrapped__", None) or getattr(fn, "_get_wrapped_function", lambda: fn)()
    tree = ast.parse(inspect.getsource(fn).lstrip())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "run_restoration_preflight"
    ]
    assert len(calls) == 1
    kw = {k.arg: k.value for k in calls[0].keywords}
    assert isinstance(kw["base_model"], ast.Name) and kw["base_model"].id == "client_base_model"
    assert "client_base_model" in inspect.signature(fn).parameters

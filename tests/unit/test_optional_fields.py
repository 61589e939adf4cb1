"""Optional response fields are never invented: the immutability proof counts only an explicit
refusal to overwrite, a missing model name stays unavailable, and the embedded server's
`--fault-omit-field` leaves out exactly the fields the SDK's response types declare optional."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import tinker
from tinker import types

from dppo_harness import plans
from dppo_harness.evidence.backend import SERVED_MODEL_UNAVAILABLE, ServedModel, backend_deviations, served_name
from dppo_harness.local_server.faults import (
    OPTIONAL_RESPONSE_FIELDS,
    FaultConfig,
    FaultInjector,
    FaultSpecError,
    drop_path,
    parse_omit_field,
)
from dppo_harness.stages import restoration
from dppo_harness.stages import restoration as checkpoint
from dppo_harness.stages.restoration import check_provenance
from dppo_harness.train.optimizer_checks import optimizer_check

USER = types.RequestErrorCategory.User
SERVER = types.RequestErrorCategory.Server


def _status(cls, code: int, text: str):
    req = httpx.Request("POST", "http://127.0.0.1:9/api/v1/save_weights")
    return cls(text, response=httpx.Response(code, request=req), body=None)


def _failed(text: str, category=USER) -> tinker.RequestFailedError:
    return tinker.RequestFailedError(
        f"Request failed: {text} for self.request_id='r1' and expected type x", request_id="r1", category=category
    )


# ---- immutability: only an explicit refusal to overwrite proves it -----------------------------


@pytest.mark.parametrize(
    "exc",
    [
        _failed("save_weights: checkpoint 'x' already exists; pass overwrite=True to replace it"),
        # a name saved at 00:45:03 holds "503": still the refusal, not a capacity error
        _failed("checkpoint '20261202T004503Z-731a34-initial-shared-seed0' already exists; pass overwrite=True"),
        _status(tinker.ConflictError, 409, "Conflict"),
        _status(tinker.BadRequestError, 400, "checkpoint name is immutable: refusing to overwrite"),
        # Spindle: a plain FileExistsError, category server, naming the checkpoint's directory
        _failed("checkpoint already exists: /checkpoints/run-initial-shared/s1:train:0", SERVER),
    ],
)
def test_an_explicit_refusal_to_overwrite_proves_immutability(exc):
    immutable, reason = restoration.duplicate_save_outcome(exc, "run-initial-shared")
    assert immutable is True and "refused to overwrite" in reason
    if isinstance(exc, tinker.RequestFailedError) and exc.category == SERVER:
        assert "(category server)" in reason and "/checkpoints/run-initial-shared/s1:train:0" in reason


@pytest.mark.parametrize(
    "exc, needle",
    [
        (TimeoutError("Timeout of 60 seconds reached while waiting for result"), "TimeoutError"),
        (_status(tinker.InternalServerError, 500, "Internal Server Error"), "InternalServerError"),
        (_status(tinker.InternalServerError, 503, "Service Unavailable"), "Service Unavailable"),
        (_failed("trainer capacity exhausted: no trainer available for save_weights", SERVER), "capacity"),
        (_failed("save_weights failed on the local server: OSError: disk full", SERVER), "disk full"),
        (_failed("checkpoint already exists (while cleaning up)", SERVER), "already exists"),  # server-side failure
        # category server naming another checkpoint: not this name's refusal
        (_failed("checkpoint already exists: /checkpoints/other/s1:train:0", SERVER), "category server"),
        (_status(tinker.BadRequestError, 400, "bad request"), "bad request"),
        (tinker.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9")), "APIConnectionError"),
        (RuntimeError("exists"), "RuntimeError"),
    ],
)
def test_anything_else_leaves_immutability_unverified_with_the_reason(exc, needle):
    immutable, reason = restoration.duplicate_save_outcome(exc, "run-initial-shared")
    assert immutable is None
    assert needle in reason and "immutability unverified" in reason


def test_a_second_save_that_succeeds_is_not_immutable():
    immutable, reason = restoration.duplicate_save_outcome(None)
    assert immutable is False and "accepted a second save_state" in reason


class _Future:
    def __init__(self, value=None, exc=None):
        self.value, self.exc = value, exc

    def result(self, timeout=None):
        if self.exc is not None:
            raise self.exc
        return self.value


class _SetupClient:
    """A fresh LoRA client whose duplicate save ends in `duplicate` (an exception, or None: accepted)."""

    model_id = "s:train:0"

    def __init__(self, duplicate: BaseException | None):
        self.duplicate, self.saved = duplicate, []

    def get_info(self):
        return {"model_id": self.model_id}

    def save_state(self, name):
        self.saved.append(name)
        if len(self.saved) == 2:
            return _Future(SimpleNamespace(path=f"tinker://m/weights/{name}"), self.duplicate)
        return _Future(SimpleNamespace(path=f"tinker://m/weights/{name}"))


class _ServiceClient:
    def __init__(self, client):
        self.client = client

    def create_lora_training_client(self, *, base_model, rank):
        # no seed keyword: Spindle refuses a per-model seed, so the setup client must not send one;
        # tinker 0.25 blocks and hands the TrainingClient itself back
        return self.client


@pytest.mark.parametrize(
    "duplicate, want",
    [
        (TimeoutError("no answer"), None),
        (_status(tinker.InternalServerError, 500, "Internal Server Error"), None),
        (_failed("checkpoint 'x' already exists"), True),
        (None, False),
    ],
)
def test_the_setup_checkpoint_records_what_the_duplicate_save_showed(duplicate, want):
    rec = checkpoint.Recorder()
    initial = checkpoint.fresh_checkpoint(
        _ServiceClient(_SetupClient(duplicate)), "Qwen/Qwen3.5-2B", 8, 0, "t", rec, lambda fn: fn()
    )
    assert initial.immutable is want and initial.immutable_reason
    kept = [k for k in rec.responses if k.startswith("save_shared_again")]
    assert len(kept) == 1
    if duplicate is not None:  # the error and the verdict on it are kept for the evidence
        assert rec.responses[kept[0]]["checkpoint_immutable"] is want and rec.responses[kept[0]]["error"]


def _entry(**init) -> dict:
    check = optimizer_check(
        after_restore=0,
        requested_optimizer="adam",
        requested_config={"learning_rate": 1e-5},
        info=None,
        info_ref="i",
        echoed=None,
        echo_ref=None,
        echo_observed_on=None,
    )
    uri = "tinker://a/weights/i"
    initialization = {"checkpoint_uri": uri, "checkpoint_immutable": True, "loaded_checkpoint_uri": uri, **init}
    return {
        "initialization": initialization,
        "restore_count": 1,
        "optimizer_checks": [check, dict(check, after_restore=1)],
    }


def test_unverified_immutability_fails_the_proof_with_one_line_naming_the_field():
    reason = "the duplicate save_state ended in TimeoutError: no answer, not an explicit refusal to overwrite"
    arms = {"a": _entry(checkpoint_immutable=None, checkpoint_immutable_reason=reason)}
    failures = check_provenance(arms)
    assert failures == [f"a: checkpoint_immutable unverified: {reason}"]
    assert arms["a"]["initialization"]["checkpoint_immutable"] is None
    assert check_provenance({"a": _entry()}) == []


def test_a_missing_load_path_fails_the_proof_naming_it():
    failures = check_provenance({"a": _entry(loaded_checkpoint_uri=None)})
    assert failures == ["a: no loaded checkpoint URI in the server's load response"]


# ---- model names: unavailable, never the requested one -----------------------------------------


def test_served_model_without_a_model_name_is_unavailable_not_the_requested_one():
    s = ServedModel("Qwen/Qwen3.5-2B", served_name({"model_data": {}}))
    assert s.served is None and s.rehearsal  # never the requested name: nothing shows it computed
    assert served_name({"model_data": {"model_name": "Qwen/Qwen3.5-4B"}}) == "Qwen/Qwen3.5-4B"


def test_backend_info_without_model_names_is_unavailable_and_no_deviation(pytestconfig):
    from dppo_harness.pytest_plugin.fixtures import backend_info

    plan = plans.load_plan(pytestconfig.rootpath / "plans" / "exp_e6b0965af3.json")
    info = types.GetInfoResponse(model_data=types.ModelData(), model_id="s:train:0")  # the service sent no names
    client = SimpleNamespace(get_info=lambda: info)
    b = backend_info(SimpleNamespace(kind="tinker", base_url="http://127.0.0.1:9"), plan, client)
    assert b.served_model.startswith(SERVED_MODEL_UNAVAILABLE) and plan.base_model not in b.served_model
    assert backend_deviations(plan, b) == []
    other = SimpleNamespace(
        get_info=lambda: types.GetInfoResponse(model_data=types.ModelData(model_name="Qwen/Qwen3.5-4B"), model_id="m")
    )
    moved = backend_info(SimpleNamespace(kind="tinker", base_url="http://127.0.0.1:9"), plan, other)
    assert [d["effective"] for d in backend_deviations(plan, moved)] == ["Qwen/Qwen3.5-4B"]


@pytest.mark.parametrize(
    "info",
    [
        {"model_data": {}, "model_id": "m"},  # get_info as sent, without optimizer_config
        types.GetInfoResponse.model_validate({"model_data": {}, "model_id": "m"}),
        # tinker 0.25's GetInfoResponse has no optimizer_config field: what the server sent is dropped
        types.GetInfoResponse.model_validate(
            {"model_data": {}, "model_id": "m", "optimizer_config": {"type": "adamw"}}
        ),
    ],
    ids=["raw-absent", "sdk-absent", "sdk-dropped"],
)
def test_an_optimizer_config_not_seen_on_the_wire_is_never_invented(info):
    if isinstance(info, types.GetInfoResponse):
        assert not hasattr(info, "optimizer_config")  # 0.25's type declares none, so it never has a default
    check = optimizer_check(
        after_restore=0,
        requested_optimizer="adam",
        requested_config={"learning_rate": 1e-5},
        info=info,
        info_ref="i",
        echoed=None,
        echo_ref=None,
        echo_observed_on=None,
    )
    assert check["actual_optimizer"] is None and check["actual_optimizer_source"] == "declared"
    assert not check["verified"] and "optimizer family not exposed" in check["unverified_reasons"][0]


# ---- the fault: --fault-omit-field ---------------------------------------------------------------


_SDK_TYPES = {
    "load_weights": types.LoadWeightsResponse,
    "get_info": types.GetInfoResponse,
    "optim_step": types.OptimStepResponse,
    "save_weights": types.SaveWeightsResponse,
    "save_weights_for_sampler": types.SaveWeightsForSamplerResponseInternal,
}


def _field_required(model, path: str) -> bool:
    head, _, rest = path.partition(".")
    info = model.model_fields[head]
    if rest:
        return _field_required(info.annotation, rest)
    return info.is_required()


@pytest.mark.parametrize("kind", sorted(_SDK_TYPES))
def test_every_omittable_field_is_optional_in_the_sdk_type(kind):
    for path in OPTIONAL_RESPONSE_FIELDS[kind]:
        assert not _field_required(_SDK_TYPES[kind], path), f"{kind}.{path} is required by the SDK"


def test_required_fields_cannot_be_omitted_and_bad_specs_name_the_problem():
    assert parse_omit_field("load_weights.path") == parse_omit_field("load_weights.path")
    assert parse_omit_field("get_info.model_data.model_name:2,3").numbers == frozenset({2, 3})
    for spec, needle in [
        ("save_weights.path", "not an optional field"),
        ("load_weights", "KIND.FIELD"),
        ("nope.path", "no optional response fields known"),
        ("load_weights.path:0", "start at 1"),
        ("load_weights.path:x", "integers"),
    ]:
        with pytest.raises(FaultSpecError, match="--fault-omit-field") as info:
            parse_omit_field(spec)
        assert needle in str(info.value)


def test_omission_drops_nested_and_listed_fields_of_the_chosen_responses_only():
    inj = FaultInjector(
        FaultConfig(
            omit_field=(parse_omit_field("get_info.model_data.model_name:2"), parse_omit_field("load_weights.path"))
        )
    )
    first = inj.omit_json("get_info", {"model_id": "m", "model_data": {"model_name": "x", "arch": "a"}})
    second = inj.omit_json("get_info", {"model_id": "m", "model_data": {"model_name": "x", "arch": "a"}})
    assert first["model_data"] == {"model_name": "x", "arch": "a"} and second["model_data"] == {"arch": "a"}
    assert inj.omit_json("load_weights", {"path": "p", "model_id": "m"}) == {"model_id": "m"}
    assert inj.omit_json("optim_step", {"metrics": {}}) == {"metrics": {}}  # no rule for the kind
    snap = inj.snapshot()
    assert snap["injected"] == {"get_info:omit:model_data.model_name": 1, "load_weights:omit:path": 1}
    caps = {"supported_models": [{"model_name": "a", "trainable": True}, {"model_name": "b"}]}
    assert drop_path(caps, "supported_models.model_name") == 2 and caps["supported_models"][1] == {}


class _WeightsInfoService:
    """A service whose weights_info answers `info` and which records every client it creates."""

    def __init__(self, info):
        self.info, self.created = info, []

    def create_rest_client(self):
        return SimpleNamespace(get_weights_info_by_tinker_path=lambda path: _Future(self.info))

    def create_lora_training_client(self, **kw):
        self.created.append(kw)
        raise AssertionError("no client may be created without the checkpoint's rank")


@pytest.mark.parametrize(
    "info",
    [
        types.WeightsInfoResponse(base_model="Qwen/Qwen3.5-2B", is_lora=True),  # no rank sent
        types.WeightsInfoResponse(base_model="Qwen/Qwen3.5-2B", is_lora=False, lora_rank=32),
    ],
)
def test_a_restore_whose_weights_info_gives_no_lora_rank_stops_instead_of_guessing(info):
    from dppo_harness.service.observed import create_from_state_with_response

    service = _WeightsInfoService(info)
    with pytest.raises(ValueError, match="without guessing its rank"):
        create_from_state_with_response(service, "tinker://m/weights/initial")  # type: ignore[arg-type]
    assert service.created == []

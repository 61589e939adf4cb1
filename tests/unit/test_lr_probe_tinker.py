"""Issue 11 point 10: the LR-scaling probe on the tinker backend reads weights back through the SDK
(tinker 0.25: save_weights_for_sampler + the checkpoint archive's signed URL, its .safetensors
members read), else records available:false with the exact reason in the brief's lr_scaling block
(never an empty list); the baseline parity covers token_mean."""

import concurrent.futures
import datetime
import io
import json
import tarfile
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from safetensors.torch import save as save_safetensors

from dppo_harness.loss import correctness, correctness_golden
from dppo_harness.stages.restoration import (
    CheckpointUpdateNorm,
    LocalCheckpointReader,
    LrScalingUnavailable,
    attach_lr_scaling,
    planned_lr_on_setup_client,
)
from dppo_harness.train.weights_readback import ExternalWeightsUpdateNorm

ROOT = Path(__file__).parents[2]
SPEC = json.loads((ROOT / "plans/exp_e6b0965af3.json").read_text())


class _Done:
    """An answered SDK APIFuture (what save_weights_for_sampler returns)."""

    def __init__(self, v):
        self.v = v

    def result(self, timeout=None):
        return self.v


def _future(value=None, exc=None):
    """What tinker 0.25's RestClient hands back: a plain concurrent Future, answered or failed."""
    fut = concurrent.futures.Future()
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
    return fut


def _archive(members: dict[str, bytes]) -> bytes:
    """A checkpoint archive as the service serves it: a tar of the checkpoint's files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _FakeClient:
    """A training client whose sampler weights (a LoRA adapter: two tensors in one file, one more
    tensor in a second file) are archived into `store` under the saved name."""

    def __init__(self, store):
        self.w = {"lora_A": torch.zeros(2, 3), "lora_B": torch.ones(3, 2)}
        self.extra = {"unembed_delta": torch.full((2,), 0.25)}
        self.store, self.saved = store, []

    def save_weights_for_sampler(self, name):
        self.saved.append(name)
        self.store[name] = _archive(
            {
                "adapter_config.json": b"{}",
                "adapter_model.safetensors": save_safetensors({k: v.clone() for k, v in self.w.items()}),
                "extra/unembed.safetensors": save_safetensors({k: v.clone() for k, v in self.extra.items()}),
            }
        )
        return _Done(tinker.types.SaveWeightsForSamplerResponse(path=f"tinker://run/sampler_weights/{name}"))


def _status(code: int, text: str) -> tinker.APIStatusError:
    req = httpx.Request("GET", "http://127.0.0.1:9/api/v1/training_runs/run/checkpoints/sampler_weights/x/archive")
    return tinker.APIStatusError(f"Error code: {code} - {text}", response=httpx.Response(code, request=req), body=None)


class _FakeRest:
    """`RestClient.get_checkpoint_archive_url_from_tinker_path`: a signed URL per checkpoint, or `refuse`."""

    def __init__(self, refuse: BaseException | None = None):
        self.refuse, self.asked = refuse, []

    def get_checkpoint_archive_url_from_tinker_path(self, tinker_path):
        self.asked.append(tinker_path)
        if self.refuse is not None:
            return _future(exc=self.refuse)
        name = tinker_path.rsplit("/", 1)[1]
        expires = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
        return _future(tinker.types.CheckpointArchiveUrlResponse(url=f"https://signed/{name}", expires=expires))


def test_update_norm_read_back_from_external_weights():
    store, rest = {}, _FakeRest()
    m = ExternalWeightsUpdateNorm(lambda: rest, fetch=lambda url: store[url.rsplit("/", 1)[1]])
    c = _FakeClient(store)

    def step():
        c.w["lora_A"] = c.w["lora_A"] + 0.5  # 6 entries moved by 0.5
        c.extra["unembed_delta"] = c.extra["unembed_delta"] - 1.0  # 2 entries moved by 1.0 (second file)

    assert m(c, step) == pytest.approx((6 * 0.25 + 2 * 1.0) ** 0.5)
    assert m.last_error is None
    assert c.saved == ["lr-probe-1-before", "lr-probe-1-after"]
    assert rest.asked == [f"tinker://run/sampler_weights/{n}" for n in c.saved]


def test_unavailable_read_back_keeps_the_exact_reason_in_the_brief_block():
    """Spindle answers the archive request 405: no update is applied, the reason is kept as sent."""
    refused = _status(405, "{'detail': 'Method Not Allowed'}")
    m = ExternalWeightsUpdateNorm(lambda: _FakeRest(refuse=refused), fetch=lambda url: b"")
    c = _FakeClient({})
    applied = []
    assert m(c, lambda: applied.append(1)) is None and applied == []
    assert m.last_error == (
        "reading weights before the update failed: APIStatusError: Error code: 405 - {'detail': 'Method Not Allowed'}"
    )
    block = LrScalingUnavailable(f"{m.description}: {m.last_error}", [2e-5, 4e-5])
    pre = attach_lr_scaling({"paths": [{"id": "p"}]}, block)
    lr = pre["paths"][0]["lr_scaling"]
    assert len(lr) == 2 and all(
        e["available"] is False and e["update_norm"] is None and "405" in e["reason"] for e in lr
    )


def test_an_archive_without_safetensors_is_unavailable_with_the_reason():
    m = ExternalWeightsUpdateNorm(lambda: _FakeRest(), fetch=lambda url: _archive({"adapter_config.json": b"{}"}))
    applied = []
    assert m(_FakeClient({}), lambda: applied.append(1)) is None and applied == []
    assert "holds no .safetensors file" in m.last_error


def _preflight_with(lr_entries):
    report = correctness_golden.check_golden(ROOT / "tests/fixtures/dppo_golden_v1.json", modes=("float64",))
    block = correctness.build_preflight_block(report, SPEC)
    block["paths"][0]["lr_scaling"] = lr_entries
    return block


def test_validator_accepts_unavailable_only_without_a_tolerance_and_with_a_reason():
    unavailable = [{"learning_rate": 2e-5, "update_norm": None, "available": False, "reason": "no read-back"}]
    status, msgs = correctness.validate_preflight(SPEC, _preflight_with(unavailable))
    assert status == "passed" and any("lr_scaling unavailable: no read-back" in m for m in msgs)
    no_reason = [{"learning_rate": 2e-5, "update_norm": None, "available": False, "reason": ""}]
    assert correctness.validate_preflight(SPEC, _preflight_with(no_reason))[0] == "failed"
    spec = json.loads(json.dumps(SPEC))
    spec["correctness_preflight"]["paths"][0]["tolerances"]["lr_scaling"] = {"rtol": 0.1}
    assert correctness.validate_preflight(spec, _preflight_with(unavailable))[0] == "failed"


def test_baseline_parity_covers_token_mean():
    report = correctness_golden.check_golden(ROOT / "tests/fixtures/dppo_golden_v1.json", modes=("float32",))
    for res in report.results:
        sub = {s.name: s for s in res.subchecks}
        assert "grpo_baseline_token_mean" in sub and sub["grpo_baseline_token_mean"].passed, res.line()
    norm = correctness.build_preflight_block(report, SPEC)["paths"][0]["normalization"]
    assert "token_mean (the normalization trained)" in norm


def test_the_planned_lr_rides_on_the_setup_client_only_with_a_measure_that_cannot_be_refused(tmp_path):
    """A refused weights read-back on the setup client could leave it waiting and stall the
    restore probe after it: the external-weights measure gets its own client per LR; the local
    checkpoint measure (save_state only) may share the setup client."""
    external = ExternalWeightsUpdateNorm(lambda: _FakeRest())
    local = CheckpointUpdateNorm(LocalCheckpointReader(tmp_path), "t")
    assert not planned_lr_on_setup_client(external, (0.5, 1.0, 2.0))
    assert planned_lr_on_setup_client(local, (0.5, 1.0, 2.0))
    assert not planned_lr_on_setup_client(local, (0.5, 2.0))

"""Issue 11 point 10: the LR-scaling probe on the tinker backend reads weights back through the SDK
(save_weights_external + signed URLs), else records available:false with the exact reason in the
brief's lr_scaling block (never an empty list); the baseline parity covers token_mean."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save as save_safetensors

from dppo_harness.loss import correctness, correctness_golden
from dppo_harness.stages.restoration.lr_probe import attach_lr_scaling
from dppo_harness.stages.restoration.records import LrScalingUnavailable
from dppo_harness.stages.restoration.update_norm import (
    CheckpointUpdateNorm,
    LocalCheckpointReader,
    planned_lr_on_setup_client,
)
from dppo_harness.train.weights_readback import ExternalWeightsUpdateNorm

ROOT = Path(__file__).parents[2]
SPEC = json.loads((ROOT / "plans/exp_e6b0965af3.json").read_text())


class _Done:
    def __init__(self, v):
        self.v = v

    def result(self, timeout=None):
        return self.v


class _FakeClient:
    def __init__(self, store, fail=False):
        self.w = {"lora_A": torch.zeros(2, 3), "lora_B": torch.ones(3, 2)}
        self.store, self.fail = store, fail

    def save_weights_external(self, name):
        if self.fail:
            raise RuntimeError("404 Not Found: /api/v1/save_weights_external")
        self.store[name] = save_safetensors({k: v.clone() for k, v in self.w.items()})
        return _Done(SimpleNamespace(path=f"tinker://run/external_weights/{name}"))


class _FakeRest:
    def get_external_weights_urls(self, path):
        name = path.rsplit("/", 1)[1]
        return _Done(SimpleNamespace(urls={"adapter_model.safetensors": f"https://signed/{name}", "config.json": "x"}))


def test_update_norm_read_back_from_external_weights():
    store = {}
    m = ExternalWeightsUpdateNorm(lambda: _FakeRest(), fetch=lambda url: store[url.rsplit("/", 1)[1]])
    c = _FakeClient(store)

    def step():
        c.w["lora_A"] = c.w["lora_A"] + 0.5  # 6 entries moved by 0.5 -> norm sqrt(1.5)

    assert m(c, step) == pytest.approx(1.5**0.5)
    assert m.last_error is None


def test_unavailable_read_back_keeps_the_exact_reason_in_the_brief_block():
    m = ExternalWeightsUpdateNorm(lambda: _FakeRest(), fetch=lambda url: b"")
    c = _FakeClient({}, fail=True)
    applied = []
    assert m(c, lambda: applied.append(1)) is None and applied == []
    assert "404 Not Found" in m.last_error
    block = LrScalingUnavailable(f"{m.description}: {m.last_error}", [2e-5, 4e-5])
    pre = attach_lr_scaling({"paths": [{"id": "p"}]}, block)
    lr = pre["paths"][0]["lr_scaling"]
    assert len(lr) == 2 and all(
        e["available"] is False and e["update_norm"] is None and "404" in e["reason"] for e in lr
    )


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
    """A refused save_weights_external on the setup client would leave a gap in its request
    sequence and stall the restore probe after it: the external-weights measure gets its own
    client per LR; the local checkpoint measure (save_state only) may share the setup client."""
    external = ExternalWeightsUpdateNorm(lambda: _FakeRest())
    local = CheckpointUpdateNorm(LocalCheckpointReader(tmp_path), "t")
    assert not planned_lr_on_setup_client(external, (0.5, 1.0, 2.0))
    assert planned_lr_on_setup_client(local, (0.5, 1.0, 2.0))
    assert not planned_lr_on_setup_client(local, (0.5, 2.0)) and not planned_lr_on_setup_client(None, (1.0,))

"""An update's tensors are persisted before its optimizer step can reach the service, pipelined
too: the optimizer step is submitted at once, but the SDK holds it behind the custom loss's
backward, which is sent only after the loss (and the persist inside it) returned. A persist that
fails (disk full) therefore fails the update with that error, and no optimizer step is sent: the
weights never move without their evidence."""

from __future__ import annotations

import errno
import time

import numpy as np
import pytest
import tinker
from server_in_process import InProcessServer

from dppo_harness.instrument import instrumentation
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.loss import losses
from dppo_harness.service.observed import make_service_client
from dppo_harness.service.wait.policy import WaitPolicy
from dppo_harness.service.wait.waiter import ServiceWaiter
from dppo_harness.train import train_step

BASE = "Qwen/Qwen3.5-2B"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("persist-run"), model_name="tiny-qwen3-random")


def _datums() -> list[tinker.Datum]:
    out = []
    for i in range(2):
        toks = [5 + i, 6, 7, 8]
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": toks[1:],
                    "logprobs": [0.0, -1.0, -0.5],
                    "advantages": [0.0, 1.0 - 2 * i, 1.0 - 2 * i],
                    "mask": np.array([0.0, 1.0, 1.0], dtype=np.float32),
                },
            )
        )
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sequential", [False, True])
def test_a_failed_persist_sends_no_optimizer_step(engine, monkeypatch, sequential):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    cfg = losses.LossConfig(loss="dppo_divergence_mask", normalization="token_mean")
    adam = tinker.AdamParams(learning_rate=1e-3)
    with InProcessServer(engine) as srv:
        sc = make_service_client(
            "local", srv.base_url, waiter=ServiceWaiter(WaitPolicy.from_options(service_timeout_s=60))
        )
        try:
            tc = sc.create_lora_training_client(base_model=BASE, rank=4)
            requests = srv.state.faults.requests
            persisted = []
            train_step.train_step(
                tc,
                _datums(),
                losses.make_loss_fn(cfg),
                adam,
                instrumentation.LossCallRecorder(cfg),
                {"update_index": 0},
                persist=persisted.append,
                sequential=sequential,
            )
            assert len(persisted) == 1 and requests["optim_step"] == 1  # the control: a persisted update is sent

            def disk_full(_record):
                raise OSError(errno.ENOSPC, "No space left on device")

            tc2 = sc.create_lora_training_client(base_model=BASE, rank=4)
            with pytest.raises(OSError, match="No space left on device"):
                train_step.train_step(
                    tc2,
                    _datums(),
                    losses.make_loss_fn(cfg),
                    adam,
                    instrumentation.LossCallRecorder(cfg),
                    {"update_index": 0},
                    persist=disk_full,
                    sequential=sequential,
                )
            time.sleep(2)  # an optimizer step still in flight would arrive by now
            assert requests["optim_step"] == 1, dict(requests)  # the failed update's step never reached the service
        finally:
            sc.release(30)

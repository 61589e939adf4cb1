"""The one training core (`rollouts`, `train_step`) and the shared lower helpers."""

import ast
import math
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch

from dppo_harness.instrument import instrumentation, replay
from dppo_harness.loss import correctness, losses
from dppo_harness.stages import gate
from dppo_harness.stages import restoration as restoration_lr_probe
from dppo_harness.stages.diagnostic import write
from dppo_harness.train import train_step
from dppo_harness.train.clients import make_datum

SRC = Path(gate.__file__).parent


class _Future:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


# The fake model's current log-probs of every datum's targets (`_datums` samples at [0, -1, -0.5]).
POLICY_LOGPROBS = np.array([0.0, -1.0, -0.5]) - 0.05


class FakeTrainingClient:
    """Records the order of calls; runs the custom loss on fixed logprobs like the SDK would, and
    refuses datums tinker 0.25's forward_backward_custom refuses (keys beside target_tokens/weights)."""

    def __init__(self, call_loss: int = 1):
        self.calls: list[str] = []
        self.call_loss = call_loss

    def forward_backward_custom(self, data, loss_fn):
        self.calls.append("fwd_bwd")
        for d in data:
            unexpected = sorted(set(d.loss_fn_inputs) - {"target_tokens", "weights"})
            if unexpected:
                raise ValueError(f"forward_backward_custom: found unexpected keys: {unexpected}")
        out = None
        for _ in range(self.call_loss):
            lps = [torch.tensor(POLICY_LOGPROBS[: d.model_input.length], requires_grad=True) for d in data]
            out = loss_fn(data, lps)
        return _Future(out)

    def optim_step(self, adam):
        self.calls.append("optim")
        return _Future({"lr": adam.learning_rate})


def _datums(n=2):
    out = []
    for i in range(n):
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


def test_train_step_records_one_call_and_persists_before_the_optimizer_step():
    cfg = losses.LossConfig(loss="dppo_divergence_mask", normalization="token_mean")
    tc, rec = FakeTrainingClient(), instrumentation.LossCallRecorder(cfg)
    seen = []

    def persist(record):
        seen.append((record.context["update_index"], list(tc.calls)))

    record, result = train_step.train_step(
        tc,
        _datums(),
        losses.make_loss_fn(cfg),
        tinker.AdamParams(learning_rate=1e-3),
        rec,
        {"update_index": 7},
        persist=persist,
    )
    assert record is rec.records[-1] and record.context["update_index"] == 7
    assert seen == [(7, ["fwd_bwd"])], "persist must run after the loss call and before optim_step"
    assert tc.calls == ["fwd_bwd", "optim"] and result.optim == {"lr": 1e-3} and result.seconds >= 0


@pytest.mark.parametrize("sequential", [False, True])
def test_an_update_says_where_its_seconds_went(sequential):
    cfg = losses.LossConfig(loss="dppo_divergence_mask", normalization="token_mean")
    hook_span = []

    def persist(_record):
        t = time.perf_counter()
        instrumentation.records_to_npz([_record])  # some real work
        hook_span.append(time.perf_counter() - t)

    _, result = train_step.train_step(
        FakeTrainingClient(),
        _datums(),
        losses.make_loss_fn(cfg),
        tinker.AdamParams(learning_rate=1e-3),
        instrumentation.LossCallRecorder(cfg),
        {},
        persist=persist,
        sequential=sequential,
    )
    assert set(result.phases) == {"forward_wait", "loss", "before_optim", "backward_wait", "optim_wait"}
    assert all(v >= 0 for v in result.phases.values()) and result.phases["before_optim"] >= hook_span[0]
    assert sum(result.phases.values()) <= result.seconds + 1e-9
    # a loss that never ran leaves the intervals after it out instead of inventing them
    unrun = train_step.minibatch_update(
        FakeTrainingClient(call_loss=0),
        _datums(),
        losses.make_loss_fn(cfg),
        tinker.AdamParams(learning_rate=1e-3),
        sequential=sequential,
    )
    assert "loss" not in unrun.phases and "forward_wait" not in unrun.phases


def test_train_step_fails_when_the_loss_is_not_called_exactly_once():
    cfg = losses.LossConfig(loss="grpo_clip_eps0.2", normalization="sum")
    for n in (0, 2):
        with pytest.raises(train_step.TrainStepError, match="expected one loss call"):
            train_step.train_step(
                FakeTrainingClient(call_loss=n),
                _datums(),
                losses.make_loss_fn(cfg),
                tinker.AdamParams(learning_rate=1e-3),
                instrumentation.LossCallRecorder(cfg),
                {},
            )


def test_lr_scaling_error_has_one_definition_including_the_first_probe():
    assert restoration_lr_probe.lr_scaling_error is correctness.lr_scaling_error
    good = [{"learning_rate": 1e-5, "update_norm": 1.0}, {"learning_rate": 2e-5, "update_norm": 2.0}]
    assert correctness.lr_scaling_error(good) == [0.0, 0.0]
    bad = [{"learning_rate": 1e-5, "update_norm": 1.0}, {"learning_rate": 2e-5, "update_norm": 1.0}]
    assert correctness.lr_scaling_error(bad) == [0.0, pytest.approx(0.5)]
    assert correctness.lr_scaling_error([{"learning_rate": 1e-5, "update_norm": 0.0}, good[1]]) == [math.inf] * 2
    assert correctness.lr_scaling_error([]) == []
    # The correctness CLI's check uses it and fails on the bad probes.
    assert correctness._check_lr_scaling("p", bad, {"max_relative_error": 0.05})[0].startswith("FAIL")


def test_make_datum_zero_weight_is_a_forward_only_read_of_the_whole_sequence():
    d = make_datum([3], [4, 5, 6], completion_weight=0.0)
    assert d.model_input.to_ints() == [3, 4, 5]
    assert d.loss_fn_inputs["target_tokens"].to_numpy().tolist() == [4, 5, 6]
    assert d.loss_fn_inputs["weights"].to_numpy().tolist() == [0.0, 0.0, 0.0]
    assert make_datum([3, 4], [5, 6]).loss_fn_inputs["weights"].to_numpy().tolist() == [0.0, 1.0, 1.0]


def _imports(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
    return out


def test_module_graph_replay_and_pooling_do_not_import_the_diagnostic():
    assert not any("diagnostic" in m for m in _imports(replay)), "replay must not import diagnostic (cycle)"
    assert not any("diagnostic" in m for m in _imports(instrumentation))
    assert write.pool_calls is instrumentation.pool_calls and write.ANALYSIS_FILE == instrumentation.ANALYSIS_FILE


def test_no_training_loop_outside_the_core():
    """forward_backward_custom / optim_step for training live in train_step only."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name in ("train_step.py",):
            continue
        text = path.read_text()
        for needle in (".forward_backward_custom(", ".optim_step("):
            if needle in text:
                offenders.append(f"{path.name}: {needle}")
    # restoration's fixed-gradient probe (cross_entropy, not the RL loss) is the only other optim_step.
    assert offenders == ["restoration.py: .optim_step("], offenders


class _LoggedFuture:
    def __init__(self, log, name, value):
        self.log, self.name, self.value = log, name, value

    def result(self):
        self.log.append(f"await {self.name}")
        return self.value


class OrderClient(FakeTrainingClient):
    """Logs submissions and awaits, so the schedule itself is visible."""

    def forward_backward_custom(self, data, loss_fn):
        return _LoggedFuture(self.calls, "fwd_bwd", super().forward_backward_custom(data, loss_fn).value)

    def optim_step(self, adam):
        return _LoggedFuture(self.calls, "optim", super().optim_step(adam).value)


@pytest.mark.parametrize(
    ("sequential", "want"),
    [
        (False, ["fwd_bwd", "persist", "optim", "behind", "await fwd_bwd", "await optim"]),
        (True, ["fwd_bwd", "await fwd_bwd", "persist", "optim", "await optim", "behind"]),
    ],
)
def test_pipelined_schedule_submits_optim_and_the_behind_call_before_awaiting(sequential, want):
    cfg = losses.LossConfig(loss="dppo_divergence_mask", normalization="token_mean")
    tc, rec = OrderClient(), instrumentation.LossCallRecorder(cfg)
    _, result = train_step.train_step(
        tc,
        _datums(),
        losses.make_loss_fn(cfg),
        tinker.AdamParams(learning_rate=1e-3),
        rec,
        {"update_index": 1},
        persist=lambda r: tc.calls.append("persist"),
        sequential=sequential,
        submit_behind=lambda: tc.calls.append("behind") or "sentinel-future",
    )
    assert tc.calls == want and result.behind == "sentinel-future"

"""The engine keeps forward_backward_custom's first pass (a zero-weight cross-entropy forward) with
its graph and runs only the backward when the second pass arrives on the same inputs: bit for bit
what recomputing the forward gives, and never used once the inputs or the weights differ."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_reads import get_parameter_grads, get_parameters

from dppo_harness.constants import BASE_MODEL
from dppo_harness.local_server.engine.engine import Engine

pytestmark = pytest.mark.integration
PRESET = "tiny-qwen3-random"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two engines on the same seed, one recomputing every forward; a small token budget splits a
    request into several micro-batches."""
    pair = {
        retain: Engine(
            tmp_path_factory.mktemp(f"retain-{retain}"),
            model_name=PRESET,
            seed=0,
            batch_window_s=0.0,
            token_budget=96,
            retain_forward=retain,
        )
        for retain in (True, False)
    }
    yield pair
    for eng in pair.values():
        eng.close()


def _data(seed: int, n: int = 6) -> list[tuple[list[int], dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, 15000, size=int(rng.integers(9, 40))).tolist()
        out.append(
            (
                toks[:-1],
                {"target_tokens": np.asarray(toks[1:], np.int64), "weights": np.zeros(len(toks) - 1, np.float32)},
            )
        )
    return out


def _weighted(data, seed: int):
    rng = np.random.default_rng(seed)
    return [(t, {**d, "weights": rng.normal(0, 1, len(t)).astype(np.float32)}) for t, d in data]


def _step(eng: Engine, mid: str, fwd_data, bwd_data) -> dict:
    fwd, _ = eng.forward(mid, fwd_data, "cross_entropy")
    bwd, metrics = eng.forward_backward(mid, bwd_data, "cross_entropy")
    grads = get_parameter_grads(eng, mid)
    optim = eng.optim_step(mid, {"learning_rate": 5e-2, "eps": 1e-8})
    return {
        "fwd": fwd,
        "bwd": bwd,
        "loss": metrics["loss:sum"],
        "grads": grads,
        "optim": optim,
        "params": get_parameters(eng, mid),
    }


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    for x, y in zip(a["fwd"] + a["bwd"], b["fwd"] + b["bwd"], strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in ("logprobs", "elementwise_loss"))
    assert a["loss"] == b["loss"] and a["optim"] == b["optim"]
    for key in ("grads", "params"):
        assert all(torch.equal(a[key][n], b[key][n]) for n in a[key])


def test_second_pass_reuses_the_first_bitwise(engines):
    mids = {r: eng.create_model(BASE_MODEL, 8, 3) for r, eng in engines.items()}
    before = {r: dict(eng.retained_stats) for r, eng in engines.items()}
    for step in range(3):
        data = _data(step)
        runs = {r: _step(eng, mids[r], data, _weighted(data, 100 + step)) for r, eng in engines.items()}
        _assert_bitwise_equal(runs[True], runs[False])
        assert any(float(g.abs().sum()) > 0 for g in runs[True]["grads"].values())
    assert engines[True].retained_stats["reused"] - before[True]["reused"] == 3
    assert engines[False].retained_stats == before[False]  # nothing kept: every pass recomputed


def test_other_inputs_or_changed_weights_are_never_reused(engines):
    eng, fresh = engines[True], engines[False]
    mid, ref = eng.create_model(BASE_MODEL, 8, 4), fresh.create_model(BASE_MODEL, 8, 4)
    reused = eng.retained_stats["reused"]
    a, b = _data(7), _data(8)
    # forward on a, backward on b: the kept pass is for other inputs
    _assert_bitwise_equal(_step(eng, mid, a, _weighted(b, 1)), _step(fresh, ref, a, _weighted(b, 1)))
    # a kept pass is dropped when the weights change before the backward
    for e, m in ((eng, mid), (fresh, ref)):
        e.forward(m, a, "cross_entropy")
        e.forward_backward(m, _weighted(a, 2), "cross_entropy")  # consumes the kept pass (eng only)
        e.forward(m, a, "cross_entropy")
        e.optim_step(m, {"learning_rate": 5e-2, "eps": 1e-8})
    out = {e is eng: e.forward_backward(m, _weighted(a, 3), "cross_entropy")[0] for e, m in ((eng, mid), (fresh, ref))}
    assert all(np.array_equal(x["logprobs"], y["logprobs"]) for x, y in zip(out[True], out[False], strict=True))
    assert eng.retained_stats["reused"] - reused == 1  # only the unchanged-weights backward
    # a forward that carries weights is a plain forward, never kept
    kept = eng.retained_stats["retained"]
    eng.forward(mid, _weighted(a, 4), "cross_entropy")
    assert eng.retained_stats["retained"] == kept

"""Issue 10 section 5: the pipelined update schedule (optim_step and the sentinel forward
submitted behind the custom loss, sentinel awaited later) computes exactly what the old
sequential schedule computed, on the same embedded-server state.

Two training clients of one in-process server, created with the same seed, run the same
updates (2 minibatches x 2 epochs, a sentinel forward after every update, persist before the
optimizer step); one with `sequential=True`, one pipelined. Recorded tensors, loss metrics,
statistics, optimizer responses, sentinel logprobs and the final logprobs must be bitwise equal.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tinker
from sdk_session import end_session
from tinker import types

from dppo_harness import constants
from dppo_harness.instrument import instrumentation
from dppo_harness.local_server.vocab import get_tokenizer
from dppo_harness.loss import losses
from dppo_harness.train import train_step
from dppo_harness.train.clients import full_logprobs, make_datum

os.environ.setdefault("TINKER_TELEMETRY", "0")

QUESTION = (
    "<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether? Write your answer in \\boxed{} format."
    "<|im_end|>\n<|im_start|>assistant\n"
)
MODEL = os.environ.get("DPPO_HARNESS_TEST_MODEL", "tiny-qwen3-random")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from server_in_process import InProcessServer

    from dppo_harness.local_server.engine.engine import Engine

    srv = InProcessServer(Engine(tmp_path_factory.mktemp("rt-run"), model_name=MODEL)).start()
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=constants.LOCAL_API_KEY)
    yield sc
    end_session(sc)
    srv.stop()


def _datums(sc: tinker.ServiceClient) -> list[types.Datum]:
    """Two groups of 4 sampled responses with group-relative advantages (harness datum layout)."""
    prompt = list(get_tokenizer().encode(QUESTION))
    tc = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=4, seed=11)
    sampler = tc.save_weights_and_get_sampling_client()
    out = []
    for g in range(2):
        res = sampler.sample(
            types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=16, seed=g, temperature=1.0)
        ).result(timeout=300)
        for i, s in enumerate(res.sequences):
            tokens, n_prompt = prompt + list(s.tokens), len(prompt) - 1
            adv = [1.0, -1.0, 0.5, -0.5][i]
            out.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        # perturbed sampler logprobs, so the DPPO mask and the PPO clip both have work
                        "logprobs": [0.0] * n_prompt + [lp + 0.3 * ((k % 3) - 1) for k, lp in enumerate(s.logprobs)],
                        "advantages": [0.0] * n_prompt + [adv] * len(s.tokens),
                        "mask": np.array([0.0] * n_prompt + [1.0] * len(s.tokens), dtype=np.float32),
                    },
                )
            )
    return out


def _run(sc: tinker.ServiceClient, data: list[types.Datum], *, sequential: bool) -> dict:
    tc = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=4, seed=5)
    cfg = losses.LossConfig(loss="dppo_divergence_mask", normalization="token_mean")
    recorder = instrumentation.LossCallRecorder(cfg)
    adam = tinker.AdamParams(learning_rate=5e-2)
    sentinel = [
        make_datum(
            d.model_input.to_ints()[:1],
            d.model_input.to_ints()[1:] + [d.loss_fn_inputs["target_tokens"].data[-1]],
            completion_weight=0.0,
        )
        for d in data[::3]
    ]
    persisted, optims, pending, sentinel_lps = [], [], [], []
    for update, idx in enumerate([[0, 1, 2, 3], [4, 5, 6, 7]] * 2, start=1):
        _, upd = train_step.train_step(
            tc,
            [data[i] for i in idx],
            losses.make_loss_fn(cfg),
            adam,
            recorder,
            {"update_index": update},
            persist=lambda r: persisted.append(r.call_index),
            sequential=sequential,
            submit_behind=lambda: tc.forward(sentinel, "cross_entropy"),
        )
        optims.append(upd.optim.model_dump())
        for fut in pending:  # deferred: awaited after the next update, like the diagnostic
            sentinel_lps.append([o["logprobs"].to_numpy() for o in fut.result().loss_fn_outputs])
        pending = [upd.behind]
    sentinel_lps += [[o["logprobs"].to_numpy() for o in f.result().loss_fn_outputs] for f in pending]
    return {
        "records": recorder.records,
        "persisted": persisted,
        "optims": optims,
        "sentinel": sentinel_lps,
        "final": full_logprobs(tc, sentinel),
    }


def test_pipelined_schedule_computes_exactly_what_the_sequential_one_did(served):
    data = _datums(served)
    old = _run(served, data, sequential=True)
    new = _run(served, data, sequential=False)
    assert old["persisted"] == new["persisted"] == [0, 1, 2, 3]
    assert len(old["records"]) == len(new["records"]) == 4
    moved = False
    for a, b in zip(old["records"], new["records"], strict=True):
        assert a.context == b.context and a.dtype == b.dtype
        assert a.stats == b.stats, f"update {a.context['update_index']}: statistics differ"
        assert a.loss_metrics == b.loss_metrics
        assert sorted(a.tensors) == sorted(b.tensors)
        for k in a.tensors:
            np.testing.assert_array_equal(a.tensors[k], b.tensors[k], err_msg=f"tensor {k}")
        moved |= bool(a.stats["dppo/removed"] or a.stats["ppo/clipped"])
    assert moved, "the workload must exercise the mask/clip, else equality says little"
    assert old["optims"] == new["optims"]
    assert len(old["sentinel"]) == len(new["sentinel"]) == 4
    for sa, sb in zip(old["sentinel"], new["sentinel"], strict=True):
        for x, y in zip(sa, sb, strict=True):
            np.testing.assert_array_equal(x, y)
    for x, y in zip(old["final"], new["final"], strict=True):
        np.testing.assert_array_equal(x, y)
    # The sentinels read the weights after each update: they change from update to update.
    assert not np.array_equal(old["sentinel"][0][0], old["sentinel"][-1][0])


def test_the_comparison_fails_on_a_different_trajectory(served):
    """The equality above can fail: the same updates in another minibatch order record different statistics."""
    data = _datums(served)
    a = _run(served, data, sequential=True)
    b = _run(served, [data[i] for i in [4, 5, 6, 7, 0, 1, 2, 3]], sequential=False)
    assert any(x.stats != y.stats for x, y in zip(a["records"], b["records"], strict=True))

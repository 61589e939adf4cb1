"""In-process parity tests of the local engine: the two-pass custom-loss gradient equals direct
autograd, the warm-start recipe is deterministic, and the warm-started model's rollouts carry
signal (the last one builds or loads the cached warm start: minutes on a cold cache)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tinker
import torch
from engine_reads import compute_logprobs, direct_loss_grads, get_parameter_grads
from warm_start_signal import signal_rate

from dppo_harness.constants import BASE_MODEL, STOP_TOKEN_ID
from dppo_harness.local_server.engine import model, warmstart
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.vocab import get_renderer, load_vocab, prompt_messages
from dppo_harness.loss.losses import LossConfig, make_loss_fn

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(tmp_path_factory.mktemp("parity"), model_name="tiny-qwen3-random", batch_window_s=0.0)
    yield eng
    eng.close()


def _rollout_data(engine, prompt: list[int]) -> list[tinker.Datum]:
    seqs = engine.sample(BASE_MODEL, prompt, 6, 24, 1.0, -1, 1.0, [STOP_TOKEN_ID], [], 3, False)
    advs = [1.0, -1.0, 0.5, -0.5, 0.0, 1.0]
    data = []
    for s, a in zip(seqs, advs):
        toks = prompt + s.tokens
        T, P = len(toks) - 1, len(prompt) - 1
        mu, adv, mask = (np.zeros(T, np.float32) for _ in range(3))
        mu[P:], adv[P:], mask[P:] = s.logprobs, a, 1.0
        mu[P::2] = np.log(0.9)  # a confident "sampler" on every other token: |p - q| > delta there
        data.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.asarray(toks[1:], np.int64),
                    "logprobs": mu,
                    "advantages": adv,
                    "mask": mask,
                },
            )
        )
    return data


def _engine_datum(d: tinker.Datum, weights: np.ndarray) -> tuple[list[int], dict[str, np.ndarray]]:
    return d.model_input.to_ints(), {
        "target_tokens": np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy()),
        "weights": weights.astype(np.float32),
    }


def _two_pass_grads(engine, mid, data, loss_fn, sign: float = 1.0) -> dict[str, torch.Tensor]:
    """What the SDK's forward_backward_custom does: CE forward, local loss, CE backward with
    weights = -dloss/dlogprobs (``sign=-1`` sends the wrong-signed weights)."""
    zeros = [np.zeros(len(d.model_input.to_ints()), np.float32) for d in data]
    outs, _ = engine.forward(mid, [_engine_datum(d, z) for d, z in zip(data, zeros)], "cross_entropy")
    lps = [torch.tensor(o["logprobs"]).requires_grad_(True) for o in outs]
    loss, _ = loss_fn(data, lps)
    loss.backward()
    weights = [(-sign * lp.grad).numpy() for lp in lps]
    engine.forward_backward(mid, [_engine_datum(d, w) for d, w in zip(data, weights)], "cross_entropy")
    grads = get_parameter_grads(engine, mid)
    engine.optim_step(mid, {"learning_rate": 0.0})  # clears the accumulated grads
    return grads


@pytest.mark.parametrize("arm", ["dppo_divergence_mask", "grpo_clip_eps0.2"])
def test_custom_loss_gradient_parity(engine, arm):
    prompt = get_renderer().build_generation_prompt(prompt_messages("What is 3 + 4?")).to_ints()
    mid = engine.create_model(BASE_MODEL, 8, 0)
    data = _rollout_data(engine, prompt)
    # Move the policy away from the sampler so ratios leave the trust region and masks engage.
    ce = [_engine_datum(d, np.asarray(d.loss_fn_inputs["mask"].to_numpy())) for d in data]
    for _ in range(3):
        engine.forward_backward(mid, ce, "cross_entropy")
        engine.optim_step(mid, {"learning_rate": 3e-2})
    loss_fn = make_loss_fn(LossConfig(loss=arm, normalization="sum"))
    _, metrics = loss_fn(data, compute_logprobs(engine, mid, [_engine_datum(d, np.zeros(1)) for d in data]))
    two_pass = _two_pass_grads(engine, mid, data, loss_fn)
    direct = direct_loss_grads(
        engine, mid, [_engine_datum(d, np.zeros(1)) for d in data], lambda lps: loss_fn(data, lps)[0]
    )
    flat_two = torch.cat([two_pass[n].flatten() for n in sorted(direct)])
    flat_dir = torch.cat([direct[n].flatten() for n in sorted(direct)])
    assert float(flat_dir.norm()) > 0
    torch.testing.assert_close(flat_two, flat_dir, rtol=1e-4, atol=1e-5 * float(flat_dir.abs().max()))
    flipped = _two_pass_grads(engine, mid, data, loss_fn, sign=-1.0)
    flat_flip = torch.cat([flipped[n].flatten() for n in sorted(direct)])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(flat_flip, flat_dir, rtol=1e-4, atol=1e-5 * float(flat_dir.abs().max()))
    if arm == "dppo_divergence_mask":
        assert metrics.get("dppo/removed", 0.0) > 0  # the trust-region mask really engaged


def test_warm_start_recipe_deterministic():
    cfg = model.TinyConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1
    )
    recipe = {**warmstart.RECIPE, "steps": 3, "batch_size": 2, "warmup_steps": 1}
    vocab = load_vocab()
    _, a = warmstart.load_or_build(cfg, vocab, seed=0, recipe=recipe)
    _, b = warmstart.load_or_build(cfg, vocab, seed=0, recipe=recipe)
    _, c = warmstart.load_or_build(cfg, vocab, seed=1, recipe=recipe)
    assert a["weights_sha256"] == b["weights_sha256"] != c["weights_sha256"]


def test_warm_start_rollouts_carry_signal(tmp_path):
    """The diagnostic's sampling (8 samples per prompt, temperature 1, 512 tokens) on the first 8 of
    its 32 GSM8K train prompts: at least a quarter of the groups carry signal, the share the full
    32 needed (8). Measured: all 32 of 32 groups at full size, 254 of 256 samples stopped, 36 CPU-s."""
    eng = Engine(tmp_path, batch_window_s=0.2)
    try:
        res = signal_rate(eng, n_groups=8, group_size=8, max_tokens=512)
    finally:
        eng.close()
    print(json.dumps({k: v for k, v in res.items() if k != "rewards"}))
    assert res["nonconstant_groups"] >= 2, res

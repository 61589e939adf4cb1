"""The stock tinker SDK drives the embedded server over HTTP: training, sampling, checkpoints.

Two servers: a `python -m dppo_harness.local_server` child for the end-to-end flow, and the same
app in this process (`InProcessServer`) where a test must compare what crossed HTTP with the
engine's own tensors (custom-loss gradient parity, AdamW parity).

Both serve the tiny preset `TEST_MODEL` (restricted vocabulary, CPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
import tinker
import torch
from engine_reads import compute_logprobs, get_parameter_grads, get_parameters
from tinker import types

from dppo_harness import constants
from dppo_harness.local_server.process import LocalServerProcess
from dppo_harness.local_server.vocab import get_tokenizer

os.environ.setdefault("TINKER_TELEMETRY", "0")

QUESTION = (
    "<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May? Write your answer in "
    "\\boxed{} format.<|im_end|>\n<|im_start|>assistant\n"
)
ANSWER = "In May she sold 48 / 2 = 24 clips. Altogether 48 + 24 = 72 clips. \\boxed{72}<|im_end|>"
BASE = constants.BASE_MODEL
# The protocol checks do not depend on the weights. The small random-init preset starts in seconds
# and needs no warm-start cache; DPPO_HARNESS_TEST_MODEL=tiny-qwen3-gsm8k runs them on the
# warm-started model instead.
TEST_MODEL = os.environ.get("DPPO_HARNESS_TEST_MODEL", "tiny-qwen3-random")


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    return list(tok.encode(QUESTION))


@pytest.fixture(scope="module")
def answer(tok) -> list[int]:
    return list(tok.encode(ANSWER))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LocalServerProcess(run_dir=tmp_path_factory.mktemp("sdk-server"), model=TEST_MODEL).start()
    yield srv
    srv.stop()
    assert not srv.alive()


@pytest.fixture(scope="module")
def client(server):
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=constants.LOCAL_API_KEY)
    yield sc
    sc.holder.close()  # SDK 0.25 has no session close: stop the session's heartbeat


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    """Engine + app in this process; tests read gradients and parameters from `engine`."""
    from server_in_process import InProcessServer

    from dppo_harness.local_server.engine.engine import Engine

    engine = Engine(tmp_path_factory.mktemp("inproc-run"), model_name=TEST_MODEL)
    srv = InProcessServer(engine).start()
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=constants.LOCAL_API_KEY)
    yield srv, sc
    sc.holder.close()
    srv.stop()
    engine.close()


# ---- data helpers -------------------------------------------------------------------------------


def sft_datum(tokens: list[int], n_prompt: int) -> types.Datum:
    """Cookbook layout: input tokens[:-1], targets tokens[1:], weight 1 on the answer."""
    weights = [0.0] * (n_prompt - 1) + [1.0] * (len(tokens) - n_prompt)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datums(
    prompt: list[int], responses: list[list[int]], sampler_lps: list[list[float]], advantages: list[float]
) -> list[types.Datum]:
    """The harness's RL datum layout (target_tokens, logprobs, advantages, mask)."""
    out = []
    for resp, lps, adv in zip(responses, sampler_lps, advantages, strict=True):
        tokens = prompt + resp
        n_prompt = len(prompt) - 1
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * n_prompt + list(lps),
                    "advantages": [0.0] * n_prompt + [adv] * len(resp),
                    "mask": np.array([0.0] * n_prompt + [1.0] * len(resp), dtype=np.float32),
                },
            )
        )
    return out


def without_mask(data: list[types.Datum]) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=d.model_input, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "mask"}
        )
        for d in data
    ]


def for_scoring(data: list[types.Datum]) -> list[types.Datum]:
    """Same tokens as cross_entropy datums with zero weights: `forward` returns current logprobs."""
    out = []
    for d in data:
        targets = d.loss_fn_inputs["target_tokens"]
        out.append(
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={"target_tokens": targets, "weights": [0.0] * len(targets.data)},
            )
        )
    return out


def logprobs_of(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy().astype(np.float64) for o in out.loss_fn_outputs]


def sample_group(sampler, prompt: list[int], n: int, seed: int, max_tokens: int = 24) -> types.SampleResponse:
    params = types.SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0)
    return sampler.sample(types.ModelInput.from_ints(prompt), n, params).result(timeout=300)


def harness_loss() -> Callable:
    try:
        from dppo_harness.loss.losses import LossConfig, make_loss_fn
    except ImportError:  # pragma: no cover - losses.py is another module's deliverable
        pytest.fail("dppo_harness.loss.losses.make_loss_fn is missing")
    return make_loss_fn(LossConfig(loss="dppo_divergence_mask", normalization="token_mean"))


def custom_forward_backward(tc, data: list[types.Datum], loss_fn: Callable):
    """`forward_backward_custom` with RL datums. SDK 0.25 accepts only target_tokens / weights per
    datum there (tinker/lib/public_interfaces/training_client.py `_get_custom_loss_forward_data`):
    it sends them as a cross_entropy forward, then a cross_entropy forward_backward with
    weights = -dLoss/dlogprobs. The RL inputs reach the loss through this closure instead."""
    bare = [
        types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
        for d in data
    ]
    return tc.forward_backward_custom(bare, lambda _bare, logprobs: loss_fn(data, logprobs))


def perturbed(lps: list[list[float]], seed: int) -> list[list[float]]:
    """Sampler logprobs moved off the trainer's on about a third of the tokens: half of those get
    sampler probability 0.9 (far outside any trust region), half a shifted log-ratio."""
    rng = np.random.default_rng(seed)
    out = []
    for lp in lps:
        lp = np.asarray(lp, dtype=np.float64).copy()
        pick = rng.random(len(lp))
        lp[pick < 1 / 6] = np.log(0.9)
        lp[(pick >= 1 / 6) & (pick < 1 / 3)] += 0.5
        out.append(list(lp))
    return out


# ---- end-to-end flow over a child-process server ------------------------------------------------


def test_create_client_reports_model_and_lora(client):
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=3)
    info = tc.get_info()
    # The model that computes, by its own name (the requested name is an alias).
    assert info.model_data.model_name == f"local/{TEST_MODEL}" and info.model_data.tokenizer_id == BASE
    assert info.model_id == tc.model_id and info.is_lora is True and info.lora_rank == 8


def test_forward_cross_entropy_and_ppo_losses_match_their_formulas(client, prompt, answer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0)
    datum = sft_datum(prompt + answer, len(prompt))
    fwd = tc.forward([datum], "cross_entropy").result(timeout=300)
    (lp,) = logprobs_of(fwd)
    weights = np.asarray(datum.loss_fn_inputs["weights"].data)
    assert lp.shape == (len(prompt) + len(answer) - 1,) and np.all(lp <= 0)
    assert fwd.metrics["loss:sum"] == pytest.approx(-(lp * weights).sum(), rel=1e-5)

    sampler = tc.save_weights_and_get_sampling_client()
    res = sample_group(sampler, prompt, 4, seed=5)
    responses = [list(s.tokens) for s in res.sequences]
    data = rl_datums(prompt, responses, perturbed([list(s.logprobs) for s in res.sequences], 1), [1.0, -1.0, 0.5, -0.5])
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    cur = logprobs_of(tc.forward(for_scoring(data), "cross_entropy").result(timeout=300))
    out = tc.forward_backward(without_mask(data), "ppo", cfg).result(timeout=300)
    expected = 0.0
    for d, lp_now in zip(data, cur):
        ratio = np.exp(lp_now - np.asarray(d.loss_fn_inputs["logprobs"].data))
        adv = np.asarray(d.loss_fn_inputs["advantages"].data)
        expected += -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv).sum()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    for a, b in zip(logprobs_of(out), cur):
        np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(tinker.RequestFailedError, match="clip_low_threshold|loss_fn_config"):
        tc.forward_backward(without_mask(data), "ppo", {"clip_lo": 0.8}).result(timeout=300)


def test_custom_loss_then_optim_step_updates_weights(client, prompt):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1)
    sampler = tc.save_weights_and_get_sampling_client()
    res = sample_group(sampler, prompt, 4, seed=9)
    data = rl_datums(
        prompt,
        [list(s.tokens) for s in res.sequences],
        perturbed([list(s.logprobs) for s in res.sequences], 2),
        [1.0, -1.0, 1.0, -1.0],
    )
    before = logprobs_of(tc.forward(for_scoring(data), "cross_entropy").result(timeout=300))
    out = custom_forward_backward(tc, data, harness_loss()).result(timeout=300)
    step = tc.optim_step(
        types.AdamParams(learning_rate=2e-3, beta1=0.85, beta2=0.97, eps=1e-8, weight_decay=0.01, grad_clip_norm=5.0)
    ).result(timeout=300)
    after = logprobs_of(tc.forward(for_scoring(data), "cross_entropy").result(timeout=300))
    # SDK 0.25 returns the server's surrogate cross_entropy metrics updated with the loss's own
    assert {"loss:sum", "dppo/removed", "tokens/loss"} <= set(out.metrics)
    assert out.metrics["dppo/removed"] > 0  # the perturbed tokens were masked
    applied = step.metrics
    assert applied["optim/learning_rate"] == pytest.approx(2e-3) and applied["optim/beta1"] == pytest.approx(0.85)
    assert applied["optim/beta2"] == pytest.approx(0.97) and applied["optim/eps"] == pytest.approx(1e-8)
    assert applied["optim/weight_decay"] == pytest.approx(0.01) and applied["optim/grad_clip_norm"] == 5.0
    assert max(np.abs(a - b).max() for a, b in zip(after, before)) > 1e-4


def test_seeded_sampling_is_reproducible_and_logprobs_match_the_trainer(client, prompt):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=2)
    sampler = tc.save_weights_and_get_sampling_client()
    first, again, other = (sample_group(sampler, prompt, 4, seed=s) for s in (11, 11, 12))
    assert [list(s.tokens) for s in first.sequences] == [list(s.tokens) for s in again.sequences]
    assert [list(s.logprobs) for s in first.sequences] == [list(s.logprobs) for s in again.sequences]
    assert [list(s.tokens) for s in first.sequences] != [list(s.tokens) for s in other.sequences]
    for seq in first.sequences:
        assert len(seq.logprobs) == len(seq.tokens) <= 24 and seq.stop_reason in ("stop", "length")
    # The sampled tokens' logprobs are the trainer's (float32 sampler): re-score them with forward.
    data = rl_datums(
        prompt, [list(s.tokens) for s in first.sequences], [list(s.logprobs) for s in first.sequences], [0.0] * 4
    )
    scored = logprobs_of(tc.forward(for_scoring(data), "cross_entropy").result(timeout=300))
    for seq, lp in zip(first.sequences, scored):
        np.testing.assert_allclose(lp[len(prompt) - 1 :], seq.logprobs, atol=2e-4)
    # Prompt logprobs: None first, then the trainer's logprobs of the prompt tokens.
    prompt_lps = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result(timeout=300)
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    np.testing.assert_allclose(prompt_lps[1:], scored[0][: len(prompt) - 1], atol=2e-4)


def test_stop_token_ends_a_sample(client, prompt):
    sampler = client.create_sampling_client(base_model=BASE)
    res = sample_group(sampler, prompt, 2, seed=4, max_tokens=8)
    full = list(res.sequences[0].tokens)
    stop_at = full[2]  # a token this seed draws by step 3
    first = full.index(stop_at)
    params = types.SamplingParams(max_tokens=8, seed=4, temperature=1.0, stop=[int(stop_at)])
    cut = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result(timeout=300)
    assert cut.sequences[0].stop_reason == "stop" and list(cut.sequences[0].tokens) == full[: first + 1]


def test_save_state_names_are_immutable_unless_overwrite(client, prompt, answer):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=4)
    path = tc.save_state("immutable").result(timeout=300).path
    assert path.startswith("tinker://") and path.endswith("/weights/immutable")
    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        tc.save_state("immutable").result(timeout=300)


def test_restore_with_optimizer_continues_exactly_and_weights_only_does_not(client, prompt, answer):
    batch = [sft_datum(prompt + answer, len(prompt))]
    probe = [sft_datum(prompt + answer[: len(answer) // 2], len(prompt))]
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-8)

    def step(tc) -> None:
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(adam).result(timeout=300)  # requests run in submission (seq_id) order

    a = client.create_lora_training_client(base_model=BASE, rank=4, seed=5)
    step(a)
    path = a.save_state("continuity").result(timeout=300).path
    lp_saved = logprobs_of(a.forward(probe, "cross_entropy").result(timeout=300))[0]
    step(a)
    lp_a = logprobs_of(a.forward(probe, "cross_entropy").result(timeout=300))[0]

    b = client.create_training_client_from_state_with_optimizer(path)
    assert b.get_info().lora_rank == 4 and b.model_id != a.model_id
    lp_b0 = logprobs_of(b.forward(probe, "cross_entropy").result(timeout=300))[0]
    step(b)
    lp_b = logprobs_of(b.forward(probe, "cross_entropy").result(timeout=300))[0]

    c = client.create_training_client_from_state(path)
    step(c)
    lp_c = logprobs_of(c.forward(probe, "cross_entropy").result(timeout=300))[0]

    np.testing.assert_array_equal(lp_b0, lp_saved)  # restored weights are bitwise the saved ones
    np.testing.assert_allclose(lp_b, lp_a, rtol=0, atol=1e-6)  # Adam moments restored: same next step
    assert np.abs(lp_c - lp_a).max() > 1e-3  # fresh Adam moments: a different next step


# ---- parity against the engine's own autograd (in-process server) -------------------------------


def _grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-4) -> tuple[bool, float]:
    """Relative L2 error over all LoRA parameters."""
    assert sorted(got) == sorted(want)
    num = sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want)
    den = sum(float(want[k].double().pow(2).sum()) for k in want)
    rel = (num / den) ** 0.5 if den > 0 else float("inf")
    return rel <= rtol, rel


def _minus(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: a[k] - b[k] for k in a}


def _datum_inputs(data: list[types.Datum]) -> list[tuple[list[int], dict[str, np.ndarray]]]:
    return [
        (d.model_input.to_ints(), {"target_tokens": np.asarray(d.loss_fn_inputs["target_tokens"].data)}) for d in data
    ]


def test_custom_loss_gradient_equals_direct_autograd_and_a_sign_flip_fails(inproc, prompt, answer):
    srv, sc = inproc
    engine = srv.engine
    loss_fn = harness_loss()

    def flipped(data, lps):
        loss, metrics = loss_fn(data, lps)
        return -loss, metrics

    def trained_model(seed: int):
        # One supervised step first so both LoRA factors are nonzero (a fresh B is all zeros).
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=seed)
        tc.forward_backward([sft_datum(prompt + answer, len(prompt))], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2, eps=1e-8)).result(timeout=300)
        return tc

    tc = trained_model(21)
    mid = srv.state.models[tc.model_id].engine_id
    sampler = tc.save_weights_and_get_sampling_client()
    res = sample_group(sampler, prompt, 4, seed=13)
    data = rl_datums(
        prompt,
        [list(s.tokens) for s in res.sequences],
        perturbed([list(s.logprobs) for s in res.sequences], 3),
        [1.0, -0.5, 0.25, -1.0],
    )

    out = custom_forward_backward(tc, data, loss_fn).result(timeout=300)
    g_http = get_parameter_grads(engine, mid)
    # Reference: the same loss differentiated straight through the server's model (accumulates).
    lps = compute_logprobs(engine, mid, _datum_inputs(data), grad=True)
    ref_loss, _ = loss_fn(data, [lp.float() for lp in lps])
    ref_loss.backward()
    g_ref = _minus(get_parameter_grads(engine, mid), g_http)

    assert out.metrics["loss:sum"] == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    nonzero = sum(1 for g in g_ref.values() if float(g.abs().max()) > 0)
    assert nonzero == len(g_ref), f"only {nonzero}/{len(g_ref)} LoRA tensors received gradient"
    ok, rel = _grads_match(g_http, g_ref)
    assert ok, f"custom-loss gradient differs from direct autograd: relative L2 error {rel:.3g}"

    # The same check on a sign-flipped loss must fail (and the HTTP gradient is exactly -g_ref).
    tc2 = trained_model(21)
    custom_forward_backward(tc2, data, flipped).result(timeout=300)
    g_flip = get_parameter_grads(engine, srv.state.models[tc2.model_id].engine_id)
    ok_flip, rel_flip = _grads_match(g_flip, g_ref)
    assert not ok_flip and rel_flip == pytest.approx(2.0, rel=1e-3)
    assert _grads_match({k: -v for k, v in g_flip.items()}, g_ref)[0]


def test_optim_step_equals_torch_adamw_on_the_same_gradient(inproc, prompt, answer):
    srv, sc = inproc
    engine = srv.engine
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=31)
    mid = srv.state.models[tc.model_id].engine_id
    batches = [[sft_datum(prompt + answer, len(prompt))], [sft_datum(prompt + answer[:20], len(prompt))]]
    p0 = get_parameters(engine, mid)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in p0.items()}
    names = sorted(ref)
    hyper = dict(lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    opt = torch.optim.AdamW([ref[k] for k in names], **hyper)
    for i, batch in enumerate(batches):
        tc.forward_backward(batch, "cross_entropy").result(timeout=300)
        grads = get_parameter_grads(engine, mid)
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
        clip = 0.0 if i == 0 else 0.5 * norm  # second step: clipping must engage
        applied = (
            tc.optim_step(
                types.AdamParams(
                    learning_rate=hyper["lr"], beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=clip
                )
            )
            .result(timeout=300)
            .metrics
        )
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        for k in names:
            ref[k].grad = grads[k].clone() * scale
        opt.step()
        opt.zero_grad(set_to_none=True)
        got = get_parameters(engine, mid)
        for k in names:
            torch.testing.assert_close(got[k], ref[k].detach(), rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
        assert applied["optim/grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert applied["optim/grad_clip_norm"] == pytest.approx(clip)
    assert any(float((get_parameters(engine, mid)[k] - p0[k]).abs().max()) > 0 for k in names if "lora_A" in k)

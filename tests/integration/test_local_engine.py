"""In-process tests of the local server's model side (tiny random preset: seconds, not minutes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_reads import compute_logprobs, get_parameter_grads, get_parameters

from dppo_harness.constants import BASE_MODEL, STOP_TOKEN_ID
from dppo_harness.local_server.engine import model
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.vocab import get_renderer, load_vocab, prompt_messages

PRESET = "tiny-qwen3-random"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(tmp_path_factory.mktemp("engine"), model_name=PRESET, seed=0, batch_window_s=0.0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    msgs = prompt_messages("Natalia sold 48 clips in April and half as many in May. How many in total?")
    return get_renderer().build_generation_prompt(msgs).to_ints()


def _datum(tokens: list[int], n_prompt: int, sampler_lp=None, adv: float = 1.0):
    T = len(tokens) - 1
    mu = np.zeros(T, np.float32)
    a = np.zeros(T, np.float32)
    a[n_prompt - 1 :] = adv
    if sampler_lp is not None:
        mu[n_prompt - 1 :] = sampler_lp
    return (
        tokens[:-1],
        {"target_tokens": np.asarray(tokens[1:], np.int64), "weights": a.copy(), "logprobs": mu, "advantages": a},
    )


@pytest.fixture(scope="module")
def batch(engine, prompt):
    seqs = engine.sample(BASE_MODEL, prompt, 4, 24, 1.0, -1, 1.0, [STOP_TOKEN_ID], [], 7, False)
    return [
        _datum(prompt + s.tokens, len(prompt), s.logprobs, adv=(1.0 if i % 2 else -1.0)) for i, s in enumerate(seqs)
    ]


def _ce(batch):
    return [(t, {"target_tokens": d["target_tokens"], "weights": d["weights"]}) for t, d in batch]


def test_base_weights_deterministic_and_seed_sensitive(tmp_path):
    a = model.state_sha256(
        model.build_base_model(
            model.TinyConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1
            ),
            100,
            3,
        ).state_dict()
    )
    b = model.state_sha256(
        model.build_base_model(
            model.TinyConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1
            ),
            100,
            3,
        ).state_dict()
    )
    c = model.state_sha256(
        model.build_base_model(
            model.TinyConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1
            ),
            100,
            4,
        ).state_dict()
    )
    assert a == b
    assert a != c


def test_lora_seed_controls_init(engine):
    m1 = engine.create_model(BASE_MODEL, 4, 11)
    m2 = engine.create_model(BASE_MODEL, 4, 11)
    m3 = engine.create_model(BASE_MODEL, 4, 12)
    p1, p2, p3 = (get_parameters(engine, m) for m in (m1, m2, m3))
    assert model.state_sha256(p1) == model.state_sha256(p2)
    assert model.state_sha256(p1) != model.state_sha256(p3)
    assert any("lm_head" in n for n in p1) and any("down_proj" in n for n in p1)  # all linear layers
    assert all(torch.count_nonzero(v) == 0 for n, v in p1.items() if "lora_B" in n)


def test_unknown_model_refused_and_info_is_honest(engine):
    with pytest.raises(UserError, match="Qwen/Qwen3-8B.*not served"):
        engine.create_model("Qwen/Qwen3-8B", 8, 0)
    mid = engine.create_model(BASE_MODEL, 8, 0)
    tm = engine._get(mid)
    assert engine.served_model_name == "local/tiny-qwen3-random" != BASE_MODEL
    assert tm.requested_base_model == BASE_MODEL and tm.lora_rank == 8


def test_loss_functions_match_formulas(engine, batch):
    mid = engine.create_model(BASE_MODEL, 4, 1)
    out_ce, met_ce = engine.forward(mid, _ce(batch), "cross_entropy")
    lp = [o["logprobs"] for o in out_ce]
    assert all(o["logprobs"].dtype == np.float32 for o in out_ce)
    want_ce = sum(float((-lp_T * d["weights"]).sum()) for lp_T, (_, d) in zip(lp, batch))
    scale = sum(float(np.abs(lp_T * d["weights"]).sum()) for lp_T, (_, d) in zip(lp, batch))
    assert met_ce["loss:sum"] == pytest.approx(want_ce, abs=1e-5 * scale)
    # Shift the sampler logprobs so ratios leave [0.9, 1.1] and clipping engages.
    shifted = [
        (t, {**d, "logprobs": d["logprobs"] - 0.3 * (i % 2) + 0.3 * ((i + 1) % 2)}) for i, (t, d) in enumerate(batch)
    ]
    ppo_in = [(t, {k: d[k] for k in ("target_tokens", "logprobs", "advantages")}) for t, d in shifted]
    _out_is, met_is = engine.forward(mid, ppo_in, "importance_sampling")
    out_ppo, met_ppo = engine.forward(mid, ppo_in, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    want_is, want_ppo, scale = 0.0, 0.0, 0.0
    for lp_T, (_, d) in zip(lp, shifted):
        r = np.exp(lp_T.astype(np.float64) - d["logprobs"])
        A = d["advantages"]
        want_is += float(-(r * A).sum())
        want_ppo += float(-np.minimum(r * A, np.clip(r, 0.9, 1.1) * A).sum())
        scale += float(np.abs(r * A).sum())
    assert met_is["loss:sum"] == pytest.approx(want_is, abs=1e-5 * scale)
    assert met_ppo["loss:sum"] == pytest.approx(want_ppo, abs=1e-5 * scale)
    assert met_ppo["loss:sum"] != pytest.approx(met_is["loss:sum"], rel=1e-3)  # clipping changed it
    assert sum(float(o["elementwise_loss"].sum()) for o in out_ppo) == pytest.approx(
        met_ppo["loss:sum"], abs=1e-5 * scale
    )


def test_bad_inputs_are_named(engine, batch):
    mid = engine.create_model(BASE_MODEL, 4, 1)
    t, d = batch[0]
    with pytest.raises(UserError, match="weights"):
        engine.forward(mid, [(t, {"target_tokens": d["target_tokens"]})], "cross_entropy")
    with pytest.raises(UserError, match="advantages.*length"):
        engine.forward(mid, [(t, {**d, "advantages": d["advantages"][:-1]})], "ppo")
    with pytest.raises(UserError, match="unsupported loss_fn"):
        engine.forward(mid, _ce(batch), "dro")
    with pytest.raises(UserError, match="unknown model id"):
        engine.forward("nope", _ce(batch), "cross_entropy")


def test_gradients_accumulate_until_optim_step(engine, batch):
    mid = engine.create_model(BASE_MODEL, 4, 2)
    engine.forward_backward(mid, _ce(batch), "cross_entropy")
    g1 = get_parameter_grads(engine, mid)
    engine.forward_backward(mid, _ce(batch), "cross_entropy")
    g2 = get_parameter_grads(engine, mid)
    assert any(float(v.abs().sum()) > 0 for v in g1.values())
    for n in g1:
        torch.testing.assert_close(g2[n], 2 * g1[n], rtol=1e-5, atol=1e-7)
    engine.optim_step(mid, {"learning_rate": 1e-3})
    assert all(float(v.abs().sum()) == 0 for v in get_parameter_grads(engine, mid).values())


@pytest.mark.parametrize(
    "adam",
    [
        {"learning_rate": 3e-3, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.1, "grad_clip_norm": 0.0},
        {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.05},
    ],
)
def test_optim_step_equals_torch_adamw(engine, batch, adam):
    mid = engine.create_model(BASE_MODEL, 4, 3)
    refs = None
    for _step in range(2):  # two steps: moments carry over
        engine.forward_backward(mid, _ce(batch), "cross_entropy")
        params, grads = get_parameters(engine, mid), get_parameter_grads(engine, mid)
        if refs is None:
            refs = {n: p.clone().requires_grad_(True) for n, p in params.items()}
            ref_opt = torch.optim.AdamW(
                list(refs.values()),
                lr=adam["learning_rate"],
                betas=(adam["beta1"], adam["beta2"]),
                eps=adam["eps"],
                weight_decay=adam["weight_decay"],
            )
        for n, p in refs.items():
            p.grad = grads[n].clone()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        if adam["grad_clip_norm"] > 0:
            assert float(norm) > adam["grad_clip_norm"]  # clipping really engages in this case
            torch.nn.utils.clip_grad_norm_(list(refs.values()), adam["grad_clip_norm"])
        ref_opt.step()
        metrics = engine.optim_step(mid, adam)
        for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
            assert metrics[f"optim/{k}"] == adam[k]
        after = get_parameters(engine, mid)
        for n in refs:
            assert torch.equal(after[n], refs[n].detach()), n
    # The comparison can fail: a different weight decay gives different parameters.
    other = {**adam, "weight_decay": adam["weight_decay"] + 0.5}
    mid2 = engine.create_model(BASE_MODEL, 4, 3)
    engine.forward_backward(mid2, _ce(batch), "cross_entropy")
    engine.optim_step(mid2, other)
    mid3 = engine.create_model(BASE_MODEL, 4, 3)
    engine.forward_backward(mid3, _ce(batch), "cross_entropy")
    engine.optim_step(mid3, adam)
    a, b = get_parameters(engine, mid2), get_parameters(engine, mid3)
    assert any(not torch.equal(a[n], b[n]) for n in a)


def test_optim_step_rejects_bad_params(engine):
    mid = engine.create_model(BASE_MODEL, 4, 0)
    with pytest.raises(UserError, match="beta1"):
        engine.optim_step(mid, {"learning_rate": 1e-3, "beta1": 1.5})


def test_state_roundtrip_bitwise_and_restore_continuity(engine, batch):
    adam = {"learning_rate": 5e-3, "eps": 1e-8}
    mid = engine.create_model(BASE_MODEL, 4, 5)
    engine.forward_backward(mid, _ce(batch), "cross_entropy")
    engine.optim_step(mid, adam)
    path = engine.save_state(mid, "after-step-1")
    assert path == f"tinker://{mid}/weights/after-step-1"
    with pytest.raises(UserError, match="already exists"):
        engine.save_state(mid, "after-step-1")
    assert engine.save_state(mid, "after-step-1", overwrite=True) == path
    a = engine.create_model_from_state(path, with_optimizer=True)
    b = engine.create_model_from_state(path, with_optimizer=True)
    la, _ = engine.forward(a, _ce(batch), "cross_entropy")
    lb, _ = engine.forward(b, _ce(batch), "cross_entropy")
    lm, _ = engine.forward(mid, _ce(batch), "cross_entropy")
    for x, y, z in zip(la, lb, lm):
        assert np.array_equal(x["logprobs"], y["logprobs"]) and np.array_equal(x["logprobs"], z["logprobs"])
    w = engine.create_model_from_state(path, with_optimizer=False)
    for m in (mid, a, w):
        engine.forward_backward(m, _ce(batch), "cross_entropy")
        engine.optim_step(m, adam)
    after = {m: engine.forward(m, _ce(batch), "cross_entropy")[0] for m in (mid, a, w)}
    for x, y in zip(after[mid], after[a]):
        assert np.array_equal(x["logprobs"], y["logprobs"])
    diff = max(float(np.abs(x["logprobs"] - y["logprobs"]).max()) for x, y in zip(after[mid], after[w]))
    assert diff > 1e-4  # fresh Adam moments take a different step


def test_load_state_checks(engine, batch):
    mid = engine.create_model(BASE_MODEL, 4, 5)
    path = engine.save_state(mid, "rank4")
    other = engine.create_model(BASE_MODEL, 8, 5)
    with pytest.raises(UserError, match="rank"):
        engine.load_state(other, path, with_optimizer=True)
    with pytest.raises(UserError, match="not found"):
        engine.load_state(mid, f"tinker://{mid}/weights/missing", with_optimizer=False)
    with pytest.raises(UserError, match="malformed"):
        engine.load_state(mid, "s3://x", with_optimizer=False)
    with pytest.raises(UserError, match="must match"):
        engine.save_state(mid, "../escape")


def test_sampling_seed_reproducible_and_in_vocab(engine, prompt):
    args = (BASE_MODEL, prompt, 3, 16, 1.0, -1, 1.0, [STOP_TOKEN_ID], [])
    s1 = engine.sample(*args, 123, False)
    s2 = engine.sample(*args, 123, False)
    s3 = engine.sample(*args, 124, False)
    assert [s.tokens for s in s1] == [s.tokens for s in s2]
    assert [s.logprobs for s in s1] == [s.logprobs for s in s2]
    assert [s.tokens for s in s1] != [s.tokens for s in s3]
    vocab = load_vocab()
    assert {t for s in s1 + s3 for t in s.tokens} <= set(vocab.real_ids.tolist())
    assert all(len(s.logprobs) == len(s.tokens) for s in s1)


def test_sampled_logprobs_match_trainer(engine, prompt):
    mid = engine.create_model(BASE_MODEL, 4, 0)  # fresh LoRA (B=0) == base model
    seqs = engine.sample(BASE_MODEL, prompt, 2, 20, 1.0, -1, 1.0, [], [], 9, True)
    out, _ = engine.forward(mid, _ce([_datum(prompt + s.tokens, len(prompt)) for s in seqs]), "cross_entropy")
    for s, o in zip(seqs, out):
        np.testing.assert_allclose(o["logprobs"][len(prompt) - 1 :], s.logprobs, atol=1e-4)
        assert s.prompt_logprobs[0] is None and len(s.prompt_logprobs) == len(prompt)
        np.testing.assert_allclose(o["logprobs"][: len(prompt) - 1], s.prompt_logprobs[1:], atol=1e-4)


def test_greedy_is_argmax_and_stops(engine, prompt):
    mid = engine.create_model(BASE_MODEL, 4, 0)
    g1 = engine.sample(BASE_MODEL, prompt, 2, 12, 0.0, -1, 1.0, [], [], None, False)
    g2 = engine.sample(BASE_MODEL, prompt, 1, 12, 0.0, -1, 1.0, [], [], 99, False)
    assert g1[0].tokens == g1[1].tokens == g2[0].tokens and g1[0].stop_reason == "length"
    # each greedy token is the argmax of the trainer's distribution at its position
    toks = prompt + g1[0].tokens
    lp_full = compute_logprobs(engine, mid, [(toks[:-1], {"target_tokens": np.asarray(toks[1:])})])[0]
    np.testing.assert_allclose(lp_full[len(prompt) - 1 :].numpy(), g1[0].logprobs, atol=1e-4)
    stop_tok = g1[0].tokens[4]
    first = g1[0].tokens.index(stop_tok)
    s = engine.sample(BASE_MODEL, prompt, 1, 12, 0.0, -1, 1.0, [stop_tok], [], None, False)[0]
    assert s.stop_reason == "stop" and s.tokens == g1[0].tokens[: first + 1]
    text = engine.tokenizer.decode(g1[0].tokens[first : first + 2])
    s = engine.sample(BASE_MODEL, prompt, 1, 12, 0.0, -1, 1.0, [], [text], None, False)[0]
    assert s.stop_reason == "stop" and len(s.tokens) <= first + 2
    assert text in engine.tokenizer.decode(s.tokens)


def test_top_k_one_is_greedy(engine, prompt):
    g = engine.sample(BASE_MODEL, prompt, 1, 8, 0.0, -1, 1.0, [], [], None, False)[0]
    k1 = engine.sample(BASE_MODEL, prompt, 3, 8, 1.0, 1, 1.0, [], [], 5, False)
    p0 = engine.sample(BASE_MODEL, prompt, 3, 8, 1.0, -1, 1e-6, [], [], 6, False)
    assert all(s.tokens == g.tokens for s in k1 + p0)


def test_out_of_vocab_ids(engine, prompt):
    vocab = load_vocab()
    oov = next(i for i in range(200000, 248000) if i not in set(vocab.real_ids.tolist()))
    assert int(vocab.to_local([oov])[0]) == vocab.unk_index
    mid = engine.create_model(BASE_MODEL, 4, 0)
    toks = prompt[:10] + [oov] + prompt[10:20]
    out, _met = engine.forward(
        mid,
        [(toks[:-1], {"target_tokens": np.asarray(toks[1:]), "weights": np.zeros(len(toks) - 1, np.float32)})],
        "cross_entropy",
    )
    lp = out[0]["logprobs"]
    assert lp[9] == model.OOV_TARGET_LOGPROB and np.isfinite(lp).all()
    seqs = engine.sample(BASE_MODEL, toks, 2, 8, 1.0, -1, 1.0, [], [], 1, False)
    assert {t for s in seqs for t in s.tokens} <= set(vocab.real_ids.tolist())


def test_sampling_from_saved_weights(engine, batch, prompt):
    mid = engine.create_model(BASE_MODEL, 4, 8)
    for _ in range(3):
        engine.forward_backward(mid, _ce(batch), "cross_entropy")
        engine.optim_step(mid, {"learning_rate": 2e-2})
    sp = engine.save_for_sampler(mid, "trained")
    assert sp == f"tinker://{mid}/sampler_weights/trained"
    s = engine.sample(sp, prompt, 1, 10, 1.0, -1, 1.0, [], [], 4, False)[0]
    toks = prompt + s.tokens
    lp = compute_logprobs(engine, mid, [(toks[:-1], {"target_tokens": np.asarray(toks[1:])})])[0][len(prompt) - 1 :]
    np.testing.assert_allclose(lp.numpy(), s.logprobs, atol=1e-4)  # sampler == trained weights
    base = engine.sample(BASE_MODEL, prompt, 1, 10, 1.0, -1, 1.0, [], [], 4, False)[0]
    assert base.logprobs != s.logprobs
    with pytest.raises(UserError, match="already exists"):
        engine.save_for_sampler(mid, "trained")
    engine.forward_backward(mid, _ce(batch), "cross_entropy")
    engine.optim_step(mid, {"learning_rate": 2e-2})
    assert engine.save_for_sampler(mid, "trained", overwrite=True) == sp
    s2 = engine.sample(sp, prompt, 1, 10, 1.0, -1, 1.0, [], [], 4, False)[0]
    assert s2.logprobs != s.logprobs  # the overwritten weights are used, not a stale cached sampler
    with pytest.raises(UserError, match="cannot sample"):
        engine.sample("Qwen/Qwen3-8B", prompt, 1, 4, 1.0, -1, 1.0, [], [], 0, False)

"""Packed loss path: golden parity in float64, SDK compatibility, metrics, input handling."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import TrainingClient

from dppo_harness.loss import losses
from dppo_harness.loss.loss_registry import loss_names
from dppo_harness.loss.losses import LossConfig, make_loss_fn, token_terms
from dppo_harness.loss.terms import LossStats, stats
from dppo_harness.train import train_step

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "dppo_golden_v1.json"
CASES = json.loads(GOLDEN.read_text())["cases"]
DPPO_MEAN = LossConfig("dppo_divergence_mask", "token_mean")
GRPO_SUM = LossConfig("grpo_clip_eps0.2", "sum")


def _flat(case, key):
    return torch.tensor(case[key], dtype=torch.float64).flatten()


def _datum(mu, adv, mask, tokens=None):
    T = len(mu)
    tokens = tokens if tokens is not None else list(range(1, T + 2))
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "logprobs": np.asarray(mu, dtype=np.float32),
            "advantages": np.asarray(adv, dtype=np.float32),
            "mask": np.asarray(mask, dtype=np.float32),
        },
    )


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_dppo_float64_parity_with_golden(case):
    lp = _flat(case, "log_prob").requires_grad_(True)
    mu, adv, mask = _flat(case, "rollout_log_prob"), _flat(case, "advantages"), _flat(case, "response_mask")
    call = losses.packed_loss_call(lp, mu, adv, mask, DPPO_MEAN)
    loss, metrics, terms = call.loss, call.stats, call.terms
    loss.backward()
    assert torch.equal(terms.dppo_keep_N.double(), _flat(case["dppo"], "mask"))
    assert math.isclose(loss.item(), case["dppo"]["loss"], rel_tol=1e-12, abs_tol=1e-15)
    torch.testing.assert_close(lp.grad, _flat(case["dppo"], "grad_log_prob"), rtol=1e-12, atol=1e-15)
    diff = _flat(case["dppo"], "prob_minus_rollout_prob")
    torch.testing.assert_close(terms.prob_diff_N[mask > 0], diff[mask > 0], rtol=1e-12, atol=1e-15)
    assert metrics["dppo/removed"] == case["dppo"]["metrics"]["n_invalid_tr_tokens"]
    n_nonzero = metrics["tokens/nonzero_adv"]
    assert metrics["dppo/masked_frac_nonzero_adv"] == pytest.approx(
        case["dppo"]["metrics"]["actor/pg_clipfrac"] * (n_nonzero + 1e-8) / max(n_nonzero, 1), abs=1e-12
    )


@pytest.mark.parametrize("case", [c for c in CASES if c["name"] not in ("tails", "ratio_cap")], ids=lambda c: c["name"])
def test_grpo_float64_parity_with_golden_no_dual_clip(case):
    # tails/ratio_cap hold |log r| > 20 tokens where verl's clamp differs from Tinker's ppo by design.
    lp = _flat(case, "log_prob").requires_grad_(True)
    mu, adv, mask = _flat(case, "rollout_log_prob"), _flat(case, "advantages"), _flat(case, "response_mask")
    call = losses.packed_loss_call(lp, mu, adv, mask, LossConfig("grpo_clip_eps0.2", "token_mean"))
    loss, metrics = call.loss, call.stats
    loss.backward()
    ref = case["grpo_no_dual_clip"]
    assert math.isclose(loss.item(), ref["loss"], rel_tol=1e-12, abs_tol=1e-15)
    torch.testing.assert_close(lp.grad, _flat(ref, "grad_log_prob"), rtol=1e-12, atol=1e-15)
    n = metrics["tokens/loss"]
    assert metrics["ppo/clipped"] == round(ref["clipfrac"] * (n + 1e-8))


class _Answered:
    """An already answered SDK future (sync and async)."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value

    async def result_async(self, timeout=None):
        return self.value


class _Holder:
    """All the TrainingClient needs of its holder here: a coroutine run to completion."""

    def run_coroutine_threadsafe(self, coro):
        fut = concurrent.futures.Future()
        fut.set_result(asyncio.run(coro))
        return fut


class _TinyService(TrainingClient):
    """The SDK's own TrainingClient (its forward_backward_custom, public) over a tiny fake service:
    its public `forward` / `forward_backward` / `optim_step` answer at once, recording what was sent;
    the model's current log-probs of datum i are `logprobs[i]`."""

    def __init__(self, logprobs):
        super().__init__(_Holder(), model_seq_id=0, model_id="fake:train:0")
        self.logprobs, self.sent = logprobs, []

    def answer(self, metrics):
        outs = [{"logprobs": tinker.TensorData.from_numpy(lp)} for lp in self.logprobs]
        return _Answered(tinker.types.ForwardBackwardOutput("ArrayRecord", outs, metrics))

    def forward(self, data, loss_fn, loss_fn_config=None):
        self.sent.append(("forward", loss_fn, data))
        return self.answer({})

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        self.sent.append(("forward_backward", loss_fn, data))
        return self.answer({"loss:sum": 0.0})

    def optim_step(self, adam_params):
        self.sent.append(("optim_step", adam_params, None))
        return _Answered(tinker.types.OptimStepResponse(metrics={}))


def test_loss_fn_is_usable_by_sdk_forward_backward_custom():
    """The loss through tinker 0.25's public `forward_backward_custom` (its client-side custom
    loss: a cross-entropy forward, the loss, a cross-entropy backward with weights = -dL/dlogprobs),
    as the harness's one training path (`train_step.minibatch_update`) calls it."""
    rng = np.random.default_rng(1)
    data, current = [], []
    for T, p in ((9, 4), (5, 2), (3, 4)):  # last datum is prompt only
        mu = np.log(rng.uniform(0.05, 1, T))
        mask = (np.arange(T) >= p - 1).astype(np.float32)
        data.append(_datum(mu, mask * 0.5, mask))
        current.append((mu + rng.normal(0, 0.3, T)).astype(np.float32))
    # 0.25 refuses datums carrying the RL inputs (0.38 dropped them): the harness sends bare ones.
    with pytest.raises(ValueError, match="unexpected keys"):
        _TinyService(current).forward_backward_custom(data, make_loss_fn(DPPO_MEAN))

    service = _TinyService(current)
    out = train_step.minibatch_update(service, data, make_loss_fn(DPPO_MEAN), tinker.AdamParams(learning_rate=1e-5))
    adam = service.sent[2][1]
    assert [(call, fn) for call, fn, _ in service.sent] == [
        ("forward", "cross_entropy"),
        ("forward_backward", "cross_entropy"),
        ("optim_step", adam),
    ]
    assert adam.learning_rate == 1e-5
    forward, backward = service.sent[0][2], service.sent[1][2]
    for sent in (forward, backward):
        assert len(sent) == 3 and all(set(d.loss_fn_inputs) == {"target_tokens", "weights"} for d in sent)
    assert not any(np.any(d.loss_fn_inputs["weights"].to_numpy()) for d in forward)  # forward: zero weights
    weights = [d.loss_fn_inputs["weights"].to_numpy() for d in backward]
    assert not np.any(weights[2])  # prompt-only datum: zero weights, but a gradient exists
    assert np.all(weights[0][:3] == 0) and np.any(weights[0][3:])
    metrics = out.fwd_bwd.metrics
    assert all(isinstance(v, float) for v in metrics.values())
    assert set(LossStats.names(returned=True)) | {"loss/arm_dppo", "loss/normalization_sum"} <= set(metrics)


def test_every_logprob_tensor_gets_a_gradient_even_without_active_tokens():
    data = [_datum([-1.0, -2.0], [0.0, 0.0], [1.0, 1.0]), _datum([0.0, -3.0, -1.0], [3.0, 3.0, 3.0], [0.0, 0.0, 0.0])]
    for cfg in (DPPO_MEAN, GRPO_SUM):
        lps = [torch.tensor([-1.5, -0.5], requires_grad=True), torch.tensor([-9.0, -0.1, -2.0], requires_grad=True)]
        loss, metrics = make_loss_fn(cfg)(data, lps)
        loss.backward()
        assert all(lp.grad is not None and torch.count_nonzero(lp.grad) == 0 for lp in lps)
        assert loss.item() == 0.0 and metrics["tokens/loss"] == 2 and metrics["tokens/nonzero_adv"] == 0


def test_empty_call_is_finite():
    loss, metrics = make_loss_fn(DPPO_MEAN)([], [])
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())


def test_inputs_are_not_mutated():
    rng = np.random.default_rng(2)
    mu = np.log(rng.uniform(0.01, 1, 12))
    mask = np.r_[np.zeros(4), np.ones(8)]
    datum = _datum(mu, mask * -0.7, mask)
    before = {k: v.to_numpy().copy() for k, v in datum.loss_fn_inputs.items()}
    lp = torch.tensor(mu + rng.normal(0, 0.5, 12), dtype=torch.float32, requires_grad=True)
    lp_before = lp.detach().clone()
    for cfg in (DPPO_MEAN, GRPO_SUM):
        loss, _ = make_loss_fn(cfg)([datum], [lp])
        loss.backward()
        lp.grad = None
    assert torch.equal(lp.detach(), lp_before)
    for k, v in datum.loss_fn_inputs.items():
        assert np.array_equal(v.to_numpy(), before[k]), k


def test_mask_zero_and_zero_advantage_tokens_never_count_as_engagement():
    # Loss tokens with A == 0 and huge drift both ways; prompt tokens with junk that would fire everything.
    q = np.array([0.9, 0.1, 0.5, 0.5])
    p = np.array([0.1, 0.9, 0.5, 0.5])
    mu = np.r_[np.zeros(3), np.log(q)]
    lp = np.r_[np.array([-50.0, 0.0, -50.0]), np.log(p)]
    adv = np.r_[np.array([5.0, -5.0, 5.0]), np.zeros(4)]
    mask = np.r_[np.zeros(3), np.ones(4)]
    for cfg in (DPPO_MEAN, GRPO_SUM):
        lpt = torch.tensor(lp, requires_grad=True)
        loss, m = make_loss_fn(cfg)([_datum(mu, adv, mask)], [lpt])
        loss.backward()
        assert m["tokens/loss"] == 4 and m["tokens/nonzero_adv"] == 0
        assert m["dppo/removed"] == m["dppo/removed_pos_adv"] == m["dppo/removed_neg_adv"] == 0
        assert m["dppo/masked_frac_loss_tokens"] == m["dppo/masked_frac_nonzero_adv"] == 0
        assert m["ppo/clipped"] == 0 and m["dppo/ratio_cap_hits"] == 0
        assert m["dppo/mask_zero_adv"] == 1  # p-q = -0.8 takes the negative branch: recorded, not engagement
        assert m["dppo/exceed_pos"] == 1 and m["dppo/exceed_neg"] == 1  # drift counts over loss tokens
        assert torch.count_nonzero(lpt.grad) == 0


def _single(p, q, a):
    lp = torch.tensor(np.log(p), dtype=torch.float64, requires_grad=True)
    mu = torch.tensor(np.log(q), dtype=torch.float64)
    adv = torch.tensor(a, dtype=torch.float64)
    mask = torch.ones_like(mu)
    call = losses.packed_loss_call(lp, mu, adv, mask, DPPO_MEAN)
    call.loss.backward()
    return call.terms, call.stats, lp.grad


def test_must_fire_and_must_not_fire_both_signs():
    #            A>0 up   A>0 small  A>0 down(recovery)  A<0 down  A<0 small  A<0 up(recovery)
    d = DPPO_MEAN.dppo_delta  # the plan's: the up/down tokens sit 0.01 beyond it, the small ones 0.01 inside
    p = np.array([0.5 + d + 0.01, 0.5 + d - 0.01, 0.05, 0.5 - d - 0.01, 0.5 - d + 0.01, 0.95])
    q = np.array([0.5, 0.5, 0.9, 0.5, 0.5, 0.1])
    a = np.array([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    terms, m, grad = _single(p, q, a)
    assert terms.dppo_keep_N.tolist() == [False, True, True, False, True, True]
    assert m["dppo/removed_pos_adv"] == 1 and m["dppo/removed_neg_adv"] == 1
    assert grad[0] == 0 and grad[3] == 0
    assert torch.all(grad[[1, 2]] < 0) and torch.all(grad[[4, 5]] > 0)
    # The recovery token A<0 with r = 9.5 keeps its full (uncapped, r <= C) weight.
    assert grad[5].item() == pytest.approx(9.5 / 6, rel=1e-12)  # -A * r / n with A = -1


def test_exact_boundary_tokens_are_kept():
    case = next(c for c in CASES if c["name"] == "boundary_exact")
    lp, mu = _flat(case, "log_prob"), _flat(case, "rollout_log_prob")
    adv, mask = _flat(case, "advantages"), _flat(case, "response_mask")
    terms = token_terms(lp, mu, adv, mask, DPPO_MEAN)
    diff = terms.prob_diff_N
    delta = DPPO_MEAN.dppo_delta  # the plan's, as the golden boundary rows were generated at
    at_pos = (diff == delta) & (adv > 0)
    at_neg = (diff == -delta) & (adv < 0)
    assert at_pos.any() and at_neg.any()
    assert terms.dppo_keep_N[at_pos | at_neg].all()
    above = (diff > delta) & (adv > 0)
    assert above.any() and not terms.dppo_keep_N[above].any()


def test_ratio_cap_and_counterfactual_clip_metrics():
    # r = 20 with tiny probabilities: DPPO keeps it with weight C = 10; GRPO would clip it.
    p, q = np.array([2e-5, 0.5]), np.array([1e-6, 0.5])
    terms, m, grad = _single(p, q, np.array([1.0, 1.0]))
    assert terms.ratio_cap_hit_N.tolist() == [True, False]
    assert m["dppo/ratio_cap_hits"] == 1 and m["ppo/clipped"] == 1
    assert grad[0].item() == pytest.approx(-10.0 / 2, rel=1e-12)


def test_metrics_are_the_same_whichever_arm_trains():
    rng = np.random.default_rng(3)
    N = 400
    mu = torch.tensor(np.log(rng.uniform(0.01, 1, N)))
    lp = mu + torch.tensor(rng.normal(0, 0.5, N))
    adv = torch.tensor(rng.choice([-1.0, 0.0, 0.5], N))
    mask = torch.tensor((rng.uniform(size=N) > 0.2).astype(np.float64))
    ms = []
    for cfg in (DPPO_MEAN, GRPO_SUM):
        call = losses.packed_loss_call(lp.clone().requires_grad_(True), mu, adv, mask, cfg)
        ms.append(make_loss_fn(cfg).metrics(call.stats))
    for k in ms[0]:
        if not k.startswith("loss/"):
            assert ms[0][k] == ms[1][k], k
    assert (ms[0]["loss/arm_dppo"], ms[1]["loss/arm_dppo"]) == (1.0, 0.0)
    assert (ms[0]["loss/normalization_sum"], ms[1]["loss/normalization_sum"]) == (0.0, 1.0)
    # Quantiles: numpy's default linear interpolation over loss tokens.
    on = mask.numpy() > 0
    d = (np.exp(lp.numpy()) - np.exp(mu.numpy()))[on]
    assert ms[0]["drift/signed_p90"] == pytest.approx(np.quantile(d, 0.9), abs=1e-15)
    assert ms[0]["drift/abs_p99"] == pytest.approx(np.quantile(np.abs(d), 0.99), abs=1e-15)
    assert ms[0]["drift/signed_min"] == pytest.approx(d.min(), abs=1e-15)
    nz = on & (adv.numpy() != 0)
    assert ms[0]["dppo/masked_frac_loss_tokens"] == pytest.approx(ms[0]["dppo/removed"] / on.sum())
    assert ms[0]["dppo/masked_frac_nonzero_adv"] == pytest.approx(ms[0]["dppo/removed"] / nz.sum())
    assert ms[0]["ppo/clip_frac_nonzero_adv"] == pytest.approx(ms[0]["ppo/clipped"] / nz.sum())


def test_sum_gradient_is_token_count_times_mean_gradient():
    rng = np.random.default_rng(4)
    mu = torch.tensor(np.log(rng.uniform(0.01, 1, 50)))
    lp0 = mu + torch.tensor(rng.normal(0, 0.4, 50))
    adv = torch.tensor(rng.normal(size=50))
    mask = torch.tensor((np.arange(50) > 9).astype(np.float64))
    grads = {}
    for norm in ("sum", "token_mean"):
        lp = lp0.clone().requires_grad_(True)
        loss = losses.packed_loss_call(lp, mu, adv, mask, LossConfig("dppo_divergence_mask", norm)).loss
        loss.backward()
        grads[norm] = lp.grad
    torch.testing.assert_close(grads["sum"], grads["token_mean"] * 40, rtol=1e-13, atol=0)


@pytest.mark.parametrize("kind", ["numpy", "torch", "tensordata"])
def test_unpack_reads_mask_in_any_container(kind):  # tinker.Datum stores each as TensorData
    mask = np.array([0.0, 1.0, 1.0], dtype=np.float32)
    wrap = {
        "numpy": lambda a: a,
        "torch": torch.from_numpy,
        "tensordata": tinker.TensorData.from_numpy,
    }[kind]
    datum = _namespace_datum(logprobs=np.zeros(3), advantages=np.ones(3), mask=wrap(mask))
    inputs = losses.unpack_datums([datum])
    assert inputs.mask_N.tolist() == [0.0, 1.0, 1.0] and inputs.lengths_S.tolist() == [3]
    assert inputs.first_token_S.tolist() == [7] and inputs.target_tokens_N.dtype == np.int64


def _namespace_datum(**inputs):
    """A datum of the given loss inputs (tinker.Datum converts numpy, torch and lists to TensorData)."""
    fields = dict(target_tokens=np.arange(3), **inputs)
    return tinker.Datum(loss_fn_inputs=fields, model_input=tinker.ModelInput.from_ints([7, 1, 2]))


def test_bad_inputs_raise_clear_errors():
    good = dict(logprobs=np.zeros(3), advantages=np.ones(3), mask=np.ones(3))
    with pytest.raises(ValueError, match="lacks \\['mask'\\]"):
        losses.unpack_datums([_namespace_datum(**{k: v for k, v in good.items() if k != "mask"})])
    with pytest.raises(ValueError, match="'advantages'\\] has length 2"):
        losses.unpack_datums([_namespace_datum(**{**good, "advantages": np.ones(2)})])
    with pytest.raises(ValueError, match="0/1"):
        losses.unpack_datums([_namespace_datum(**{**good, "mask": np.array([0.0, 0.5, 1.0])})])
    with pytest.raises(AttributeError, match="loss_fn_inputs"):  # not a Datum
        losses.unpack_datums([object()])
    d = _datum([0.0, -1.0, -1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="shape \\(2,\\)"):
        make_loss_fn(DPPO_MEAN)([d], [torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match="non-finite current logprob"):
        make_loss_fn(DPPO_MEAN)([d], [torch.tensor([0.0, float("nan"), -1.0], requires_grad=True)])
    registered = ", ".join(loss_names())
    with pytest.raises(ValueError, match=re.escape(f"'ppo' is not a registered loss (registered: {registered})")):
        LossConfig("ppo", "sum")
    with pytest.raises(ValueError, match="normalization"):
        LossConfig("dppo_divergence_mask", "mean")


def test_nan_junk_on_prompt_positions_does_not_leak():
    d = _datum([float("nan"), -1.0, -1.0], [float("nan"), 1.0, 1.0], [0.0, 1.0, 1.0])
    lp = torch.tensor([float("nan"), -0.9, -1.2], requires_grad=True)
    loss, m = make_loss_fn(DPPO_MEAN)([d], [lp])
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all() and lp.grad[0] == 0
    assert all(math.isfinite(v) for v in m.values())


def test_the_loss_fn_reports_the_statistics_of_its_own_terms():
    rng = np.random.default_rng(5)
    data, lps = [], []
    for T, p in ((30, 6), (12, 3)):
        mu = np.log(rng.uniform(0.02, 1, T))
        mask = (np.arange(T) >= p - 1).astype(np.float32)
        data.append(_datum(mu, mask * rng.choice([-1.0, 1.0]), mask))
        lps.append(torch.tensor(mu + rng.normal(0, 0.6, T), dtype=torch.float32, requires_grad=True))
    loss_fn = make_loss_fn(DPPO_MEAN)
    _, metrics = loss_fn(data, lps)
    inputs, call = loss_fn.evaluate(data, lps)
    terms = call.terms
    assert terms.loss_token_N.shape == (42,) and inputs.lengths_S.tolist() == [30, 12]
    assert loss_fn.metrics(stats(terms)) == metrics == loss_fn.metrics(call.stats)
    assert not terms.prob_diff_N.requires_grad


def test_make_loss_fn_is_a_record_of_its_config():
    fn = make_loss_fn(DPPO_MEAN)
    assert isinstance(fn, losses.PackedLoss) and fn.loss_config is DPPO_MEAN and fn == make_loss_fn(DPPO_MEAN)

"""Per-loss-call records: decisions, counts, histograms, persistence, and the record built from the
loss's own evaluation."""

import math

import numpy as np
import pytest
import tinker
import torch

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.loss import terms as loss_terms
from dppo_harness.loss.losses import LossConfig, make_loss_fn

CFG = LossConfig(loss="dppo_divergence_mask", normalization="token_mean")


def _record(context, data, lps, cfg=CFG):
    """The record of one loss call, as the recorder builds it from the loss's evaluation."""
    recorder = ins.LossCallRecorder(cfg)
    recorder.wrap(make_loss_fn(cfg), **context)(data, lps)
    return recorder.records[0]


def _datum(prompt_len: int, p_cur: list[float], q_samp: list[float], adv: float, seed: int = 0):
    """One datum: `prompt_len` prompt positions (junk logprobs, mask 0) then the response tokens."""
    rng = np.random.default_rng(seed)
    n = prompt_len + len(p_cur)
    target = rng.integers(10, 1000, size=n).tolist()
    sampler = [float(rng.normal())] * prompt_len + [math.log(q) for q in q_samp]
    advs = [0.0] * prompt_len + [adv] * len(p_cur)
    mask = np.array([0.0] * prompt_len + [1.0] * len(p_cur), dtype=np.float32)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([7] + target[:-1]),
        loss_fn_inputs={"target_tokens": target, "logprobs": sampler, "advantages": advs, "mask": mask},
    )
    current = torch.tensor([-3.0] * prompt_len + [math.log(p) for p in p_cur], dtype=torch.float32)
    return datum, current


def _batch():
    # A>0: one far above q (drop), one recovery (far below: keep), one near q.
    d_pos, lp_pos = _datum(3, [0.9, 0.1, 0.5], [0.5, 0.8, 0.5], adv=0.5, seed=1)
    # A<0: one far below q (drop), one recovery (far above: keep).
    d_neg, lp_neg = _datum(2, [0.1, 0.9], [0.6, 0.2], adv=-0.25, seed=2)
    # A==0: far below q changes the recorded mask but is not engagement.
    d_zero, lp_zero = _datum(4, [0.05, 0.5], [0.7, 0.5], adv=0.0, seed=3)
    return [d_pos, d_neg, d_zero], [lp_pos, lp_neg, lp_zero]


def test_record_counts_decisions_by_sign_and_ignores_prompt_and_zero_adv():
    data, lps = _batch()
    rec = _record({"update_index": 1}, data, lps)
    s = rec.stats
    assert s["tokens/loss"] == 7 and s["tokens/nonzero_adv"] == 5
    assert (s["tokens/pos_adv"], s["tokens/neg_adv"], s["tokens/zero_adv"]) == (3, 2, 2)
    assert s["dppo/removed"] == 2
    assert s["dppo/removed_pos_adv"] == 1 and s["dppo/removed_neg_adv"] == 1
    assert s["dppo/mask_zero_adv"] == 1
    assert s["dppo/masked_frac_loss_tokens"] == pytest.approx(2 / 7)
    assert s["dppo/masked_frac_nonzero_adv"] == pytest.approx(2 / 5)
    # Exceedances count every loss token beyond +-delta, whatever its sign: +0.4, +0.7 / -0.7, -0.5, -0.65.
    assert s["dppo/exceed_pos"] == 2 and s["dppo/exceed_neg"] == 3
    assert s["dppo/exceed_pos_on_pos_adv"] == 1 and s["dppo/exceed_neg_on_neg_adv"] == 1
    assert s["drift/max_on_pos_adv"] == pytest.approx(0.4, abs=1e-6)
    assert s["drift/min_on_neg_adv"] == pytest.approx(-0.5, abs=1e-6)
    assert rec.dtype == "float32"
    assert rec.tensors["logprobs_N"].dtype == np.float32
    assert rec.tensors["logprobs_N"].shape == (sum(d.model_input.length for d in data),)


def test_histograms_split_by_sign_and_put_delta_on_the_kept_side():
    edges = loss_terms.magnitude_edges(0.15)
    assert edges == (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
    labels = loss_terms.hist_bin_labels(edges)
    assert len(labels) == 2 * len(edges) - 1
    up, down = loss_terms.delta_bins(0.15)
    assert labels[up] == "(0.15,0.2]" and labels[down] == "[-0.2,-0.15)"
    d = np.array([0.15, 0.1500001, -0.15, -0.1500001, 0.0, 0.35, -1.0])
    idx = loss_terms.hist_bin_index(d, edges)
    assert idx[0] == up - 1 and idx[1] == up  # exactly +delta is kept: below the exceed bins
    assert idx[2] == down + 1 and idx[3] == down
    assert labels[idx[4]] == "[-0.001,0.001]" and labels[idx[5]] == "(0.3,0.5]" and labels[idx[6]] == "[-1,-0.5)"
    data, lps = _batch()
    rec = _record({}, data, lps)
    h = rec.stats["hist"]
    assert sum(h["pos"]) == 3 and sum(h["neg"]) == 2 and sum(h["zero"]) == 2
    exceed = sum(sum(h[s][up:]) + sum(h[s][: down + 1]) for s in loss_terms.HIST_SIGNS)
    assert exceed == rec.stats["dppo/exceed_pos"] + rec.stats["dppo/exceed_neg"]


@pytest.mark.parametrize("delta", [0.2, 0.17, 0.001, 0.9])
def test_any_delta_gets_exact_bins(delta):
    """delta is always an edge: the bins beyond +-delta hold exactly the strict exceedances."""
    edges = loss_terms.magnitude_edges(delta)
    assert delta in edges and list(edges) == sorted(set(edges))
    labels = loss_terms.hist_bin_labels(edges)
    up, down = loss_terms.delta_bins(delta)
    assert labels[up].startswith(f"({delta:g},") and labels[down].endswith(f",-{delta:g})")
    data, lps = _batch()
    cfg = LossConfig(loss="dppo_divergence_mask", normalization="token_mean", dppo_delta=delta)
    rec = _record({}, data, lps, cfg)
    h = rec.stats["hist"]
    assert rec.stats.hist.edges == edges and len(h["pos"]) == len(labels)
    exceed = sum(sum(h[s][up:]) + sum(h[s][: down + 1]) for s in loss_terms.HIST_SIGNS)
    assert exceed == rec.stats["dppo/exceed_pos"] + rec.stats["dppo/exceed_neg"]


def test_recorder_records_exact_inputs_and_leaves_the_loss_unchanged():
    data, lps = _batch()
    loss_fn = make_loss_fn(CFG)
    want_loss, want_metrics = loss_fn(data, [lp.clone().requires_grad_(True) for lp in lps])
    rec = ins.LossCallRecorder(CFG)
    wrapped = rec.wrap(loss_fn, update_index=3, epoch=1)
    inputs = [lp.clone().requires_grad_(True) for lp in lps]
    loss, metrics = wrapped(data, inputs)
    loss.backward()
    assert float(loss.detach()) == float(want_loss.detach()) and metrics == want_metrics
    assert all(t.grad is not None for t in inputs)
    (r,) = rec.records
    assert r.context == {"update_index": 3, "epoch": 1}
    np.testing.assert_array_equal(r.tensors["logprobs_N"], torch.cat(lps).numpy())
    # One evaluation per call: what the loss returned is its statistics, as recorded.
    assert r.loss_metrics == metrics == loss_fn.metrics(r.stats)
    assert r.stats == _record({}, data, lps).stats


def test_recorder_refuses_a_loss_whose_decisions_it_cannot_read():
    with pytest.raises(TypeError, match="packed loss path"):
        ins.LossCallRecorder(CFG).wrap(lambda data, lps: (torch.zeros(()), {}))


def test_npz_roundtrip_is_exact_and_rejects_foreign_files():
    data, lps = _batch()
    recs = [_record({"update_index": i + 1}, data, lps) for i in range(2)]
    blob = ins.records_to_npz(recs)
    assert ins.is_record_file(blob)
    back = ins.records_from_npz(blob)
    assert [b.context for b in back] == [r.context for r in recs]
    for a, b in zip(recs, back):
        assert a.stats == b.stats
        for name in ins.TENSOR_FIELDS:
            np.testing.assert_array_equal(a.tensors[name], b.tensors[name])
            assert a.tensors[name].dtype == b.tensors[name].dtype
        assert b.terms is None and ins.record_terms(a) is a.terms
    import io

    buf = io.BytesIO()
    np.savez_compressed(buf, x=np.zeros(3))
    assert not ins.is_record_file(buf.getvalue())
    with pytest.raises(ValueError, match="not a loss-call record"):
        ins.records_from_npz(buf.getvalue())


def test_sentinel_choice_is_deterministic_and_covers_both_signs():
    adv = [0.5, -0.5, 0.0, 0.5, -0.5, 0.0, 0.1, -0.1, 0.2, 0.0]
    a = ins.choose_sentinel_sequences(adv, n_per_sign=2)
    b = ins.choose_sentinel_sequences(list(adv), n_per_sign=2)
    assert a == b and len(a.sequence_indices) == 6
    signs = {np.sign(adv[i]) for i in a.sequence_indices}
    assert signs == {1.0, -1.0, 0.0}
    s = ins.sentinel_summary(
        np.log(np.array([0.5, 0.6, 0.2])),
        np.log(np.array([0.5, 0.5, 0.5])),
        np.log(np.array([0.5, 0.5, 0.3])),
        np.array([1.0, 1.0, 1.0]),
        np.array([1.0, 1.0, -1.0]),
    )
    assert s["p_minus_q"]["abs_max"] == pytest.approx(0.3)
    assert s["p_minus_p_init"]["abs_max"] == pytest.approx(0.1)
    assert s["by_advantage_sign"]["neg"]["mean_p_minus_p_init"] == pytest.approx(-0.1)

"""Truncation at max_tokens, answers found and mean response length: for rollout batches (every
step's row, the gate and the diagnostic read `RolloutBatch.summary`) and for each scored model
(`metrics.arms[model]`)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from tinker.types import SampledSequence, SampleResponse

from dppo_harness import constants
from dppo_harness.data import gsm8k
from dppo_harness.data.tokenizer import make_renderer
from dppo_harness.evaluation import answer_yield
from dppo_harness.evaluation import greedy as evaluation
from dppo_harness.rollout import rollouts


def answered(response):
    """tinker 0.25's `SamplingClient.sample` returns a plain `concurrent.futures.Future`: one already answered."""
    fut = concurrent.futures.Future()
    fut.set_result(response)
    return fut


@pytest.fixture(scope="module")
def bundle():
    return make_renderer()


def test_response_yield_counts_and_refusals():
    y = answer_yield.response_yield(
        ["stop", "length", "length", "stop"], [True, False, True, False], [10, 64, 64, 2], max_tokens=64
    )
    assert (y.n, y.truncated, y.no_answer, y.response_tokens) == (4, 2, 2, 140)
    assert (y.truncated_frac, y.no_answer_frac, y.mean_response_tokens) == (0.5, 0.5, 35.0)
    d = y.as_dict()
    assert d["max_tokens"] == 64 and "stop_reason == 'length'" in d["definitions"]["truncated"]
    both = answer_yield.pooled([y, answer_yield.response_yield(["stop"] * 4, [True] * 4, [5] * 4, max_tokens=64)])
    assert (both.n, both.truncated, both.no_answer, both.max_tokens) == (8, 2, 2, 64)
    with pytest.raises(ValueError, match="undefined"):
        answer_yield.response_yield([], [], [])


def test_grading_says_whether_an_answer_was_found(bundle):
    item = gsm8k.load_split("test").items[0]

    def grade(text, stop=True):
        toks = bundle.tokenizer.encode(text, add_special_tokens=False) + ([constants.STOP_TOKEN_ID] if stop else [])
        return gsm8k.grade_response(item, bundle.renderer, toks)

    assert grade(f"so \\boxed{{{item.reference}}}").answer_found is True
    assert grade("I ran out of room before the answer", stop=False).answer_found is False
    # Cut off at max_tokens after its boxed answer: an answer is found, the format reward is not given.
    cut = grade(f"\\boxed{{{item.reference}}} and then more", stop=False)
    assert cut.answer_found is True and cut.format_ok is False


def _batch(bundle, texts_and_reasons):
    item = gsm8k.load_split("train").items[0]
    responses, graded, reasons = [], [], []
    for text, reason in texts_and_reasons:
        toks = bundle.tokenizer.encode(text, add_special_tokens=False) + (
            [constants.STOP_TOKEN_ID] if reason == "stop" else []
        )
        responses.append(tuple(toks))
        graded.append(gsm8k.grade_response(item, bundle.renderer, toks))
        reasons.append(reason)
    group = rollouts.SampledGroup(
        0,
        item,
        (1, 2, 3),
        tuple(responses),
        tuple((0.0,) * len(r) for r in responses),
        tuple(reasons),
        tuple(graded),
    )
    cfg = rollouts.RolloutConfig(groups_per_batch=1, group_size=len(responses), temperature=1.0, max_tokens=16)
    return rollouts.RolloutBatch(
        (group,), cfg, "tinker://m/sampler_weights/s0", "m", (constants.STOP_TOKEN_ID,), 0.1, 0.0
    )


def test_rollout_batch_summary_reports_truncation_answers_and_length(bundle):
    batch = _batch(
        bundle,
        [
            ("\\boxed{3}", "stop"),
            ("thinking thinking thinking", "length"),
            ("\\boxed{4} but", "length"),
            ("no answer", "stop"),
        ],
    )
    s = batch.summary()
    assert s["frac_truncated"] == 0.5 and s["frac_no_answer"] == 0.5
    lengths = [len(r) for r in batch.groups[0].responses]
    assert s["mean_response_tokens"] == pytest.approx(sum(lengths) / 4)
    assert batch.response_yield().max_tokens == 16


class _Sampler:
    def __init__(self, bundle, outputs):
        self.bundle, self.outputs, self.k = bundle, outputs, 0

    def sample(self, prompt, num_samples, params):
        text, reason = self.outputs[self.k % len(self.outputs)]
        self.k += 1
        toks = self.bundle.tokenizer.encode(text, add_special_tokens=False) + (
            [constants.STOP_TOKEN_ID] if reason == "stop" else []
        )
        seq = SampledSequence(
            stop_reason=reason,
            tokens_np=np.asarray(toks, np.int32),
            logprobs_np=np.zeros(len(toks), np.float32),
        )

        return answered(SampleResponse(sequences=[seq]))


def test_each_scored_model_reports_accuracy_n_invalid_and_truncation(bundle):
    test = gsm8k.load_split("test")
    items, dev = evaluation.select_items(test, 4, reason="unit test subset")
    ev = evaluation.freeze_evaluator(items, bundle, max_tokens=64, deviation=dev)
    ref = items[0].reference
    res = evaluation.evaluate(
        _Sampler(
            bundle,
            [
                (f"\\boxed{{{ref}}}", "stop"),
                ("still thinking", "length"),
                ("no box", "stop"),
                ("\\boxed{1} cut", "length"),
            ],
        ),
        ev,
        arm="base",
        seed=0,
        checkpoint="base:m",
    )
    m = res.arm_metrics(64)
    assert m["accuracy"] == 0.25 and m["eval_n"] == 4.0 and m["eval_invalid_outputs"] == 2.0
    assert m["eval_truncated_frac"] == 0.5 and m["eval_no_answer_frac"] == 0.5
    assert all(isinstance(v, float) for v in m.values())

"""Frozen evaluator identity, greedy request shape, rows (invalid outputs kept), output objects."""

import concurrent.futures
import hashlib
import json
import shutil

import numpy as np
import pytest
from tinker.types import SampledSequence, SampleResponse

from dppo_harness import constants
from dppo_harness.data import gsm8k
from dppo_harness.data.tokenizer import make_renderer
from dppo_harness.evaluation import greedy as evaluation


def answered(response):
    """tinker 0.25's `SamplingClient.sample` returns a plain `concurrent.futures.Future`: one already answered."""
    fut = concurrent.futures.Future()
    fut.set_result(response)
    return fut


@pytest.fixture(scope="module")
def bundle():
    return make_renderer()


@pytest.fixture(scope="module")
def test_split():
    return gsm8k.load_split("test")


@pytest.fixture(scope="module")
def evaluator(bundle, test_split):
    items, dev = evaluation.select_items(test_split, 4, reason="unit test subset")
    return evaluation.freeze_evaluator(items, bundle, max_tokens=64, deviation=dev)


def test_evaluator_id_is_the_briefs_hash_and_stable(bundle, test_split, evaluator):
    prov = evaluator.provenance
    assert set(prov) == {"code_sha256", "prompt_template", "decoding", "parser", "items"}
    by_hand = hashlib.sha256(
        json.dumps(prov, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    ).hexdigest()
    assert evaluator.evaluator_id == by_hand
    again = evaluation.freeze_evaluator(evaluator.items, bundle, max_tokens=64, deviation=evaluator.deviation)
    assert again.evaluator_id == evaluator.evaluator_id
    assert prov["items"]["ids"] == ["gsm8k-test-0000", "gsm8k-test-0001", "gsm8k-test-0002", "gsm8k-test-0003"]
    assert prov["decoding"]["temperature"] == 0.0 and prov["decoding"]["stop"] == [constants.STOP_TOKEN_ID]
    assert "{question} Write your answer in \\boxed{} format." in prov["prompt_template"]
    # any item or decoding change is a different evaluator
    dev = evaluator.deviation
    assert (
        evaluation.freeze_evaluator(evaluator.items[:3], bundle, max_tokens=64, deviation=dev).evaluator_id
        != evaluator.evaluator_id
    )
    assert (
        evaluation.freeze_evaluator(evaluator.items, bundle, max_tokens=512, deviation=dev).evaluator_id
        != evaluator.evaluator_id
    )
    assert set(evaluator.code_manifest["versions"]) >= {"tinker", "tinker-cookbook", "tml-renderers", "sympy"}


def test_code_change_after_freezing_is_refused(monkeypatch, tmp_path, bundle, evaluator):
    files = evaluation.code_files("gsm8k")
    copies = {}
    for name, path in files.items():
        copies[name] = tmp_path / name.replace("/", "__")
        shutil.copy(path, copies[name])
    monkeypatch.setattr(evaluation, "code_files", lambda _dataset: copies)
    frozen = evaluation.freeze_evaluator(evaluator.items, bundle, max_tokens=64, deviation=evaluator.deviation)
    frozen.check_unchanged()
    grader = copies["tinker_cookbook/recipes/math_rl/math_grading.py"]
    grader.write_text(grader.read_text() + "\n# edited\n")
    with pytest.raises(evaluation.EvaluatorChangedError, match="code_sha256"):
        frozen.check_unchanged()
    with pytest.raises(evaluation.EvaluatorChangedError):
        evaluation.evaluate(object(), frozen, arm="a", seed=0, checkpoint="c")  # refused before sampling


def test_item_selection_default_and_recorded_deviation(bundle, test_split):
    items, dev = evaluation.select_items(test_split)
    assert len(items) == 1319 and dev is None
    full = evaluation.freeze_evaluator(items, bundle)
    assert full.deviation is None and len(full.provenance["items"]["ids"]) == 1319
    with pytest.raises(ValueError, match="deviation"):
        evaluation.freeze_evaluator(items[:10], bundle)
    with pytest.raises(ValueError, match="test split"):
        evaluation.freeze_evaluator(gsm8k.load_split("train").items[:2], bundle, deviation={"reason": "x"})
    with pytest.raises(ValueError, match="reason"):
        evaluation.select_items(test_split, 10)
    items, dev = evaluation.select_items(test_split, 10, reason="time budget")
    assert len(items) == 10 and dev["field"] == "evaluator" and dev["reason"] == "time budget"
    assert "1319" in dev["original"] and "gsm8k-test-0009" in dev["effective"]


class GreedyScript:
    """Replies per prompt: a correct boxed answer, a wrong one, no box at all, and an empty output."""

    def __init__(self, bundle, references):
        self.bundle, self.refs, self.params, self.n = bundle, references, [], 0

    def sample(self, prompt, num_samples, sampling_params):
        k = self.n
        self.n += 1
        self.params.append((num_samples, sampling_params))
        text = [f"so \\boxed{{{self.refs[k % len(self.refs)]}}}", "\\boxed{-1}", "I do not know", ""][k % 4]
        toks = self.bundle.tokenizer.encode(text, add_special_tokens=False) + [constants.STOP_TOKEN_ID]
        seq = SampledSequence(
            stop_reason="stop",
            tokens_np=np.asarray(toks, np.int32),
            logprobs_np=np.zeros(len(toks), np.float32),
        )

        return answered(SampleResponse(sequences=[seq]))


def test_evaluate_rows_keep_invalid_outputs(bundle, evaluator):
    sampler = GreedyScript(bundle, [it.reference for it in evaluator.items])
    res = evaluation.evaluate(
        sampler, evaluator, arm="grpo_seed0", seed=0, checkpoint="tinker://m/sampler_weights/final", max_in_flight=2
    )
    assert all(
        n == 1 and p.temperature == 0.0 and p.max_tokens == 64 and list(p.stop) == [constants.STOP_TOKEN_ID]
        for n, p in sampler.params
    )
    assert [r["value"] for r in res.rows] == [1, 0, 0, 0]
    assert [r["prediction"] for r in res.rows] == [evaluator.items[0].reference, "-1", None, None]
    assert res.accuracy == 0.25
    for row, item in zip(res.rows, evaluator.items):
        assert row["item_id"] == item.item_id and row["reference"] == item.reference
        assert row["evaluator_id"] == evaluator.evaluator_id and row["checkpoint"].endswith("final")
    lines = res.predictions_jsonl().decode().splitlines()
    assert len(lines) == 4 and {
        "item_id",
        "arm",
        "seed",
        "checkpoint",
        "prediction",
        "reference",
        "value",
        "evaluator_id",
    } <= set(json.loads(lines[2]))
    obs = evaluation.observations_jsonl([res])
    first = json.loads(obs.decode().splitlines()[0])
    assert first == {
        "item_id": "gsm8k-test-0000",
        "arm": "grpo_seed0",
        "seed": 0,
        "metric": "accuracy",
        "value": 1,
        "evaluator_id": evaluator.evaluator_id,
    }
    obj = evaluation.evaluation_object(
        evaluator,
        [res.score("predictions-grpo.jsonl")],
        [{"metric": "accuracy", "arms": ["grpo_seed0", "dppo_seed0"]}],
    )
    assert obj["version"] == 1 and obj["evaluators"][evaluator.evaluator_id]["items"]["ids"][0] == "gsm8k-test-0000"
    assert obj["scores"][0] == {
        "arm": "grpo_seed0",
        "metric": "accuracy",
        "value": 0.25,
        "evaluator_id": evaluator.evaluator_id,
        "seed": 0,
        "predictions_ref": "predictions-grpo.jsonl",
    }


def test_a_scored_models_evaluation_says_how_far_it_is_at_least_every_interval(bundle, evaluator):
    """Each answer takes 8 s of a fake clock: a line at the first answer, then whenever 15 s passed
    since the last one, and at the last answer, each naming how many items are answered."""
    from dppo_harness.evidence.progress import Ticker

    now = {"t": 0.0}

    class Slow(GreedyScript):
        def sample(self, prompt, num_samples, sampling_params):
            fut = super().sample(prompt, num_samples, sampling_params)

            class F(concurrent.futures.Future):
                def result(self_inner, timeout=None):
                    now["t"] += 8.0
                    return super().result(timeout)

            slow = F()
            slow.set_result(fut.result())
            return slow

    lines, at = [], []
    say = lambda m: (lines.append(m), at.append(now["t"]))  # noqa: E731
    sampler = Slow(bundle, [it.reference for it in evaluator.items])
    ticker = Ticker(say, "[comparison] evaluating dppo_seed0", total=4, every_s=15.0, clock=lambda: now["t"])
    evaluation.evaluate(
        sampler,
        evaluator,
        arm="dppo_seed0",
        seed=0,
        checkpoint="tinker://m/final",
        max_in_flight=2,
        on_item=lambda k: ticker.tick(k, "items answered"),
    )
    assert lines[0].startswith("[comparison] evaluating dppo_seed0: 1/4 (25%), items answered")
    assert lines[1].startswith("[comparison] evaluating dppo_seed0: 3/4 (75%), items answered (24s)")
    assert lines[-1].startswith("[comparison] evaluating dppo_seed0: 4/4 (100%), items answered (32s)")
    assert at == [8.0, 24.0, 32.0], lines


def test_predictions_file_keeps_every_row_key():
    row = {
        "item_id": "gsm8k-test-0000",
        "arm": "grpo_seed0",
        "seed": 0,
        "checkpoint": "tinker://x",
        "metric": "accuracy",
        "prediction": None,
        "response": "no answer",
        "reference": "18",
        "value": 0,
        "format_ok": False,
        "stop_reason": "length",
        "n_tokens": 512,
        "evaluator_id": "e" * 64,
    }
    out = evaluation.EvalResult("grpo_seed0", 0, "tinker://x", "e" * 64, (row,)).predictions_jsonl()
    assert [json.loads(line) for line in out.decode().splitlines()] == [row]

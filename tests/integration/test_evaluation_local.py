"""A small greedy evaluation on the embedded server: frozen evaluator, rows, determinism, decision."""

import json

import pytest
import tinker
from sdk_session import end_session

from dppo_harness import constants
from dppo_harness.data import gsm8k
from dppo_harness.data.tokenizer import make_renderer
from dppo_harness.evaluation import greedy as evaluation
from dppo_harness.evaluation import stats

MODEL = "tiny-qwen3-random"  # conftest.shared_random_server
N_ITEMS = 12


@pytest.fixture(scope="module")
def bundle():
    return make_renderer()


def test_small_greedy_evaluation(tmp_path, bundle, shared_random_server):
    items, deviation = evaluation.select_items(
        gsm8k.load_split("test"), N_ITEMS, reason="integration test: small subset"
    )
    assert deviation is not None and deviation["field"] == "evaluator"
    evaluator = evaluation.freeze_evaluator(items, bundle, max_tokens=24, deviation=deviation)
    srv = shared_random_server  # the MODEL preset
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=constants.LOCAL_API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=8, seed=0)
        path = tc.save_weights_for_sampler("final").result().path
        sampler = sc.create_sampling_client(model_path=path)
        a = evaluation.evaluate(sampler, evaluator, arm="grpo_seed0", seed=0, checkpoint=path, max_in_flight=8)
        b = evaluation.evaluate(sampler, evaluator, arm="dppo_seed0", seed=0, checkpoint=path)
        # temperature 1 without a seed differs from run to run; greedy must not
        hot = [
            tuple(
                sampler.sample(
                    gsm8k.build_prompt(it, bundle.renderer)[0],
                    1,
                    tinker.SamplingParams(max_tokens=24, temperature=1.0, stop=[constants.STOP_TOKEN_ID]),
                )
                .result()
                .sequences[0]
                .tokens
            )
            for it in items[:4]
            for _ in range(2)
        ]
    finally:
        end_session(sc)  # no SDK heartbeat outlives the shared server
    assert len(a.rows) == N_ITEMS and [r["item_id"] for r in a.rows] == [it.item_id for it in items]
    assert all(r["value"] in (0, 1) and r["evaluator_id"] == evaluator.evaluator_id for r in a.rows)
    assert all(r["checkpoint"] == path and r["n_tokens"] <= 24 for r in a.rows)
    # a random model answers nothing: every invalid output is still a row with value 0
    assert a.accuracy == sum(r["value"] for r in a.rows) / N_ITEMS
    assert [r["response"] for r in a.rows] == [r["response"] for r in b.rows]  # greedy is deterministic
    assert any(hot[2 * i] != hot[2 * i + 1] for i in range(4))
    obs = evaluation.observations_jsonl([a, b])
    path_obs = tmp_path / "scored-observations.jsonl"
    path_obs.write_bytes(obs)
    decision = stats.paired_hoeffding_from_rows(stats.read_observations(path_obs), "dppo_seed0", "grpo_seed0")
    assert decision["n"] == N_ITEMS and decision["mean_difference"] == 0.0 and decision["verdict"] == "inconclusive"
    assert decision["evaluator_id"] == evaluator.evaluator_id
    obj = evaluation.evaluation_object(
        evaluator, [a.score("predictions-grpo.jsonl"), b.score("predictions-dppo.jsonl")]
    )
    json.dumps(obj, allow_nan=False)
    assert list(obj["evaluators"]) == [evaluator.evaluator_id]

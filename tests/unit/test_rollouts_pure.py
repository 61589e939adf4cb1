"""Rollouts without a server: concurrency of submission, params, advantages, datum layout."""

import concurrent.futures

import numpy as np
import pytest
from tinker.types import SampledSequence, SampleResponse
from tinker_cookbook.rl import data_processing

from dppo_harness import constants
from dppo_harness.data import gsm8k
from dppo_harness.data.tokenizer import make_renderer
from dppo_harness.rollout import rollouts


@pytest.fixture(scope="module")
def renderer():
    return make_renderer().renderer


class _Future(concurrent.futures.Future):
    """What tinker 0.25's `SamplingClient.sample` returns (a plain concurrent Future), already
    answered, recording when the harness waits on it."""

    def __init__(self, log, key, response):
        super().__init__()
        self.log, self.key = log, key
        self.set_result(response)

    def result(self, timeout=None):
        self.log.append(("result", self.key))
        return super().result(timeout)


class ScriptedSampler:
    """Answers each request with scripted responses: even samples answer the reference (boxed,
    with the stop token), odd ones answer 0. Records the order of submits and waits."""

    def __init__(self, renderer, references, *, drop_logprobs=False, short=False):
        self.renderer, self.references = renderer, references
        self.log, self.requests = [], []
        self.drop_logprobs, self.short = drop_logprobs, short

    def get_base_model(self):
        return constants.BASE_MODEL

    def sample(self, prompt, num_samples, sampling_params):
        key = len(self.requests)
        self.requests.append((prompt, num_samples, sampling_params))
        self.log.append(("submit", key))
        ref = self.references[key]
        seqs = []
        for s in range(num_samples - (1 if self.short else 0)):
            text = f"Work {s}. \\boxed{{{ref if s % 2 == 0 else 0}}}"
            toks = self.renderer.tokenizer.encode(text, add_special_tokens=False) + [constants.STOP_TOKEN_ID]
            lps = -0.01 * (np.arange(len(toks), dtype=np.float32) + 1 + s)
            seqs.append(
                SampledSequence(
                    stop_reason="stop",
                    tokens_np=np.asarray(toks, dtype=np.int32),
                    logprobs_np=None if self.drop_logprobs else lps.astype(np.float32),
                )
            )
        return _Future(self.log, key, SampleResponse(sequences=seqs))


CFG = rollouts.RolloutConfig(groups_per_batch=4, group_size=4, temperature=1.0, max_tokens=64, seed=100)


@pytest.fixture(scope="module")
def items():
    return gsm8k.load_split("train", 0).batch(0, 4)


@pytest.fixture(scope="module")
def batch(renderer, items):
    sampler = ScriptedSampler(renderer, [it.reference for it in items])
    b = rollouts.sample_batch(sampler, items, renderer, CFG, sampler_checkpoint="tinker://m/sampler_weights/s0")
    return sampler, b


def test_all_requests_submitted_before_any_wait(batch):
    sampler, _ = batch
    kinds = [k for k, _ in sampler.log]
    assert kinds == ["submit"] * 4 + ["result"] * 4
    _, b = batch
    assert len(b.request_seconds) == 4 and b.summary()["request_seconds_max"] <= b.sampling_seconds


def test_sampling_params_follow_config(batch):
    sampler, b = batch
    for g, (prompt, n, params) in enumerate(sampler.requests):
        assert n == CFG.group_size and params.temperature == 1.0 and params.max_tokens == 64
        assert list(params.stop) == [constants.STOP_TOKEN_ID] and params.seed == 100 + g
        assert prompt.to_ints() == list(b.groups[g].prompt_tokens)
    assert b.sampler_checkpoint == "tinker://m/sampler_weights/s0" and b.base_model == constants.BASE_MODEL


def test_rewards_and_group_centred_advantages(batch):
    _, b = batch
    for grp in b.groups:
        assert grp.rewards_G == [1.0, 0.0, 1.0, 0.0]
    adv = data_processing.compute_advantages(rollouts.to_trajectory_groups(b))
    # mean 0.5, no std division: +-0.5 (a std-normalised GRPO would give +-1)
    for a in adv:
        np.testing.assert_allclose(a, [0.5, -0.5, 0.5, -0.5])
    s = b.summary()
    assert s["nonconstant_reward_groups"] == 4 and s["frac_correct"] == 0.5 and s["n_sequences"] == 16


def test_datum_layout_matches_architecture(batch):
    _, b = batch
    datums, meta = rollouts.batch_to_datums(b)
    assert len(datums) == 16 and meta[5] == {"group_idx": 1, "traj_idx": 1}
    grp, s = b.groups[1], 1
    d = datums[5]
    prompt, resp, lps = list(grp.prompt_tokens), list(grp.responses[s]), list(grp.logprobs[s])
    tokens = prompt + resp
    T = len(tokens) - 1
    assert d.model_input.to_ints() == tokens[:-1]
    li = {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}
    np.testing.assert_array_equal(li["target_tokens"], tokens[1:])
    P = len(prompt)
    expect_lp = np.array([0.0] * (P - 1) + lps, dtype=np.float32)
    expect_mask = np.array([0.0] * (P - 1) + [1.0] * len(resp), dtype=np.float32)
    expect_adv = np.array([0.0] * (P - 1) + [-0.5] * len(resp), dtype=np.float32)
    for key, expect in (("logprobs", expect_lp), ("mask", expect_mask), ("advantages", expect_adv)):
        assert li[key].shape == (T,) and li[key].dtype == np.float32
        np.testing.assert_array_equal(li[key], expect)


def test_bad_sampler_output_is_refused(renderer, items):
    refs = [it.reference for it in items]
    with pytest.raises(rollouts.RolloutError, match="logprobs"):
        rollouts.sample_batch(
            ScriptedSampler(renderer, refs, drop_logprobs=True), items, renderer, CFG, sampler_checkpoint="x"
        )
    with pytest.raises(rollouts.RolloutError, match="sequences, expected 4"):
        rollouts.sample_batch(ScriptedSampler(renderer, refs, short=True), items, renderer, CFG, sampler_checkpoint="x")
    with pytest.raises(ValueError, match="sampler_checkpoint"):
        rollouts.sample_batch(ScriptedSampler(renderer, refs), items, renderer, CFG, sampler_checkpoint="")
    with pytest.raises(ValueError, match="groups_per_batch"):
        rollouts.sample_batch(ScriptedSampler(renderer, refs), items[:3], renderer, CFG, sampler_checkpoint="x")
    with pytest.raises(ValueError, match="temperature"):
        rollouts.RolloutConfig(groups_per_batch=1, group_size=1, temperature=0.0, max_tokens=1)

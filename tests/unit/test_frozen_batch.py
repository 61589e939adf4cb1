"""FrozenBatch: cookbook datums round trip, hashes, tamper detection, complete-group minibatches."""

import json

import numpy as np
import pytest

from dppo_harness.data.gsm8k import Graded, Gsm8kItem
from dppo_harness.rollout import rollouts
from dppo_harness.rollout.frozen_batch import FIELDS, FrozenBatch, FrozenBatchError, split_complete_groups


def make_rollout_batch(n_groups=32, group_size=8, seed=0):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        item = Gsm8kItem(f"gsm8k-train-{g:04d}", "train", g, f"q{g}", "s #### 1", "1")
        P = int(rng.integers(5, 20))
        prompt = tuple(int(t) for t in rng.integers(0, 1000, P))
        responses, lps, graded = [], [], []
        for _ in range(group_size):
            R = int(rng.integers(1, 12))
            responses.append(tuple(int(t) for t in rng.integers(0, 1000, R)))
            lps.append(tuple(float(x) for x in np.log(rng.uniform(0.05, 1.0, R)).astype(np.float32)))
            r = float(rng.choice([1.0, 0.9, 0.0, -0.1]))
            graded.append(Graded(r, r in (1.0, 0.0), r > 0.5, "", r > 0.5))
        groups.append(
            rollouts.SampledGroup(g, item, prompt, tuple(responses), tuple(lps), ("stop",) * group_size, tuple(graded))
        )
    cfg = rollouts.RolloutConfig(groups_per_batch=n_groups, group_size=group_size, temperature=1.0, max_tokens=16)
    return rollouts.RolloutBatch(
        tuple(groups), cfg, "tinker://m/sampler_weights/s0", "Qwen/Qwen3.5-2B", (248046,), 0.1, 0.0
    )


@pytest.fixture(scope="module")
def rb():
    return make_rollout_batch()


@pytest.fixture()
def fb(rb):
    return rollouts.freeze(rb, sampler_version="step-0")


def _datum_arrays(d):
    return d.model_input.to_ints(), {k: (v.to_numpy(), v.dtype) for k, v in d.loss_fn_inputs.items()}


def test_to_datums_reproduces_cookbook_datums(rb, fb):
    cookbook, _ = rollouts.batch_to_datums(rb)
    ours = fb.to_datums()
    assert len(ours) == len(cookbook) == 256
    for a, b in zip(ours, cookbook):
        ia, la = _datum_arrays(a)
        ib, lb = _datum_arrays(b)
        assert ia == ib and set(la) == set(lb) == {"target_tokens", "logprobs", "advantages", "mask"}
        for k in la:
            assert la[k][1] == lb[k][1], k  # same TensorData dtype
            np.testing.assert_array_equal(la[k][0], lb[k][0])
    assert [d.model_input.to_ints() for d in fb.to_datums([3, 7])] == [
        cookbook[3].model_input.to_ints(),
        cookbook[7].model_input.to_ints(),
    ]


def test_records_metadata_and_fields(rb, fb):
    m = fb.metadata
    assert m["sampler_checkpoint"] == "tinker://m/sampler_weights/s0" and m["sampler_version"] == "step-0"
    assert m["dtype"] == "float32" and m["created_at"] and m["rollout_config"]["group_size"] == 8
    assert list(fb.field("item_ids_S")[:9]) == ["gsm8k-train-0000"] * 8 + ["gsm8k-train-0001"]
    assert fb.field("rewards_S")[10] == rb.groups[1].graded[2].reward
    assert list(fb.field("prompt_lengths_S")[:8]) == [len(rb.groups[0].prompt_tokens)] * 8
    assert fb.assert_intact() == fb.sha256 and set(json.loads(fb.to_bytes()[1])["fields"]) == set(FIELDS)


def test_one_float_bit_is_detected(fb):
    arr = fb.field("sampler_logprobs_N")
    with pytest.raises(ValueError):  # read-only
        arr[0] = 0.0
    with pytest.raises(AttributeError):
        fb._arrays = {}
    arr.setflags(write=True)  # a determined caller can still unlock the buffer ...
    bits = arr.view(np.uint32)
    pos = int(np.flatnonzero(fb.field("loss_mask_N"))[0])
    bits[pos] ^= 1  # flip the lowest mantissa bit of one sampler logprob
    with pytest.raises(FrozenBatchError, match="sampler_logprobs_N"):
        fb.assert_intact()
    with pytest.raises(FrozenBatchError):
        fb.to_datums([0])
    bits[pos] ^= 1
    with pytest.raises(FrozenBatchError, match="writable"):  # ... which is itself reported
        fb.assert_intact()
    arr.setflags(write=False)
    fb.assert_intact()


@pytest.mark.parametrize("field", ["advantages_N", "loss_mask_N", "tokens_K", "group_ids_S"])
def test_any_field_change_is_detected(fb, field):
    arr = fb.field(field)
    arr.setflags(write=True)
    arr.view(np.uint8)[0] ^= 1
    with pytest.raises(FrozenBatchError, match=field):
        fb.assert_intact()


def test_save_load_round_trip_and_corruption(tmp_path, fb):
    p_npz, p_man = tmp_path / "fb.npz", tmp_path / "fb.manifest.json"
    for path, data in zip((p_npz, p_man), fb.to_bytes()):
        path.write_bytes(data)
    loaded = FrozenBatch.from_bytes(p_npz.read_bytes(), p_man.read_bytes())
    assert loaded.sha256 == fb.sha256 and loaded.metadata == fb.metadata
    manifest = json.loads(p_man.read_text())
    assert manifest["sha256"] == fb.sha256 and manifest["n_groups"] == 32 and "npz_sha256" in manifest
    # manifest whose field hash disagrees with the arrays
    manifest["fields"]["rewards_S"]["sha256"] = "0" * 64
    del manifest["npz_sha256"]
    with pytest.raises(FrozenBatchError, match="rewards_S"):
        FrozenBatch.from_bytes(p_npz.read_bytes(), json.dumps(manifest).encode())
    # npz bytes that differ from the recorded npz hash
    npz = bytearray(p_npz.read_bytes())
    npz[-30] ^= 0xFF
    with pytest.raises(FrozenBatchError, match="npz_sha256"):
        FrozenBatch.from_bytes(bytes(npz), p_man.read_bytes())
    # metadata edited in the manifest changes the overall hash
    m2 = json.loads(p_man.read_text())
    m2["metadata"]["sampler_checkpoint"] = "tinker://other"
    with pytest.raises(FrozenBatchError, match="metadata"):
        FrozenBatch.from_bytes(p_npz.read_bytes(), json.dumps(m2).encode())


def test_minibatches_hold_complete_groups(fb):
    mask, lengths = fb.field("loss_mask_N"), fb.field("lengths_S")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for n, per in ((8, 4), (2, 16)):
        mbs = fb.split_minibatches(n)
        assert [mb.group_ids for mb in mbs] == [tuple(range(k * per, (k + 1) * per)) for k in range(n)]
        seen = []
        for mb in mbs:
            gids = {int(fb.field("group_ids_S")[s]) for s in mb.sequence_indices}
            assert gids == set(mb.group_ids) and len(mb.sequence_indices) == per * 8
            assert mb.loss_tokens == int(sum(mask[offsets[s] : offsets[s + 1]].sum() for s in mb.sequence_indices))
            assert mb.record()["n_sequences"] == per * 8
            seen += mb.sequence_indices
        assert sorted(seen) == list(range(256))
        assert sum(mb.loss_tokens for mb in mbs) == int(mask.sum())
    for bad in (0, 3, 5, 64):
        with pytest.raises(FrozenBatchError, match="complete groups"):
            fb.split_minibatches(bad)


def test_the_split_rule_keeps_groups_whole_and_refuses_uneven_splits():
    """The one rule every trainer splits a batch with (the arm-step and frozen batches alike)."""
    assert split_complete_groups([0, 0, 1, 1, 2, 2, 3, 3], 2) == [([0, 1], [0, 1, 2, 3]), ([2, 3], [4, 5, 6, 7])]
    assert split_complete_groups([5, 5, 2, 2], 1) == [([5, 2], [0, 1, 2, 3])]  # groups in first-appearance order
    for groups, n in (([0, 1, 2], 2), ([0, 1], 0), ([], 1)):
        with pytest.raises(ValueError, match="minibatches of complete groups"):
            split_complete_groups(groups, n)


def test_invalid_construction_is_refused(rb):
    datums, _ = rollouts.batch_to_datums(rb)
    kw = dict(rewards_S=[0.0], group_ids_S=[0], item_ids_S=["a"])
    with pytest.raises(FrozenBatchError, match="sampler_checkpoint"):
        FrozenBatch.from_datums(datums[:1], sampler_checkpoint="", **kw)
    with pytest.raises(FrozenBatchError, match="one entry per sequence"):
        FrozenBatch.from_datums(datums[:2], sampler_checkpoint="x", **kw)
    with pytest.raises(FrozenBatchError, match="non-finite"):
        FrozenBatch.from_datums(
            datums[:1], sampler_checkpoint="x", rewards_S=[float("nan")], group_ids_S=[0], item_ids_S=["a"]
        )

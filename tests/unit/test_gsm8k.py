"""GSM8K data: pinned hashes, cookbook order, stable ids, reward."""

import hashlib
import shutil
from typing import Any, cast

import datasets
import pytest
from tinker_cookbook.recipes.math_rl import math_env

from dppo_harness.data import gsm8k, sha256sums
from dppo_harness.data.tokenizer import make_renderer, stop_list


@pytest.fixture(scope="module")
def renderer():
    return make_renderer().renderer


def test_vendored_files_match_pinned_hashes():
    sums = sha256sums.read_sha256sums(gsm8k.DATA_DIR / "SHA256SUMS")
    assert set(sums) == {"train.jsonl", "test.jsonl"}
    for split in ("train", "test"):
        data = (gsm8k.DATA_DIR / f"{split}.jsonl").read_bytes()
        assert hashlib.sha256(data).hexdigest() == sums[f"{split}.jsonl"]
        rows, prov = gsm8k.load_rows(split)
        assert prov["verified"] and prov["source"] == "vendored" and prov["sha256"] == sums[f"{split}.jsonl"]
        assert len(rows) == gsm8k.EXPECTED_ROWS[split]


def test_corrupted_copy_is_refused(tmp_path):
    for name in ("train.jsonl", "test.jsonl", "SHA256SUMS"):
        shutil.copy(gsm8k.DATA_DIR / name, tmp_path / name)
    gsm8k.load_rows("test", data_dir=tmp_path)  # intact copy loads
    data = bytearray((tmp_path / "test.jsonl").read_bytes())
    pos = data.index(b"16 eggs")
    data[pos] = ord("7")  # one character: 16 eggs -> 76 eggs
    (tmp_path / "test.jsonl").write_bytes(bytes(data))
    with pytest.raises(gsm8k.DataIntegrityError, match="does not match pinned"):
        gsm8k.load_split("test", data_dir=tmp_path)
    (tmp_path / "SHA256SUMS").write_text((tmp_path / "SHA256SUMS").read_text().replace("test.jsonl", "other.jsonl"))
    with pytest.raises(gsm8k.DataIntegrityError, match="no entry for test.jsonl"):
        gsm8k.load_rows("test", data_dir=tmp_path)
    (tmp_path / "SHA256SUMS").unlink()
    with pytest.raises(gsm8k.DataIntegrityError, match="missing"):
        gsm8k.load_rows("train", data_dir=tmp_path)


def _upstream_rows(split):
    rows, _ = gsm8k.load_rows(split)
    return [{"question": r["question"], "answer": r["answer"]} for r in rows]


@pytest.mark.parametrize("split,seed", [("train", 0), ("train", 7), ("test", 0)])
def test_order_matches_cookbook_gsm8k_dataset(monkeypatch, split, seed):
    """Run the cookbook's own Gsm8kDataset (its load + shuffle + get_batch) on the vendored rows."""
    rows = _upstream_rows(split)
    monkeypatch.setattr(math_env, "load_dataset", lambda path, name, split: datasets.Dataset.from_list(rows))
    ds = math_env.Gsm8kDataset(batch_size=32, group_size=8, renderer=cast(Any, None), split=split, seed=seed)
    ours = gsm8k.load_split(split, seed)
    assert [it.question for it in ours.items] == list(ds.ds["question"])
    for step in (0, 1, 5):
        builders = ds.get_batch(step)
        envs = [b.env_thunk() for b in builders]
        batch = ours.batch(step, 32)
        assert [(e.problem, e.answer) for e in envs] == [(it.question, it.reference) for it in batch]
    if split == "test":
        assert [it.index for it in ours.items] == list(range(len(ours)))
    else:
        assert [it.index for it in ours.items] != list(range(len(ours)))


def test_item_ids_are_stable_and_bound_to_rows():
    train, test = gsm8k.load_split("train", 0), gsm8k.load_split("test")
    assert test.items[0].item_id == "gsm8k-test-0000" and test.items[-1].item_id == "gsm8k-test-1318"
    # The id follows the original row, not the shuffled position.
    assert train.items[0].item_id == "gsm8k-train-5441"
    assert {it.item_id: it for it in gsm8k.load_split("train", 1).items}["gsm8k-train-5441"] == train.items[0]
    rows, _ = gsm8k.load_rows("train")
    for it in train.items[:50]:
        assert it.item_id == gsm8k.item_id("train", it.index) and rows[it.index]["question"] == it.question
    assert len({it.item_id for it in train.items}) == len(train.items)
    with pytest.raises(IndexError):
        test.batch(42, 32)


def _tokens(renderer, text, stop=True):
    ids = renderer.tokenizer.encode(text, add_special_tokens=False)
    return ids + ([renderer.get_stop_sequences()[0]] if stop else [])


def test_reward_on_hand_made_responses(renderer):
    item = gsm8k.load_split("test").items[0]  # reference 18
    assert item.reference == "18"
    cases = [
        ("16-3-4=9 eggs, 9*2=18. \\boxed{18}", True, 1.0, True, True),
        ("The answer is \\boxed{18}", False, 0.9, False, True),  # no stop token: format fails
        ("I think \\boxed{17}", True, 0.0, True, False),
        ("The answer is 18.", True, -0.1, False, False),  # right number but not boxed
        ("\\boxed{9} then \\boxed{18.0}", True, 1.0, True, True),  # last box, numeric equivalence
        ("\\boxed{\\$18}", True, 1.0, True, True),
    ]
    for text, stop, reward, fmt, correct in cases:
        g = gsm8k.grade_response(item, renderer, _tokens(renderer, text, stop))
        assert (g.reward, g.format_ok, g.correct) == pytest.approx((reward, fmt, correct)), text


def test_prompt_is_cookbook_one_shot_with_math_env_suffix(renderer):
    item = gsm8k.load_split("test").items[0]
    ob, stop = gsm8k.build_prompt(item, renderer)
    assert stop == [248046]
    text = renderer.tokenizer.decode(ob.to_ints())
    assert text.count("How many r's are in strawberry?") == 1
    assert (item.question + " Write your answer in \\boxed{} format.<|im_end|>") in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert renderer.build_generation_prompt(gsm8k.prompt_messages(item)).to_ints() == ob.to_ints()


def test_stop_list_copies_ids_or_strings():
    ids, texts = (151645,), ("</s>", "<|im_end|>")
    assert stop_list(ids) == [151645] and stop_list(texts) == ["</s>", "<|im_end|>"]
    # an empty list would make Spindle's sampler ignore end-of-sequence: refused, never sent
    with pytest.raises(ValueError, match="ignore end-of-sequence"):
        stop_list([])

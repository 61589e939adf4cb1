"""The greedy evaluation reaches its items' dataset through the dataset seam (`data.dataset`):
prompts, grading, item ids, split size and the code the evaluator identity covers come from the
registered dataset the items belong to, never from GSM8K directly."""

import dataclasses
import sys
import types

import pytest

from dppo_harness.data import dataset, gsm8k
from dppo_harness.data.tokenizer import make_renderer
from dppo_harness.evaluation import greedy as evaluation

from .test_answer_yield import _Sampler

TOY = "toy_gsm8k_seam"
MODULE = "tests_toy_dataset_seam"


@dataclasses.dataclass(frozen=True)
class ToyItem(gsm8k.Gsm8kItem):
    pass


ToyItem.__module__ = MODULE


@pytest.fixture()
def toy():
    """A registered dataset whose module wraps GSM8K and counts what the evaluation asks of it."""
    calls = {"build_prompt": 0, "grade_response": 0}
    mod = types.ModuleType(MODULE)
    mod.__file__ = __file__

    def build_prompt(item, renderer):
        calls["build_prompt"] += 1
        return gsm8k.build_prompt(item, renderer)

    def grade_response(item, renderer, tokens):
        calls["grade_response"] += 1
        return dataclasses.replace(
            gsm8k.grade_response(item, renderer, tokens), correct=True
        )  # the toy grades all right

    def item_id(split, index):
        return f"toy-{split}-{index:04d}"

    mod.build_prompt, mod.grade_response, mod.item_id = build_prompt, grade_response, item_id
    sys.modules[MODULE] = mod
    dataset.DATASETS[TOY] = dataset.DatasetEntry(TOY, "toy/gsm8k", MODULE, {"train": 7473, "test": 1319})
    try:
        yield calls
    finally:
        dataset.DATASETS.pop(TOY, None)
        sys.modules.pop(MODULE, None)


def test_evaluation_prompts_and_grades_through_the_items_dataset(toy):
    bundle = make_renderer()
    test = gsm8k.load_split("test")
    items = tuple(ToyItem(**{f.name: getattr(it, f.name) for f in dataclasses.fields(it)}) for it in test.items[:3])
    ev = evaluation.freeze_evaluator(
        items,
        bundle,
        max_tokens=32,
        deviation={"field": "evaluator", "original": "all", "effective": "3", "reason": "unit test subset"},
    )
    assert f"dppo_harness/data/{__file__.rsplit('/', 1)[-1]}" in ev.code_manifest["files"]
    res = evaluation.evaluate(_Sampler(bundle, [("no box", "stop")]), ev, arm="a", seed=0, checkpoint="c")
    assert toy["build_prompt"] >= 3 and toy["grade_response"] == 3
    assert res.accuracy == 1.0  # the toy dataset's grader, not GSM8K's


def test_gsm8k_evaluator_identity_is_unchanged_by_the_seam():
    files = evaluation.code_files("gsm8k")
    assert files["dppo_harness/data/gsm8k.py"].name == "gsm8k.py"
    assert evaluation.dataset_of(gsm8k.load_split("test").items[:2]) == "gsm8k"
    with pytest.raises(ValueError, match="no registered dataset"):
        evaluation.dataset_of([object()])

"""GSM8K: vendored data with pinned hashes, the cookbook's row order, item ids, env and reward.

Everything the model sees and every reward comes from tinker-cookbook's math_rl recipe
(``recipes/math_rl/math_env.py``): ``MathEnv`` with the one-shot "strawberry" prefix
(``MathEnv.standard_fewshot_prefix``), the question suffix ``MathEnv.question_suffix()``, the
``####`` reference extraction, the last ``\\boxed{}`` answer, ``grade_answer`` (sympy) and the reward
``0.1*(format_ok-1)+correct``. Note: ``Gsm8kDataset.question_suffix`` exists in the cookbook but the
recipe never uses it; its environments are ``MathEnv``, whose suffix is the one used here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NotRequired, TypedDict, TypeVar

import tinker
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl import math_grading
from tinker_cookbook.recipes.math_rl.math_env import MathEnv, extract_gsm8k_final_answer

from dppo_harness.data.dataset import DATASETS
from dppo_harness.data.sha256sums import DATA_DIR, DataIntegrityError, pinned_sha256
from dppo_harness.json_types import JsonObject

Split = Literal["train", "test"]
EXPECTED_ROWS = DATASETS["gsm8k"].split_sizes  # the rows of the upstream release, as registered


class Gsm8kRow(TypedDict):
    """One upstream GSM8K row; vendored rows also carry their original index."""

    question: str
    answer: str
    idx: NotRequired[int]


@dataclass(frozen=True)
class Gsm8kItem:
    item_id: str  # stable: split + ORIGINAL row index, independent of shuffling
    split: Split
    index: int  # original row index in the upstream release
    question: str
    solution: str  # the full GSM8K answer field (worked solution ending in '#### N')
    reference: str  # final answer as the cookbook extracts it (commas stripped)


@dataclass(frozen=True)
class Gsm8kSplit:
    split: Split
    seed: int | None  # the shuffle seed (train); None for test (kept in order)
    items: tuple[Gsm8kItem, ...]  # in cookbook order
    provenance: JsonObject = field(hash=False, compare=False)

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, step: int, groups_per_batch: int) -> tuple[Gsm8kItem, ...]:
        """Rows ``[step*B, (step+1)*B)`` like ``Gsm8kDataset.get_batch(step)``."""
        start, end = step * groups_per_batch, min((step + 1) * groups_per_batch, len(self.items))
        if step < 0 or start >= end:
            raise IndexError(f"step {step} with {groups_per_batch} groups is past the end ({len(self.items)} rows)")
        return self.items[start:end]


def item_id(split: Split, index: int) -> str:
    return f"gsm8k-{split}-{index:04d}"


def _parse_rows(data: bytes, origin: str) -> list[Gsm8kRow]:
    rows: list[Gsm8kRow] = []
    for lineno, line in enumerate(data.splitlines(), 1):
        row = json.loads(line)
        if (
            row.get("idx") != lineno - 1
            or not isinstance(row.get("question"), str)
            or not isinstance(row.get("answer"), str)
        ):
            raise DataIntegrityError(f"{origin}:{lineno}: unexpected row layout")
        rows.append(row)
    return rows


def load_rows(split: Split, *, data_dir: Path = DATA_DIR) -> tuple[list[Gsm8kRow], JsonObject]:
    """The vendored rows in ORIGINAL order plus provenance; the file's sha256 must be the pinned one."""
    expected = pinned_sha256(split, data_dir)
    path = data_dir / f"{split}.jsonl"
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != expected:
        raise DataIntegrityError(
            f"{path}: sha256 {got} does not match pinned {expected} (SHA256SUMS); refusing to use it"
        )
    rows = _parse_rows(data, str(path))
    if len(rows) != EXPECTED_ROWS[split]:
        raise DataIntegrityError(f"{split}: {len(rows)} rows, expected {EXPECTED_ROWS[split]}")
    prov: JsonObject = {"source": "vendored", "path": f"dppo_harness/data/gsm8k/{split}.jsonl"}
    prov.update({"split": split, "sha256": got, "pinned_sha256": expected, "verified": True, "n_rows": len(rows)})
    return rows, prov


def cookbook_permutation(n_rows: int, seed: int) -> list[int]:
    """Original row indices in the order ``Gsm8kDataset`` sees the train split: the cookbook calls
    ``datasets.Dataset.shuffle(seed=seed)`` on the loaded split, whose permutation depends only on
    the row count and the seed; the same call is made here on an index column."""
    # deferred: HF datasets takes seconds to import; a test split never needs it
    import datasets

    ds = datasets.Dataset.from_dict({"row": list(range(n_rows))}).shuffle(seed=seed)
    return [int(r) for r in list(ds["row"])]


def load_split(split: Split, seed: int = 0, *, data_dir: Path = DATA_DIR) -> Gsm8kSplit:
    """Verified items in the cookbook's order: train shuffled with ``seed``, test in order."""
    rows, prov = load_rows(split, data_dir=data_dir)
    order = cookbook_permutation(len(rows), seed) if split == "train" else list(range(len(rows)))
    items = tuple(
        Gsm8kItem(
            item_id=item_id(split, i),
            split=split,
            index=i,
            question=rows[i]["question"],
            solution=rows[i]["answer"],
            reference=extract_gsm8k_final_answer(rows[i]["answer"]),
        )
        for i in order
    )
    prov = {**prov, "order": "cookbook Gsm8kDataset", "shuffle_seed": seed if split == "train" else None}
    return Gsm8kSplit(split, seed if split == "train" else None, items, prov)


# --- environment and reward (cookbook MathEnv) ---------------------------------------------

T = TypeVar("T")


def _run_ready(coro: Coroutine[object, None, T]) -> T:
    """Drive a coroutine that never suspends (MathEnv's methods are pure CPU) to completion.
    Works whether or not an event loop is running; a suspending coroutine is an error."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("environment coroutine suspended; call it from async code instead")


def make_env(item: Gsm8kItem, renderer: renderers.Renderer) -> MathEnv:
    """The cookbook GSM8K recipe's env for one item (one-shot prefix, sympy grader, format 0.1)."""
    return MathEnv(item.question, item.reference, renderer, convo_prefix=MathEnv.standard_fewshot_prefix())


def prompt_messages(item: Gsm8kItem) -> list[renderers.Message]:
    return MathEnv.standard_fewshot_prefix() + [{"role": "user", "content": item.question + MathEnv.question_suffix()}]


def build_prompt(item: Gsm8kItem, renderer: renderers.Renderer) -> tuple[tinker.ModelInput, list[int] | list[str]]:
    """Prompt ModelInput and the stop condition (the renderer's stop sequences)."""
    ob, stop = _run_ready(make_env(item, renderer).initial_observation())
    return ob, stop


@dataclass(frozen=True)
class Graded:
    reward: float
    format_ok: bool
    correct: bool
    content: str  # parsed assistant text (what the grader read)
    answer_found: bool  # a \\boxed{} answer is in `content` (math_grading.extract_boxed finds one)


def grade_response(item: Gsm8kItem, renderer: renderers.Renderer, response_tokens: Sequence[int]) -> Graded:
    """Score sampled tokens with ``MathEnv.step``: reward 0.1*(format_ok-1)+correct."""
    env = make_env(item, renderer)
    tokens = [int(t) for t in response_tokens]
    result = _run_ready(env.step(tokens))
    message, _ = renderer.parse_response(tokens)
    content = renderers.get_text_content(message)
    return Graded(
        reward=float(result.reward),
        format_ok=bool(result.metrics["format"]),
        correct=bool(result.metrics["correct"]),
        content=content,
        answer_found=boxed_answer(content) is not None,
    )


def boxed_answer(content: str) -> str | None:
    """The answer the grader reads (the cookbook's `extract_boxed`: the last \\boxed{}), None when there is none."""
    try:
        return math_grading.extract_boxed(content)
    except ValueError:
        return None

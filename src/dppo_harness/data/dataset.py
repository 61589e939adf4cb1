"""The one dataset seam: a plan's `dataset` field selects a registered task dataset.

Stages never import a dataset module themselves; they ask `get(name)` for the plan's dataset and
use what it hands back (its splits in the recipe's order, prompts and the grader). GSM8K
(`gsm8k.py`, the vendored, hash-checked copy of `openai/gsm8k`) is the only dataset shipped; a
plan naming any other is refused at load (`check`) with one line. The dataset module is
imported only when a stage asks for it, so loading a plan stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType


class UnknownDatasetError(ValueError):
    """A dataset name that is not registered; the message lists the registered ones."""


@dataclass(frozen=True)
class DatasetEntry:
    name: str  # as a spec's `dataset.name` writes it
    hf_path: str  # the upstream release the vendored copy reproduces
    module: str  # the module that serves it: load_split, build_prompt, grade_response, prompt_messages, item_id
    split_sizes: Mapping[str, int]


DATASETS: dict[str, DatasetEntry] = {
    "gsm8k": DatasetEntry("gsm8k", "openai/gsm8k", "dppo_harness.data.gsm8k", {"train": 7473, "test": 1319}),
}


def names() -> tuple[str, ...]:
    return tuple(sorted(DATASETS))


def entry(name: str) -> DatasetEntry:
    if name not in DATASETS:
        raise UnknownDatasetError(
            f"{name!r} is not a registered dataset (registered: {', '.join(names())}; nothing else is fetched)"
        )
    return DATASETS[name]


def get(name: str) -> ModuleType:
    """The module serving dataset `name` (`load_split(split, seed=...)`, `build_prompt`,
    `grade_response`, `prompt_messages`, `item_id`)."""
    return importlib.import_module(entry(name).module)

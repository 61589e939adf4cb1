"""Run tinker-cookbook's own recipes offline against the embedded server (or any Tinker service).

Two things stop the cookbook's `recipes.math_rl` on a machine without the Hugging Face hub:
- it asks `tokenizer_utils.get_tokenizer(model_name)` for the served base model's tokenizer
  (`Qwen/Qwen3.5-2B`), which is not registered (only `tml-qwen3.5` is);
- `math_env.Gsm8kDataset` calls `datasets.load_dataset("openai/gsm8k", name="main", split=...)`.

`offline_cookbook()` registers the offline tml-renderers Qwen3.5 tokenizer under the base-model
name and, while active, answers the cookbook's GSM8K load with the vendored, hash-verified copy
(`dppo_harness/data/gsm8k`). Any other `load_dataset` call is refused with a clear error rather
than reaching for the network. The cookbook has no data-source hook, so the GSM8K part replaces
`math_env.load_dataset` (the name the cookbook module imported) and restores it on exit.

CLI (same `key=value` arguments as `python -m tinker_cookbook.recipes.math_rl.train`):

    TINKER_API_KEY=tml-local-rehearsal python -m dppo_harness.local_server.cookbook_offline \\
        base_url=http://127.0.0.1:8765 env=gsm8k model_name=Qwen/Qwen3.5-2B renderer_name=qwen3_5 \\
        group_size=4 groups_per_batch=4 max_tokens=64 max_steps=2 eval_every=0 \\
        log_path=/tmp/math_rl behavior_if_log_dir_exists=delete
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import datasets
from tinker_cookbook.recipes.math_rl import math_env
from tinker_cookbook.tokenizer_utils import register_tokenizer

from dppo_harness import constants
from dppo_harness.data import gsm8k, tokenizer

GSM8K_HUB_PATH = "openai/gsm8k"
GSM8K_HUB_CONFIG = "main"


class OfflineDataError(RuntimeError):
    """The cookbook asked for a data set this helper cannot serve offline."""


def register_offline_tokenizer(model_name: str = constants.BASE_MODEL) -> None:
    """Make `get_tokenizer(model_name)` return the offline Qwen3.5 tokenizer (same special ids)."""
    # TmlQwen35Tokenizer stands in for the cookbook's Hugging Face Tokenizer type: it has the
    # methods the cookbook calls.
    register_tokenizer(model_name, tokenizer._tml_qwen35)  # type: ignore[arg-type]


def vendored_gsm8k(split: str) -> datasets.Dataset:
    """The vendored GSM8K split (hash-verified) as the `datasets.Dataset` the hub would give."""
    if split not in gsm8k.SPLITS:
        raise OfflineDataError(f"GSM8K split {split!r}: the vendored copy has {list(gsm8k.SPLITS)}")
    rows, _ = gsm8k.load_rows(split)
    return datasets.Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in rows])


def offline_load_dataset(path: str, name: str | None = None, split: str | None = None, **_: Any) -> datasets.Dataset:
    """Stand-in for `datasets.load_dataset` inside the cookbook's math env: GSM8K only."""
    if path == GSM8K_HUB_PATH and name in (GSM8K_HUB_CONFIG, None) and split is not None:
        return vendored_gsm8k(split)
    raise OfflineDataError(
        f"offline cookbook: only {GSM8K_HUB_PATH} ({GSM8K_HUB_CONFIG}, train/test) is vendored; "
        f"the recipe asked for {path!r} name={name!r} split={split!r}"
    )


@contextlib.contextmanager
def offline_cookbook(model_name: str = constants.BASE_MODEL) -> Iterator[None]:
    """Offline tokenizer under `model_name` and vendored GSM8K for the cookbook's math env."""
    register_offline_tokenizer(model_name)
    original: Callable[..., Any] = math_env.load_dataset
    math_env.load_dataset = offline_load_dataset
    try:
        yield
    finally:
        math_env.load_dataset = original


def main() -> None:
    """`recipes.math_rl.train`'s CLI, run inside offline_cookbook()."""
    # the CLI alone needs chz and the cookbook's RL training loop (seconds to import)
    import chz
    from tinker_cookbook.recipes.math_rl import train  # likewise

    cli_config = chz.entrypoint(train.CLIConfig)
    with offline_cookbook(cli_config.model_name):
        asyncio.run(train.cli_main(cli_config))


if __name__ == "__main__":
    main()

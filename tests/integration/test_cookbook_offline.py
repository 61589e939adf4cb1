"""cookbook_offline: the offline tokenizer under the served name and vendored GSM8K, nothing else."""

import pytest

from dppo_harness import constants


def test_offline_helper_refuses_other_datasets():
    from tinker_cookbook.recipes.math_rl import math_env
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from dppo_harness.local_server.cookbook_offline import OfflineDataError, offline_cookbook, offline_load_dataset

    with offline_cookbook():
        assert math_env.load_dataset is offline_load_dataset
        ds = math_env.load_dataset("openai/gsm8k", name="main", split="test")
        assert len(ds) == 1319 and set(ds.column_names) == {"question", "answer"}
        with pytest.raises(OfflineDataError, match="HuggingFaceH4/MATH-500"):
            math_env.load_dataset("HuggingFaceH4/MATH-500", name="default", split="test")
        tok = get_tokenizer(constants.BASE_MODEL)
        assert tok.encode("<|im_end|>", add_special_tokens=False) == [constants.STOP_TOKEN_ID]
    assert math_env.load_dataset is not offline_load_dataset

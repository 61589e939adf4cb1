"""Tokenizer choice, the tml-renderers adapter and the renderer provenance."""

import pytest
from tinker_cookbook.tokenizer_utils import get_tokenizer

from dppo_harness import constants
from dppo_harness.data import tokenizer as tk


@pytest.fixture(scope="module")
def bundle():
    return tk.make_renderer()


def test_adapter_encodes_special_tokens_as_single_ids(bundle):
    t = bundle.tokenizer
    assert t.encode("<|im_start|>user\n", add_special_tokens=False)[0] == 248045
    ids = t.encode("a<|im_end|><think>\n</think>b", add_special_tokens=False)
    assert constants.STOP_TOKEN_ID in ids and 248068 in ids and 248069 in ids
    assert t.decode(ids) == "a<|im_end|><think>\n</think>b"
    assert t.decode(ids, skip_special_tokens=True) == "a\nb"
    assert t.eos_token_id == constants.STOP_TOKEN_ID
    with pytest.raises(ValueError, match="add_special_tokens"):
        t.encode("x", add_special_tokens=True)


def test_registered_with_cookbook_and_cached(bundle):
    assert get_tokenizer(tk.TML_QWEN35) is bundle.tokenizer


def test_wrong_tokenizer_is_refused():
    class ByteTokenizer:
        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

    with pytest.raises(tk.TokenizerConfigError, match="not a Qwen3.5 tokenizer"):
        tk.check_special_ids(ByteTokenizer())


def test_provenance_records_what_ran(bundle):
    prov = bundle.provenance
    assert prov["renderer_name"] == constants.RENDERER_NAME == "qwen3_5"
    assert prov["tokenizer"]["choice"] == "tml-qwen3.5" and prov["tokenizer"]["kind"] == "tml-renderers"
    assert prov["tokenizer"]["package_version"] == "0.2.1"
    assert prov["stop_sequences"] == [constants.STOP_TOKEN_ID]
    assert len(prov["tokenizer"]["vocab_fingerprint"]) == 64
    assert prov["renderer_class"].endswith("Qwen3_5Renderer")

"""Tokenizer choice, the tml-renderers adapter and the renderer provenance."""

import pytest
from tinker_cookbook.tokenizer_utils import get_tokenizer

from dppo_harness import constants
from dppo_harness.data import tokenizer as tk


@pytest.fixture(scope="module")
def bundle():
    return tk.make_renderer(tk.TML_QWEN35)


def test_choice_parsing_is_explicit():
    assert tk.parse_choice("tml-qwen3.5") == ("tml", None)
    assert tk.parse_choice("hf:Qwen/Qwen3.5-2B") == ("hf", "Qwen/Qwen3.5-2B")
    for bad in ("", "hf:", "qwen", "Qwen/Qwen3.5-2B", "tml-qwen3"):
        with pytest.raises(tk.TokenizerConfigError, match="unknown tokenizer choice"):
            tk.parse_choice(bad)


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


def test_hf_choice_never_falls_back_to_tml(monkeypatch):
    import transformers

    calls = []

    def offline(name, **kw):
        calls.append(name)
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(OSError, match="couldn't connect"):
        tk.load_tokenizer("hf:Qwen/Qwen3.5-2B")
    assert calls == ["Qwen/Qwen3.5-2B"]


def test_hf_choice_uses_the_hf_tokenizer_and_checks_it(monkeypatch, bundle):
    import transformers

    class HfLike:  # stands in for a downloaded PreTrainedTokenizer with Qwen3.5 ids
        def encode(self, text, add_special_tokens=False):
            return bundle.tokenizer.encode(text)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kw: HfLike())
    tok, prov = tk.load_tokenizer("hf:Qwen/Qwen3.5-2B")
    assert isinstance(tok, HfLike) and prov["kind"] == "huggingface" and prov["name_or_path"] == "Qwen/Qwen3.5-2B"
    assert prov["vocab_fingerprint"] == bundle.provenance["tokenizer"]["vocab_fingerprint"]

    class Wrong:
        def encode(self, text, add_special_tokens=False):
            return [1, 2]

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kw: Wrong())
    with pytest.raises(tk.TokenizerConfigError, match="not a Qwen3.5 tokenizer"):
        tk.load_tokenizer("hf:some/other-model")

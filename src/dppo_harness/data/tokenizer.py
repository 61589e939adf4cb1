"""The tokenizer and the renderer.

The one tokenizer is ``"tml-qwen3.5"``: the offline ``tml_renderers.tokenizers.Qwen35Tokenizer``
(tml-renderers 0.2.1) behind :class:`TmlQwen35Tokenizer`, a small HF-style adapter the cookbook
renderers can use, so no run needs the hub.

The renderer name is explicit (``constants.RENDERER_NAME``): ``Qwen/Qwen3.5-2B`` is not in the
cookbook's model table, so ``get_recommended_renderer_name`` cannot be used.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tinker_cookbook import renderers
from tinker_cookbook.tokenizer_utils import Tokenizer, register_tokenizer

from dppo_harness import constants
from dppo_harness.json_types import JsonObject

TML_QWEN35 = "tml-qwen3.5"
# Ids every Qwen3.5 tokenizer must agree on; checked at load so a wrong tokenizer fails loudly.
EXPECTED_SPECIAL_IDS = {"<|im_start|>": 248045, "<|im_end|>": constants.STOP_TOKEN_ID}


class TokenizerConfigError(ValueError):
    """A tokenizer that disagrees with the pinned ids."""


class TmlQwen35Tokenizer:
    """HF-style facade (encode/decode/eos_token_id) over the offline tml-renderers Qwen3.5 tokenizer.

    The cookbook renderers call ``encode(text, add_special_tokens=False)`` on strings that contain
    chat-template special tokens (``<|im_start|>``, ``<think>``...). HF tokenizers map those
    substrings to their single ids; ``encode_ordinary`` would split them into bytes, so this
    adapter cuts the text at every special-token surface string first.
    """

    name_or_path = TML_QWEN35

    def __init__(self) -> None:
        # deferred: importing tml_renderers takes seconds, and only this tokenizer needs it
        from tml_renderers.tokenizers import Qwen35Tokenizer

        self.tml_tokenizer = Qwen35Tokenizer()
        special: dict[str, int] = {}
        for name in self.tml_tokenizer.special_tokens():
            token_id = int(self.tml_tokenizer.encode_special(name))
            special[self.tml_tokenizer.decode([token_id])] = token_id
        self.special_token_ids: dict[str, int] = special
        # Longest first so a token that is a prefix of another never wins.
        alternatives = sorted(special, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")
        self.eos_token = self.tml_tokenizer.decode(
            [int(self.tml_tokenizer.encode_special(self.tml_tokenizer.eos_token))]
        )
        self.eos_token_id = special[self.eos_token]

    def encode(self, text: str, add_special_tokens: bool = False, **_: object) -> list[int]:
        if add_special_tokens:
            # Qwen tokenizers add no BOS; refusing keeps the behaviour explicit rather than guessed.
            raise ValueError("TmlQwen35Tokenizer does not add special tokens; pass add_special_tokens=False")
        out: list[int] = []
        for piece in self._special_re.split(text):
            if not piece:
                continue
            if piece in self.special_token_ids:
                out.append(self.special_token_ids[piece])
            else:
                out.extend(self.tml_tokenizer.encode_ordinary(piece))
        return out

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False, **_: object) -> str:
        ids = [int(t) for t in token_ids]
        if skip_special_tokens:
            ids = [t for t in ids if not self.tml_tokenizer.is_special_token(t)]
        return str(self.tml_tokenizer.decode(ids))


@functools.cache
def _tml_qwen35() -> TmlQwen35Tokenizer:
    # Construction takes seconds (vocabulary load); one instance per process is enough.
    return TmlQwen35Tokenizer()


# Registered under the configuration name so cookbook code that calls
# ``tokenizer_utils.get_tokenizer("tml-qwen3.5")`` gets the same object.
# The facade is not a PreTrainedTokenizer subclass (the cookbook's `Tokenizer`); it has the methods
# the cookbook's renderers call on one.
register_tokenizer(TML_QWEN35, _tml_qwen35)  # type: ignore[arg-type]


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class TokenizerBundle:
    tokenizer: Tokenizer
    renderer: renderers.Renderer
    renderer_name: str
    provenance: JsonObject


def load_tokenizer() -> tuple[Tokenizer, JsonObject]:
    """The one tokenizer (`TML_QWEN35`) with its provenance record."""
    tokenizer: Tokenizer = _tml_qwen35()  # type: ignore[assignment]  # a facade with the tokenizer methods renderers call
    prov: JsonObject = {
        "choice": TML_QWEN35,
        "kind": "tml-renderers",
        "class": "tml_renderers.tokenizers.Qwen35Tokenizer",
        "adapter": f"{__name__}.TmlQwen35Tokenizer",
        "package_version": package_version("tml-renderers"),
    }
    check_special_ids(tokenizer)
    prov["special_ids"] = dict(EXPECTED_SPECIAL_IDS.items())
    prov["vocab_fingerprint"] = vocab_fingerprint(tokenizer)
    return tokenizer, prov


def check_special_ids(tokenizer: Tokenizer) -> None:
    for text, expected in EXPECTED_SPECIAL_IDS.items():
        got = tokenizer.encode(text, add_special_tokens=False)
        if got != [expected]:
            raise TokenizerConfigError(
                f"tokenizer encodes {text!r} as {got}, expected [{expected}]: not a Qwen3.5 tokenizer"
            )


# Fixed probe text: special tokens, digits, LaTeX and unicode the GSM8K path produces.
_FINGERPRINT_TEXT = (
    "<|im_start|>user\nJanet\u2019s ducks lay 16 eggs per day. 16 - 3 - 4 = 9; 9 * $2 = $18."
    " Write your answer in \\boxed{} format.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "\\boxed{18}<|im_end|>"
)


def vocab_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 of the token ids of a fixed probe text: two tokenizers that agree here agree on
    the GSM8K chat template's pieces (not a proof of full-vocabulary identity)."""
    ids = tokenizer.encode(_FINGERPRINT_TEXT, add_special_tokens=False)
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()


def make_renderer() -> TokenizerBundle:
    """Tokenizer + cookbook renderer, with a provenance dict for the evidence bundle."""
    renderer_name = constants.RENDERER_NAME
    tokenizer, tok_prov = load_tokenizer()
    renderer = renderers.get_renderer(renderer_name, tokenizer=tokenizer)
    stop = renderer.get_stop_sequences()
    provenance: JsonObject = {
        "tokenizer": tok_prov,
        "renderer_name": renderer_name,
        "renderer_class": f"{type(renderer).__module__}.{type(renderer).__qualname__}",
        "stop_sequences": list(stop),
        "tinker_cookbook_version": package_version("tinker-cookbook"),
    }
    return TokenizerBundle(tokenizer, renderer, renderer_name, provenance)


THINK_PREFILL = "<think>\n"


def renderer_declaration() -> JsonObject:
    """The default renderer and its thinking mode, read off a rendered generation prompt (not
    assumed): what `effective-config.json` declares and the reports state next to the measured
    truncation. A copy of the once-computed declaration (it is deterministic)."""
    return dict(_renderer_declaration())


@functools.cache
def _renderer_declaration() -> JsonObject:
    b = make_renderer()
    ob = b.renderer.build_generation_prompt([renderers.Message(role="user", content="{question}")])
    decoded = b.tokenizer.decode(ob.to_ints())
    text = decoded if isinstance(decoded, str) else "".join(decoded)
    head = "<|im_start|>assistant\n"
    suffix = text[text.rindex(head) :] if head in text else text[-32:]
    thinking = suffix.endswith(THINK_PREFILL)
    return {
        "name": b.renderer_name,
        "class": b.provenance["renderer_class"],
        "thinking": "enabled" if thinking else "disabled",
        "generation_prompt_suffix": suffix,
        "note": (
            "every generation prompt ends with '<think>\\n': a response starts inside a reasoning block, "
            "so one cut off at max_tokens before its \\boxed{} answer scores 0 (reward -0.1 in training); "
            "the measured truncation rates are in the step rows, the gate and diagnostic records and the "
            "evaluation metrics"
        )
        if thinking
        else "the generation prompt opens no reasoning block",
        "alternative": _disable_thinking_variant(b) if thinking else None,
    }


def _disable_thinking_variant(b: TokenizerBundle) -> str | None:
    """The cookbook's no-thinking renderer of the same family, if it has one."""
    name = f"{b.renderer_name}_disable_thinking"
    try:
        renderers.get_renderer(name, tokenizer=b.tokenizer)
    except (ValueError, KeyError):
        return None
    return name


def stop_list(stop: Sequence[int] | Sequence[str]) -> list[int] | list[str]:
    """A list copy of a stop condition: the renderer's stop token ids, or its stop strings. Never
    empty: Spindle's sampler reads `stop == []` as "ignore end-of-sequence" and always generates
    max_tokens (inference/sampling.py), so an empty condition is refused here."""
    if not stop:
        raise ValueError(
            "the renderer gave no stop tokens or strings: an empty stop list would make the sampler "
            "ignore end-of-sequence (Spindle generates max_tokens); check the renderer named in the plan"
        )
    ids = [t for t in stop if isinstance(t, int)]
    return ids if len(ids) == len(stop) else [str(t) for t in stop]

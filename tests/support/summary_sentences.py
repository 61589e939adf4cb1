"""How tests count the sentences of a result's summary (the brief asks for at most two)."""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def count_sentences(text: str) -> int:
    """Sentences = terminal punctuation followed by whitespace or the end (decimals like 0.5 and
    names like local/tiny-qwen3 do not end one); a trailing fragment without a full stop counts."""
    stripped = text.strip()
    if not stripped:
        return 0
    ends = len(_SENTENCE_END.findall(stripped))
    return ends + (0 if _SENTENCE_END.search(stripped[-1:] + " ") else 1)

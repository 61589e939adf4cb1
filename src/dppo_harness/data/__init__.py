"""Task data: vendored GSM8K with pinned hashes, the tokenizer and renderer, the dataset seam.

Also the type of the JSON data the harness writes (provenance, metadata, record blocks):
`JsonData`, with read-only containers so a `dict[str, list[int]]` is JSON data too, and
`JsonObject`, one JSON object under construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

JsonData: TypeAlias = Mapping[str, "JsonData"] | Sequence["JsonData"] | str | int | float | None
JsonObject: TypeAlias = dict[str, JsonData]

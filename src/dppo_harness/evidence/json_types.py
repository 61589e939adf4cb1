"""Free-form JSON as written to evidence files: what the harness records but does not interpret."""

from __future__ import annotations

from pydantic import JsonValue

JsonObject = dict[str, JsonValue]

__all__ = ["JsonObject", "JsonValue"]

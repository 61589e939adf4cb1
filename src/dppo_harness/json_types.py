"""JSON as types, one name each for every package: `JsonValue` (pydantic's), `JsonObject` (one object
as built or decoded), `JsonMap` (one object as a reader sees it), and the narrowing a reader applies to
one value (`num`, `obj`, `objs`, `items`: a wrong shape raises TypeError)."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import JsonValue

JsonObject = dict[str, JsonValue]
JsonMap = Mapping[str, JsonValue]

__all__ = ["JsonMap", "JsonObject", "JsonValue", "items", "num", "obj", "objs"]


def num(x: JsonValue) -> float:
    """A number of the evidence JSON, as it is (an int stays an int)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x
    raise TypeError(f"expected a number, got {type(x).__name__}")


def items(x: JsonValue) -> list[JsonValue]:
    """A list of the evidence JSON."""
    if isinstance(x, list):
        return x
    raise TypeError(f"expected a list, got {type(x).__name__}")


def objs(x: JsonValue) -> list[JsonMap]:
    """A list of objects of the evidence JSON."""
    if isinstance(x, list):
        return [obj(v) for v in x]
    raise TypeError(f"expected a list, got {type(x).__name__}")


def obj(x: JsonValue) -> JsonMap:
    """An object of the evidence JSON."""
    if isinstance(x, dict):
        return x
    raise TypeError(f"expected an object, got {type(x).__name__}")

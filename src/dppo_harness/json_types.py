"""JSON as types, one name each for every package: `JsonValue` (pydantic's), `JsonObject` (one object
as built or decoded), `JsonMap` (one object as a reader sees it), and the narrowing a reader applies to
one value (`num`, `obj`, `objs`, `items`: a wrong shape raises TypeError), or a record as JSON
(`as_object`, `as_value`)."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import JsonValue

JsonObject = dict[str, JsonValue]
JsonMap = Mapping[str, JsonValue]

__all__ = ["JsonMap", "JsonObject", "JsonValue", "as_object", "as_value", "items", "num", "obj", "objs"]


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


def as_value(x: object) -> JsonValue:
    """`x` as a JSON value, checked all the way down (a TypedDict record is not a `JsonValue` to the
    type checker): tuples become lists, as `json.dumps` writes them; anything that is not JSON raises
    TypeError."""
    if x is None or isinstance(x, (str, bool, int, float)):
        return x
    if isinstance(x, Mapping):
        return as_object(x)
    if isinstance(x, (list, tuple)):
        return [as_value(v) for v in x]
    raise TypeError(f"not JSON: {type(x).__name__}")


def as_object(x: Mapping[str, object]) -> JsonObject:
    """A record's JSON object (a TypedDict, a dict of numbers), checked as `as_value`, key order kept."""
    out: JsonObject = {}
    for k, v in x.items():
        if not isinstance(k, str):
            raise TypeError(f"not a JSON key: {k!r}")
        out[k] = as_value(v)
    return out

"""pydantic v2 validation errors as one line that names the field path.

Plans and result.json both validate through strict pydantic models; their errors read
`schedule.epochs: missing required key` or `activation_gate.checks[2].min: expected number,
got str`, the format the harness has always used. A cross-field rule raises `rule_error(at, msg)`
so that its message names the sub-field it is about (`at`, relative to the validated model).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ConfigDict, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

# strict: no coercion ("1" is not a number, 1.0 not an int, 1 not a bool); no NaN/inf; no extra keys.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
RULE = "rule"


def rule_error(at: str, message: str) -> PydanticCustomError:
    """A cross-field rule's failure, reported at `at` (dotted path below the model, '' = the model)."""
    return PydanticCustomError(RULE, "{message}", {"message": message, "at": at})


def type_name(value: object) -> str:
    return {type(None): "null", dict: "object"}.get(type(value), type(value).__name__)


def format_path(loc: Sequence[str | int]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


_EXPECTED = {
    "float_type": "number",
    "int_type": "integer",
    "bool_type": "bool",
    "string_type": "string",
    "list_type": "list",
    "dict_type": "object",
    "model_type": "object",
    "model_attributes_type": "object",
}
_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "less_than_equal": ("<=", "le"),
    "greater_than": (">", "gt"),
    "less_than": ("<", "lt"),
}


def describe(err: ErrorDetails) -> str:
    """`path: message` for one pydantic error, in the harness's wording."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    loc = list(err["loc"])
    if kind == RULE:
        loc += [p for p in str(ctx["at"]).split(".") if p]
        msg = str(ctx["message"])
    elif kind == "missing":
        msg = "missing required key"
    elif kind == "extra_forbidden":
        msg = "unknown key"
    elif kind in _EXPECTED:
        msg = f"expected {_EXPECTED[kind]}, got {type_name(value)}"
    elif kind == "finite_number":
        msg = f"expected a finite number, got {value!r}"
    elif kind == "literal_error" and isinstance(value, bool) and ctx["expected"] in ("True", "False"):
        msg = f"expected {ctx['expected'].lower()}, got {str(value).lower()}"
    elif kind == "literal_error":
        msg = f"expected one of [{ctx['expected']}], got {value!r}"
    elif kind == "string_pattern_mismatch":
        msg = f"expected a string matching {ctx['pattern']!r}, got {value!r}"
    elif kind in _BOUNDS:
        op, bound = _BOUNDS[kind]
        msg = f"expected a number {op} {ctx[bound]}, got {value!r}"
    elif kind == "too_short":
        msg = f"expected at least {ctx['min_length']} items, got {ctx['actual_length']}"
    elif kind == "too_long":
        msg = f"expected at most {ctx['max_length']} items, got {ctx['actual_length']}"
    else:
        msg = err["msg"]
    return f"{format_path(loc) or '<root>'}: {msg}"


def first_error(exc: ValidationError) -> str:
    """The first error (in field order), plus how many more there were."""
    errors = exc.errors(include_url=False)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return describe(errors[0]) + more

"""Helpers shared by the diagnostic and the comparison report: numbers as the report prints them,
the declared renderer / loss normalization with the measured truncation under them, and the
comparison's step rows per arm."""

from __future__ import annotations

from collections.abc import Sequence

from dppo_harness.json_types import JsonMap, JsonValue, num, obj

REPORT_FILE = "report.md"


def fmt(x: object, spec: str = ".4g") -> str:
    if x is None:
        return "n/a"
    return format(x, spec) if isinstance(x, float) else str(x)


def pct(x: JsonValue) -> str:
    return f"{100 * num(x):.1f}%"


def declared_lines(declared: JsonMap, measured: Sequence[tuple[str, JsonMap | None]]) -> list[str]:
    """The renderer and its thinking mode with the measured truncation right under it, and the loss
    normalization against the cookbook ppo's sum (both as effective-config.json declares them)."""
    out = []
    r = obj(declared["renderer"]) if declared.get("renderer") else None
    # '  - label: 12 of 256 responses (4.7%) truncated at max_tokens 512, 30 (11.7%) without a parseable answer, mean 210 tokens'
    seen = [
        f"  - {label}: {y['truncated']} of {y['n']} responses ({pct(y['truncated_frac'])}) truncated"
        + (f" at max_tokens {y['max_tokens']}" if y.get("max_tokens") else "")
        + f", {y['no_answer']} ({pct(y['no_answer_frac'])}) without a parseable answer, mean "
        f"{y['mean_response_tokens']:.0f} tokens"
        for label, y in measured
        if y
    ]
    if r:
        prefill = (
            "every generation prompt ends with `<think>\\n`" if r.get("thinking") == "enabled" else "no think prefill"
        )
        head = f"- renderer `{r['name']}`, thinking {r.get('thinking')} ({prefill}); measured truncation"
    else:
        head = "- renderer: not declared in effective-config.json; measured truncation"
    out.append(head + (":" if seen else ": not measured"))
    out += seen
    n = obj(declared["loss_normalization"]) if declared.get("loss_normalization") else None
    if n:
        out.append(
            f"- loss normalization `{n['mode']}`: {n['definition']}. The cookbook's `ppo` instead: {n['cookbook_ppo']}."
        )
    return out


def rows_by_arm(rows: Sequence[JsonMap]) -> dict[str, list[JsonMap]]:
    out: dict[str, list[JsonMap]] = {}
    for r in rows:
        out.setdefault(str(r["arm"]), []).append(r)
    return {a: sorted(rs, key=lambda r: num(r["step"])) for a, rs in out.items()}

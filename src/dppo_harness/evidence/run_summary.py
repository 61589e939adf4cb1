"""The closing block of a harness session (`hooks.pytest_terminal_summary` prints it), from the
bundle's result.json only, plus the stages the plugin saw fail: the terminal says what the evidence says."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from dppo_harness.json_types import JsonMap, items, obj, objs

TITLE = "dppo-harness run summary"
BASE_ARM = "base"  # comparison_eval.BASE_ARM: the base model's key under metrics.arms


def _num(x: object, spec: str = ".4g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _stopped_line(stage_failures: Mapping[str, str], messages: Mapping[str, str], stage_order: Sequence[str]) -> str:
    ordered = [s for s in stage_order if s in stage_failures] + [s for s in stage_failures if s not in stage_order]
    stage = ordered[0]
    why = messages.get(stage) or stage_failures[stage]
    where = stage_failures[stage]
    text = f"stopped at stage '{stage}': {why}"
    if where and where not in why:
        text += f" ({where})"
    later = ordered[1:]
    return text + (f"; later failures in {', '.join(later)}" if later else "")


def _accuracy(m: JsonMap) -> str:
    return f"accuracy {_num(m.get('accuracy'))} (n={_num(m.get('eval_n'), '.0f')}, {_num(m.get('eval_invalid_outputs'), '.0f')} invalid)"


def arm_line(arm: str, m: JsonMap, completed: bool) -> str:
    """One trained arm: steps, final reward, accuracy (or that it was not evaluated)."""
    acc = _accuracy(m) if m.get("accuracy") is not None else "accuracy n/a (not evaluated)"
    done = " (completed)" if completed else ""
    return f"{arm}: {_num(m.get('steps_completed'), '.0f')} steps{done}, final reward {_num(m.get('reward_mean_last'))}, {acc}"


def summary_lines(
    result: JsonMap,
    run_dir: Path,
    *,
    stage_failures: Mapping[str, str] | None = None,
    failure_messages: Mapping[str, str] | None = None,
    stage_order: Sequence[str] = (),
) -> list[str]:
    """The block's lines (no title). `stage_failures`: stage -> first failing test id; `failure_messages`:
    stage -> that failure's one-line message."""
    failures = dict(stage_failures or {})
    status, verdict = result.get("status"), result.get("verdict")
    head = f"run {Path(run_dir).name}: status {status}"
    if verdict:
        reason = result.get("outcome_reason")
        head += f", verdict {verdict}" + (f" ({reason})" if reason else "")
    else:
        head += ", no verdict"
    lines = [head]
    if failures:
        lines.append(_stopped_line(failures, dict(failure_messages or {}), stage_order))
    elif result.get("capacity_block"):
        cb = obj(result["capacity_block"])
        lines.append(
            f"stopped by service capacity after {cb.get('comparison_steps_completed')} comparison steps: "
            f"{cb.get('error')}"
        )
    elif status == "running":
        lines.append("the session ended before any stage closed the result (status still running)")
    lines.append(f"evidence: {run_dir}")
    names = {f.get("name") for f in objs(obj(result.get("evidence") or {}).get("files", []))}
    lines.append(
        f"report:   {Path(run_dir) / 'files' / 'report.md'}"
        if "report.md" in names
        else "report:   none written (no stage reached its report)"
    )
    metrics = obj(result.get("metrics") or {})
    arms = obj(metrics.get("arms") or {})
    completed = set(map(str, items(result.get("completed_arms") or [])))
    trained = [a for a in arms if a != BASE_ARM]
    for arm in trained:
        lines.append("  " + arm_line(arm, obj(arms[arm]), arm in completed))
    if BASE_ARM in arms:
        lines.append(f"  base model: {_accuracy(obj(arms[BASE_ARM]))}")
    if not trained:
        if "diagnostic/updates_done" in metrics:
            lines.append(
                f"  bounded diagnostic (dppo_seed0 trained, no outcome arms): "
                f"{_num(metrics['diagnostic/updates_done'], '.0f')} updates, mask fired "
                f"{'yes' if metrics.get('diagnostic/mask_fired') else 'no'}, active "
                f"{'yes' if metrics.get('diagnostic/active') else 'no'}"
            )
        else:
            lines.append("  no arm trained in this session")
    return lines

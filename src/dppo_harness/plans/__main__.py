"""`python -m dppo_harness.plans validate PLAN.json`: the plan's effective config (JSON) on stdout
and its reading lines on stderr, or one line per error (exit 1; 2 for usage), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dppo_harness.evaluation.stats import hoeffding_half_width
from dppo_harness.plans.plan import Plan, load_plan, plan_config, plan_errors
from dppo_harness.plans.resolution import KEYS


def reading_lines(plan: Plan) -> list[str]:
    """The information lines `validate` prints on stderr (none for a plan without a run config): each
    schedule value with where it came from; per criterion, the paired Hoeffding half-width at the
    planned test items next to its margin."""
    run = plan.run
    if run is None:
        return []
    out = [
        f"{plan.name}: values the spec states only in prose (config.run.stated_in_prose), each with the "
        "sentence its resolution file quotes:"
    ]
    for name, s in run.stated.items():
        origin = f"default ({s.field}): {s.source}" if s.default else f"from {s.field}: {s.source!r}"
        out.append(f"  {name} = {s.value} ({KEYS[name].what}) {origin}")
    out.append(f"{plan.name}: decision at the planned size (information, not a check):")
    for c in run.criteria:
        lo, hi = c.bounds
        span = hi - lo  # the difference lies in [-span, span]
        hw = hoeffding_half_width(run.eval_items, run.alpha, 2 * span)
        up, down = c.margin + hw, c.margin - hw
        out.append(
            f"  {c.id}: {c.metric} {c.treatment} - {c.baseline}: half-width {hw:.4g} at {run.eval_items} "
            f"paired items (alpha {run.alpha:g}, difference range {2 * span:g}) next to margin {c.margin:g}: "
            f"supported needs an observed mean difference above {up:.4g}{' (unreachable)' if up >= span else ''}"
            f", refuted one below {down:.4g}{' (unreachable)' if down <= -span else ''}"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dppo_harness.plans")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="print the effective config of a plan, or its errors")
    v.add_argument("plan", type=Path)
    args = parser.parse_args(argv)
    errors = plan_errors(args.plan)
    if errors:
        for line in errors:
            print(line, file=sys.stderr)
        return 1
    plan = load_plan(args.plan)
    print(json.dumps(plan_config(plan), indent=2))
    for line in reading_lines(plan):
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

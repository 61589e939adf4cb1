"""`python -m dppo_harness.plans`: check a plan, or write a declared rehearsal plan of a spec.

    python -m dppo_harness.plans validate PLAN.json
        prints the plan's effective config (JSON), or one line per error (exit 1)
    python -m dppo_harness.plans rehearse SPEC.json --out PLAN.json [--steps N] [--groups G]
                                          [--eval-items M] [--lr X] [--lr-reason TEXT]
        writes a rehearsal plan of SPEC for the embedded server's stand-in model: N rollout steps
        of G groups, M test items, lr X (default: the spec's), every difference declared with its
        reason, gates and decision rule unchanged, derived_from with SPEC's sha256; written only
        once it validates

A usage or plan problem is one line on stderr and exit code 1 (2 for usage), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dppo_harness.plans.models import PlanError
from dppo_harness.plans.plan import load_plan, plan_config, plan_errors
from dppo_harness.plans.rehearsal import (
    DEFAULT_EVAL_ITEMS,
    DEFAULT_GROUPS,
    DEFAULT_STEPS,
    STAND_IN,
    RehearsalSize,
    make_rehearsal,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dppo_harness.plans")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="print the effective config of a plan, or its errors")
    v.add_argument("plan", type=Path)
    r = sub.add_parser("rehearse", help="write a declared rehearsal plan of an experiment spec")
    r.add_argument("spec", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"rollout steps per arm (default {DEFAULT_STEPS})")
    r.add_argument("--groups", type=int, default=DEFAULT_GROUPS,
                   help=f"groups per rollout batch (default {DEFAULT_GROUPS})")
    r.add_argument("--eval-items", type=int, default=DEFAULT_EVAL_ITEMS,
                   help=f"test items scored per model (default {DEFAULT_EVAL_ITEMS})")
    r.add_argument("--lr", type=float, default=None, help="learning rate of every arm (default: the spec's)")
    r.add_argument("--lr-reason", default=None, help="why that lr (recorded as the difference's reason)")
    r.add_argument("--stand-in", default=STAND_IN, help=f"the model that computes (default {STAND_IN})")
    r.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    args = parser.parse_args(argv)
    if args.command == "validate":
        errors = plan_errors(args.plan)
        if errors:
            for line in errors:
                print(line, file=sys.stderr)
            return 1
        print(json.dumps(plan_config(load_plan(args.plan)), indent=2))
        return 0
    if args.out.exists() and not args.force:
        print(f"--out: {args.out} exists (pass --force to overwrite)", file=sys.stderr)
        return 1
    try:
        data = make_rehearsal(args.spec, args.out, RehearsalSize(args.steps, args.groups, args.eval_items, args.lr,
                                                                 args.lr_reason, args.stand_in))
    except PlanError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{args.spec}: cannot read ({exc.strerror})", file=sys.stderr)
        return 1
    # validated where it will live (derived_from resolves beside it), moved to --out only if it validates
    args.out.parent.mkdir(parents=True, exist_ok=True)
    staged = args.out.with_name(f".{args.out.name}.unvalidated")
    staged.write_bytes(data)
    try:
        errors = plan_errors(staged)
        if not errors:
            staged.replace(args.out)
    finally:
        staged.unlink(missing_ok=True)
    for line in errors:
        print(line, file=sys.stderr)
    if errors:
        print(f"--out: {args.out} not written: the rehearsal plan does not validate", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({len(data)} bytes); it validates", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

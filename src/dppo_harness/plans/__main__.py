"""`python -m dppo_harness.plans`: check a plan, or write a declared rehearsal plan of a spec.

    python -m dppo_harness.plans validate PLAN.json
        prints the plan's effective config (JSON) on stdout, and on stderr each value read from
        the spec's prose with the sentence it came from (or the default or resolution that set
        it) and, as information, the decision's half-width at the planned item count next to
        each criterion's margin; or one line per error (exit 1)
    python -m dppo_harness.plans rehearse SPEC.json --out PLAN.json [--steps N] [--groups G]
                                          [--eval-items M] [--lr X | --spec-lr] [--lr-reason TEXT]
        writes a rehearsal plan of SPEC for the embedded server's stand-in model: N rollout steps
        of G groups (default: 32 rollouts per batch), M test items, lr X (default: the stand-in's
        measured 1e-2; --spec-lr keeps the spec's), every difference declared with its reason,
        gates and decision rule unchanged, derived_from with SPEC's sha256; written only once it
        validates. With no options the whole pipeline runs on the stand-in, as the shipped
        rehearsal's does (for the saved spec it writes that plan byte for byte)

A usage or plan problem is one line on stderr and exit code 1 (2 for usage), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dppo_harness.plans.model_base import PlanError
from dppo_harness.plans.plan import load_plan, plan_config, plan_errors
from dppo_harness.plans.reading import reading_lines
from dppo_harness.plans.rehearsal import (
    DEFAULT_EVAL_ITEMS,
    DEFAULT_ROLLOUTS,
    DEFAULT_STEPS,
    STAND_IN,
    STAND_IN_LR,
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
    r.add_argument(
        "--groups",
        type=int,
        default=None,
        help=f"groups per rollout batch (default: {DEFAULT_ROLLOUTS} rollouts per batch)",
    )
    r.add_argument(
        "--eval-items",
        type=int,
        default=DEFAULT_EVAL_ITEMS,
        help=f"test items scored per model (default {DEFAULT_EVAL_ITEMS})",
    )
    lr = r.add_mutually_exclusive_group()
    lr.add_argument(
        "--lr",
        type=float,
        default=STAND_IN_LR,
        help=f"learning rate of every arm (default {STAND_IN_LR}, measured on the stand-in)",
    )
    lr.add_argument("--spec-lr", action="store_true", help="keep the spec's learning rates")
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
        plan = load_plan(args.plan)
        print(json.dumps(plan_config(plan), indent=2))
        for line in reading_lines(plan):
            print(line, file=sys.stderr)
        return 0
    if args.out.exists() and not args.force:
        print(f"--out: {args.out} exists (pass --force to overwrite)", file=sys.stderr)
        return 1
    try:
        size = RehearsalSize(
            args.steps, args.groups, args.eval_items, None if args.spec_lr else args.lr, args.lr_reason, args.stand_in
        )
        data = make_rehearsal(args.spec, args.out, size)
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

"""The correctness preflight's ``correctness_preflight`` block built from a golden parity report,
its validator, and the CLI. numpy only: the parity run itself (torch, the SDK) is
``correctness_golden``, which only the ``check-golden`` command loads.

CLI::

    python -m dppo_harness.loss.correctness check-golden FILE [--json OUT] [--spec SPEC]
    python -m dppo_harness.loss.correctness validate SPEC PREFLIGHT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import JsonValue

from dppo_harness.constants import BASELINE_REVISION, REFERENCE_REVISION
from dppo_harness.json_types import JsonObject, as_object
from dppo_harness.loss.golden import (
    CHECK_NAMES,
    DEFAULT_TOLERANCES,
    GOLDEN_SCHEMA,
    MODES,
    ErrorMeasures,
    GoldenError,
    GoldenReport,
    errors_pass,
)
from dppo_harness.loss.loss_registry import PATH_ID, implemented_list
from dppo_harness.service.secrets_scan import without_credentials

_LOSSES_PY = Path(__file__).with_name("losses.py")


def _object(value: JsonValue) -> JsonObject:
    """A JSON value that must be an object here (a spec's or block's structure)."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _limits(tol: JsonValue) -> dict[str, float]:
    """One check's tolerance ({atol, rtol, min_cosine, ...}): every value a number."""
    out: dict[str, float] = {}
    for k, v in _object(tol).items():
        if not isinstance(v, (int, float)):
            raise ValueError(f"tolerance {k}: expected a number, got {v!r}")
        out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# correctness_preflight block


def spec_tolerances(spec: JsonObject) -> dict[str, dict[str, float]]:
    """The tolerances of the spec's path `PATH_ID`: the one path a loaded plan can name (the plan
    loader refuses any other id, kind or a second path)."""
    paths = _object(spec.get("correctness_preflight", spec)).get("paths")
    for p in paths if isinstance(paths, list) else []:
        if isinstance(p, dict) and p.get("id") == PATH_ID:
            tol = p.get("tolerances")
            if not isinstance(tol, dict) or not tol:
                raise ValueError(f"spec path {PATH_ID!r} has no tolerances")
            return {check: _limits(limits) for check, limits in tol.items()}
    raise ValueError(f"spec has no correctness_preflight path {PATH_ID!r} (implemented: {implemented_list()})")


def implementation_revision() -> str:
    return hashlib.sha256(_LOSSES_PY.read_bytes()).hexdigest()


def _utilization(errors: ErrorMeasures, tol: Mapping[str, float]) -> float:
    bound = float(tol["atol"]) + float(tol.get("rtol", 0.0)) * errors["reference_max_abs"]
    return errors["max_abs_error"] / bound if bound > 0 else math.inf


def _worst(entries: list[ErrorMeasures], tol: Mapping[str, float]) -> ErrorMeasures:
    failing = [e for e in entries if not errors_pass(e, tol)[0]]
    pool = failing or entries
    return max(
        pool,
        key=lambda e: (_utilization(e, tol), -(e["cosine_similarity"] if e["cosine_similarity"] is not None else -2.0)),
    )


def build_preflight_block(report: GoldenReport, spec: JsonObject | None = None) -> JsonObject:
    """The spec's ``correctness_preflight`` object: the golden report judged against the spec's
    tolerances (the built-in ones without a spec); errors are the worst case over every case and mode."""
    tol = spec_tolerances(spec) if spec is not None else DEFAULT_TOLERANCES
    collected: dict[str, list[ErrorMeasures]] = {k: [] for k in CHECK_NAMES}
    for res in report.results:
        for sub in res.subchecks:
            if sub.name == "grpo_golden":
                continue  # the informational GRPO-vs-verl line
            for key, err in sub.errors.items():
                collected[key].append(err)
    errors: JsonObject = {}
    for key in CHECK_NAMES:
        if collected[key]:
            errors[key] = as_object(_worst(collected[key], tol.get(key, DEFAULT_TOLERANCES[key])))
    modes = sorted({r.mode for r in report.results})
    flips = sum(1 for r in report.results for s in r.subchecks if "flips=" in s.detail)
    path: JsonObject = {
        "id": PATH_ID,
        "fixed_input": {
            "sha256": report.sha256,
            "description": (
                f"tests/fixtures/dppo_golden_v1.json (schema {GOLDEN_SCHEMA}, {len({r.case for r in report.results})} cases from "
                "the pinned Stable-RL functions in float64), each row packed as a tinker.Datum after 1-38 junk prompt "
                "positions (mask 0, junk logprobs/advantages) with the golden's stale sampler logprobs; packing seed 0. "
                "Stateless loss check: no weights or optimizer state involved."
            ),
        },
        "baseline_revision": BASELINE_REVISION,
        "reference_revision": REFERENCE_REVISION,
        "implementation_revision": implementation_revision(),
        "precision": (
            f"modes {modes}: float64 = exact float64 inputs through the packed tensors; float32 = tinker.Datum "
            "(float32 sampler logprobs) with float32 current logprobs as the SDK supplies; float64-datum = Datum "
            "with float64 current logprobs. Decisions and loss arithmetic in float64 inside the loss. Errors "
            f"are the worst case over all cases x modes; {flips} case/mode checks where float32 rounding of the "
            "inputs moves an exact-boundary token are compared with the independent padded implementation on "
            "the rounded inputs"
        ),
        "normalization": (
            "reference_*: DPPO token_mean = sum over loss tokens (mask==1, zero-advantage tokens included) / "
            "their count per forward_backward_custom call (Stable-RL token-mean); baseline_*: GRPO through the "
            "same path under BOTH sum over loss tokens (Tinker built-in ppo convention) and token_mean (the "
            "normalization trained), worst case of the two; prompt positions mask 0; no update or rank scaling"
        ),
        "errors": errors,
        "lr_scaling": [],
    }
    return {"required": True, "paths": [path]}


# ---------------------------------------------------------------------------------------------
# Validator: exit nonzero unless the status is passed or not_applicable


def validate_preflight(spec: JsonValue, preflight: JsonValue) -> tuple[str, list[str]]:
    """Return (status, messages); status in {'passed', 'failed', 'not_applicable'}."""
    spec_block = spec.get("correctness_preflight", spec) if isinstance(spec, dict) else None
    if not isinstance(spec_block, dict):
        return "failed", ["spec has no correctness_preflight object"]
    if not spec_block.get("required", False):
        return "not_applicable", ["spec does not require a correctness preflight"]
    block = preflight.get("correctness_preflight", preflight) if isinstance(preflight, dict) else None
    if not isinstance(block, dict):
        return "failed", ["preflight is not a JSON object"]
    msgs: list[str] = []
    if block.get("required") is not True:
        msgs.append("FAIL preflight.required must be true (spec requires it)")
    paths = block.get("paths")
    if not isinstance(paths, list):
        return "failed", msgs + ["FAIL preflight.paths must be a list"]
    by_id = {p.get("id"): p for p in paths if isinstance(p, dict)}
    spec_paths = spec_block.get("paths") or []
    if not isinstance(spec_paths, list):  # a malformed spec raises: never a pass
        raise ValueError(f"expected a JSON list, got {type(spec_paths).__name__}")
    for entry in spec_paths:
        sp = _object(entry)
        pid = sp.get("id")
        p = by_id.get(pid)
        if p is None:
            msgs.append(f"FAIL path {pid!r} missing from preflight")
            continue
        msgs += _validate_path(pid, sp, p)
    status = "failed" if any(m.startswith("FAIL") for m in msgs) else "passed"
    return status, msgs


def _validate_path(pid: JsonValue, sp: JsonObject, p: JsonObject) -> list[str]:
    """Messages for one spec path against its preflight entry `p`."""
    msgs: list[str] = []
    fi = p.get("fixed_input")
    sha, what = (fi.get("sha256"), fi.get("description")) if isinstance(fi, dict) else (None, None)
    hex64 = isinstance(sha, str) and len(sha) == 64 and all(ch in "0123456789abcdef" for ch in sha.lower())
    if not (hex64 and isinstance(what, str) and what.strip()):
        msgs.append(f"FAIL {pid}: fixed_input needs a 64-hex sha256 and a description")
    for key in ("baseline_revision", "reference_revision", "implementation_revision", "precision", "normalization"):
        v = p.get(key)
        if not isinstance(v, str) or not v.strip() or v.strip().upper().startswith("UNRESOLVED"):
            msgs.append(f"FAIL {pid}: {key} missing or unresolved ({v!r})")
    recorded = p.get("errors")
    errors = recorded if isinstance(recorded, dict) else {}
    if not isinstance(recorded, dict):
        msgs.append(f"FAIL {pid}: errors missing")
    tols = _object(sp.get("tolerances") or {})
    if not tols:
        msgs.append(f"FAIL {pid}: spec path has no tolerances")
    for check, tol in tols.items():
        if check != "lr_scaling":
            msgs.append(_check_errors(pid, check, errors.get(check), tol))
    lr = p.get("lr_scaling")
    if not isinstance(lr, list):
        msgs.append(f"FAIL {pid}: lr_scaling must be a list")
    else:
        msgs += _validate_lr_scaling(pid, lr, tols.get("lr_scaling"))
    return msgs


def _check_errors(pid: JsonValue, check: str, err: JsonValue, tol: JsonValue) -> str:
    """One `ok`/`FAIL` line: a check's recorded error measures against its spec tolerance."""
    if not isinstance(err, dict):
        return f"FAIL {pid}.{check}: missing"
    ok, why = errors_pass(err, _limits(tol))
    rel = err.get("relative_l2_error")
    if ok and rel is None and err.get("reference_max_abs", 0) != 0:
        ok, why = False, "relative_l2_error is null for a nonzero reference"
    if ok and rel is not None and not (isinstance(rel, (int, float)) and math.isfinite(rel)):
        ok, why = False, f"relative_l2_error must be a finite number or null, got {rel!r}"
    return f"{'ok  ' if ok else 'FAIL'} {pid}.{check}: {why}"


def _validate_lr_scaling(pid: JsonValue, lr: list[JsonValue], lr_tol: JsonValue) -> list[str]:
    """Messages for a path's `lr_scaling` list; an unmeasured entry is unverified, never a pass."""
    msgs: list[str] = []
    unavailable = [e for e in lr if isinstance(e, dict) and e.get("available") is False]
    for e in unavailable:  # recorded as unmeasured with its reason: unverified, never a pass
        reason = e.get("reason")
        if not (isinstance(reason, str) and reason.strip()) or e.get("update_norm") is not None:
            msgs.append(f"FAIL {pid}: an unavailable lr_scaling entry needs a reason and update_norm null")
    if unavailable and isinstance(lr_tol, dict):
        msgs.append(
            f"FAIL {pid}: lr_scaling unavailable ({unavailable[0].get('reason')}) but the spec sets a tolerance"
        )
    elif unavailable:
        msgs.append(
            f"note {pid}: lr_scaling unavailable: {unavailable[0].get('reason')} (unverified; the spec "
            "sets no LR-scaling tolerance for this path)"
        )
    lr = [e for e in lr if not (isinstance(e, dict) and e.get("available") is False)]
    keys = ("learning_rate", "update_norm")
    bad = [i for i, p in enumerate(lr) if not (isinstance(p, dict) and all(_positive_finite(p.get(k)) for k in keys))]
    msgs += [f"FAIL {pid}: lr_scaling[{i}] needs positive finite learning_rate and update_norm" for i in bad]
    if isinstance(lr_tol, dict) and not unavailable and not bad:
        msgs += _check_lr_scaling(pid, lr, lr_tol)
    elif not lr and not unavailable:
        msgs.append(f"note {pid}: lr_scaling empty (the spec sets no LR-scaling tolerance for this path)")
    return msgs


def _positive_finite(v: JsonValue) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def lr_scaling_error(probes: Sequence[Mapping[str, float]]) -> list[float]:
    """Relative change of update_norm/learning_rate against the first probe, for every probe
    (the first is 0.0); a zero or non-finite first ratio makes every entry inf. The one
    definition: the restoration preflight's LR probe and the correctness CLI both use it."""
    if not probes:
        return []
    base = probes[0]["update_norm"] / probes[0]["learning_rate"]
    if not math.isfinite(base) or base == 0.0:
        return [math.inf for _ in probes]
    return [abs((p["update_norm"] / p["learning_rate"]) / base - 1.0) for p in probes]


def _check_lr_scaling(pid: JsonValue, lr: list[JsonValue], tol: JsonObject) -> list[str]:
    limit = tol.get("max_relative_error", tol.get("rtol"))
    if len(lr) < 2:
        return [f"FAIL {pid}.lr_scaling: the spec sets a tolerance but fewer than 2 probes were recorded"]
    if not isinstance(limit, (int, float)):
        return [f"FAIL {pid}.lr_scaling: spec tolerance needs max_relative_error, got {tol!r}"]
    worst = max(lr_scaling_error(lr))  # type: ignore[arg-type]  # every probe checked positive finite
    ok = worst <= limit
    return [f"{'ok  ' if ok else 'FAIL'} {pid}.lr_scaling: max relative error {worst:.3g} (limit {limit})"]


# ---------------------------------------------------------------------------------------------
# CLI


def _load_json(path: str, what: str) -> JsonValue:
    try:
        value: JsonValue = json.loads(Path(path).read_text())
        return value
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: cannot read {what} {path}: {exc}") from None


def run_validator_cli(spec_bytes: bytes, preflight_block: JsonObject, timeout_s: float = 120.0) -> JsonObject:
    """Run `python -m dppo_harness.loss.correctness validate` on the WRITTEN preflight block (the
    validator judges the file as written, not the object in memory), and return its exit code and output."""
    with tempfile.TemporaryDirectory() as d:
        spec_f, pre_f = Path(d) / "spec.json", Path(d) / "correctness-preflight.json"
        spec_f.write_bytes(spec_bytes)
        pre_f.write_text(json.dumps(preflight_block, indent=1))
        cmd = [sys.executable, "-m", "dppo_harness.loss.correctness", "validate", str(spec_f), str(pre_f)]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=without_credentials(os.environ)
        )  # it reads two files: no credential
    return {
        "kind": "correctness_validator",
        "command": "python -m dppo_harness.loss.correctness validate <spec> <preflight>",
        "spec_sha256": hashlib.sha256(spec_bytes).hexdigest(),
        "preflight_sha256": hashlib.sha256(json.dumps(preflight_block, indent=1).encode()).hexdigest(),
        "exit_code": proc.returncode,
        "stdout": proc.stdout[-20000:],
        "stderr": proc.stderr[-4000:],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dppo_harness.loss.correctness")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cg = sub.add_parser("check-golden", help="run every golden case through the packed loss path")
    cg.add_argument("file")
    cg.add_argument("--json", dest="json_out")
    cg.add_argument("--spec", help="take tolerances from this spec (default: the spec's values built in)")
    cg.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    cg.add_argument("--preflight-out", help="also write the correctness_preflight block here")
    va = sub.add_parser("validate", help="exit nonzero unless the preflight block passes the spec's tolerances")
    va.add_argument("spec")
    va.add_argument("preflight")
    args = parser.parse_args(argv)

    if args.cmd == "check-golden":
        # The packed path (torch, the SDK) loads for this command only: `validate` stays numpy-only.
        from dppo_harness.loss.correctness_golden import check_golden

        spec = _object(_load_json(args.spec, "spec")) if args.spec else None
        tol = spec_tolerances(spec) if spec is not None else None
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad:
            print(f"error: unknown modes {bad}; expected {MODES}", file=sys.stderr)
            return 2
        try:
            report = check_golden(Path(args.file), modes, tol, torch_threads=1)
        except GoldenError as exc:
            print(f"error: {exc}", file=sys.stderr)
            print("0 passed, 1 failed")
            return 1
        for r in report.results:
            print(r.line())
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report.to_json(), indent=1))
        if args.preflight_out:
            Path(args.preflight_out).write_text(json.dumps(build_preflight_block(report, spec), indent=1))
        print(f"{report.n_passed} passed, {report.n_failed} failed")
        return 0 if report.n_failed == 0 else 1

    status, msgs = validate_preflight(_load_json(args.spec, "spec"), _load_json(args.preflight, "preflight"))
    for m in msgs:
        print(m)
    print(status)
    return 0 if status in ("passed", "not_applicable") else 1


if __name__ == "__main__":
    sys.exit(main())

"""The golden file (``dppo_golden_v1``: padded inputs and the pinned reference functions' outputs):
its reader, the parity measures and records checked against it (numpy only: the parity run,
``correctness_golden``, and the block and its validator, ``correctness``, both read them), and its
regeneration from the numpy references at the registered losses' parameters (docs/losses.md):

    python -m dppo_harness.loss.golden [--check] [FILE]

A stored value the reference reproduces within the registry's parity tolerance (float64
summation order) is kept, any other replaced; `--check` exits 1, naming the differing cases, when
FILE is not the generator's fixed point.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

import numpy as np
import numpy.typing as npt

from dppo_harness.json_types import JsonObject, JsonValue, as_object
from dppo_harness.loss.loss_registry import DPPO_LOSS, LOSSES, LossEntry, get_loss
from dppo_harness.project import project_root

GOLDEN_SCHEMA = "dppo_golden_v1"
MODES = ("float64", "float32", "float64-datum")  # the packed path's modes (`correctness_golden`)


class GoldenError(ValueError):
    """The golden file is malformed; the message names the field."""


CHECK_NAMES = ("baseline_loss", "baseline_gradient", "reference_loss", "reference_gradient")


# The spec's tolerances (plans/exp_e6b0965af3.json, correctness_preflight.paths[0].tolerances);
# used only when check-golden runs without --spec.
DEFAULT_TOLERANCES: dict[str, dict[str, float]] = {
    "baseline_loss": {"atol": 1e-5, "rtol": 1e-4},
    "baseline_gradient": {"atol": 1e-5, "rtol": 1e-3, "min_cosine": 0.9999},
    "reference_loss": {"atol": 1e-5, "rtol": 1e-4},
    "reference_gradient": {"atol": 1e-5, "rtol": 1e-3, "min_cosine": 0.9999},
}


Tolerances = Mapping[str, Mapping[str, float]]  # check name -> {atol, rtol, min_cosine}


class ErrorMeasures(TypedDict):
    """One comparison's error measures (a check of the `correctness_preflight` block's `errors`)."""

    max_abs_error: float
    reference_max_abs: float
    relative_l2_error: float | None  # None for a zero reference
    cosine_similarity: float | None  # None for a zero vector


def parity_errors(actual: npt.ArrayLike, reference: npt.ArrayLike) -> ErrorMeasures:
    """max_abs_error, reference_max_abs, relative_l2_error (None for zero reference), cosine (None for a zero vector)."""
    a = np.asarray(actual, dtype=np.float64).ravel()
    r = np.asarray(reference, dtype=np.float64).ravel()
    if a.shape != r.shape:
        raise ValueError(f"parity_errors: shapes differ {a.shape} vs {r.shape}")
    diff = a - r
    ref_norm = float(np.linalg.norm(r))
    act_norm = float(np.linalg.norm(a))
    return {
        "max_abs_error": float(np.max(np.abs(diff))) if diff.size else 0.0,
        "reference_max_abs": float(np.max(np.abs(r))) if r.size else 0.0,
        "relative_l2_error": float(np.linalg.norm(diff)) / ref_norm if ref_norm > 0 else None,
        "cosine_similarity": float(np.dot(a, r)) / (act_norm * ref_norm) if act_norm > 0 and ref_norm > 0 else None,
    }


def errors_pass(errors: Mapping[str, object], tol: Mapping[str, float]) -> tuple[bool, str]:
    """The acceptance rule: max_abs_error <= atol + rtol * reference_max_abs (both finite and
    non-negative) and, where `tol` sets min_cosine, cosine_similarity >= it (missing only for an
    exact zero on both sides); returns (passed, reason). `errors` may be a recorded block's JSON."""
    measures: list[float] = []
    for key in ("max_abs_error", "reference_max_abs"):
        v = errors.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            return False, f"{key} must be a finite non-negative number, got {v!r}"
        measures.append(v)
    max_abs, ref_max_abs = measures
    bound = float(tol["atol"]) + float(tol.get("rtol", 0.0)) * ref_max_abs
    if not max_abs <= bound:
        return False, f"max_abs_error {max_abs:.3g} > atol+rtol*ref {bound:.3g}"
    if "min_cosine" in tol:
        cos = errors.get("cosine_similarity")
        exact_zero = max_abs == 0 and ref_max_abs == 0
        if cos is None and not exact_zero:
            return False, "cosine_similarity missing (zero vector) but min_cosine is required"
        if cos is not None and (not isinstance(cos, (int, float)) or not cos >= float(tol["min_cosine"])):
            return False, f"cosine {cos!r} < min_cosine {tol['min_cosine']}"
    return True, "ok"


@dataclass
class SubCheck:
    name: str
    passed: bool
    detail: str
    errors: dict[str, ErrorMeasures] = field(default_factory=dict)  # check name -> error measures


@dataclass
class CaseResult:
    case: str
    mode: str
    subchecks: list[SubCheck]

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.subchecks)

    def line(self) -> str:
        parts = [f"{s.name}:{'ok' if s.passed else 'FAIL'}({s.detail})" for s in self.subchecks]
        return f"{'PASS' if self.passed else 'FAIL'} {self.case} [{self.mode}] " + " ".join(parts)

    def to_json(self) -> JsonObject:
        subchecks = [as_object(asdict(s)) for s in self.subchecks]  # ErrorMeasures as written
        return {"case": self.case, "mode": self.mode, "passed": self.passed, "subchecks": [*subchecks]}


@dataclass
class GoldenReport:
    path: str
    sha256: str
    results: list[CaseResult]

    @property
    def n_passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def n_failed(self) -> int:
        return len(self.results) - self.n_passed

    def to_json(self) -> JsonObject:
        results: list[JsonValue] = [r.to_json() for r in self.results]
        return {
            "golden_path": self.path,
            "golden_sha256": self.sha256,
            "passed": self.n_passed,
            "failed": self.n_failed,
            "results": results,
        }


# ---------------------------------------------------------------------------------------------
# The golden file's reader


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def case_value(case: JsonObject, path: str | tuple[str, ...], shape: tuple[int, int] | None = None) -> np.ndarray:
    """A case's field (`a.b` or `("a", "b")`: nested; the tuple for a key that holds a dot, such as a
    loss name) as a float64 array of `shape`, or a finite number without one."""
    keys = tuple(path.split(".")) if isinstance(path, str) else path
    where = f"case {case.get('name', '?')!r}: {'.'.join(keys)}"
    obj: JsonValue = case
    for k in keys:
        obj = obj.get(k) if isinstance(obj, dict) else None
    if obj is None:
        raise GoldenError(f"{where} missing")
    try:
        arr = np.asarray(obj, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise GoldenError(f"{where} is not numeric: {exc}") from None
    if shape is None and (isinstance(obj, bool) or arr.shape != () or not np.isfinite(arr)):
        raise GoldenError(f"{where} must be a finite number, got {obj!r}")
    if shape is not None and arr.shape != shape:
        raise GoldenError(f"{where} has shape {arr.shape}, expected {shape}")
    return arr


@dataclass(frozen=True)
class GoldenCase:
    name: str
    lp_BT: np.ndarray
    mu_BT: np.ndarray
    adv_BT: np.ndarray
    mask_BT: np.ndarray
    dppo_mask_BT: np.ndarray
    dppo_loss: float
    dppo_grad_BT: np.ndarray
    grpo_loss: float | None
    grpo_grad_BT: np.ndarray | None
    grpo_clipfrac: float | None
    dppo_removed: int | None  # n_invalid_tr_tokens, when recorded


def case_inputs(c: JsonValue, where: str = "case") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A case's (lp, mu, adv, mask) as float64 [B, T] arrays, validated (`where`: its place in the
    file, for the error line)."""
    if not isinstance(c, dict):
        raise GoldenError(f"{where} is not an object")
    shape = c.get("shape")
    dims = [n for n in shape if isinstance(n, int) and n >= 0] if isinstance(shape, list) else []
    if not (isinstance(shape, list) and len(dims) == len(shape) == 2):
        raise GoldenError(f"{where}.shape must be [B, T], got {shape!r}")
    shp = (dims[0], dims[1])
    mask = case_value(c, "response_mask", shp)
    if not np.isin(mask, (0.0, 1.0)).all():
        raise GoldenError(f"case {c.get('name')!r}: response_mask must be 0/1")
    lp, mu, adv = (case_value(c, k, shp) for k in ("log_prob", "rollout_log_prob", "advantages"))
    return lp, mu, adv, mask


def _case(c: JsonValue, where: str) -> GoldenCase:
    lp, mu, adv, mask = case_inputs(c, where)
    assert isinstance(c, dict)  # case_inputs refuses anything else
    shp = (mask.shape[0], mask.shape[1])
    grpo, dppo = c.get("grpo_no_dual_clip"), c.get("dppo")
    has_grpo = isinstance(grpo, dict)
    metrics = dppo.get("metrics") if isinstance(dppo, dict) else None
    removed = metrics.get("n_invalid_tr_tokens") if isinstance(metrics, dict) else None
    return GoldenCase(
        name=str(c.get("name")),
        lp_BT=lp,
        mu_BT=mu,
        adv_BT=adv,
        mask_BT=mask,
        dppo_mask_BT=case_value(c, "dppo.mask", shp),
        dppo_loss=float(case_value(c, "dppo.loss")),
        dppo_grad_BT=case_value(c, "dppo.grad_log_prob", shp),
        grpo_loss=float(case_value(c, "grpo_no_dual_clip.loss")) if has_grpo else None,
        grpo_grad_BT=case_value(c, "grpo_no_dual_clip.grad_log_prob", shp) if has_grpo else None,
        grpo_clipfrac=float(case_value(c, "grpo_no_dual_clip.clipfrac"))
        if isinstance(grpo, dict) and "clipfrac" in grpo
        else None,
        dppo_removed=int(removed) if isinstance(removed, (int, float)) and not isinstance(removed, bool) else None,
    )


def load_golden(path: Path) -> tuple[dict, list[GoldenCase]]:
    """Read and validate a ``dppo_golden_v1`` file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GoldenError(f"cannot read golden file {path}: {exc}") from exc
    schema = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
    if schema != GOLDEN_SCHEMA:
        raise GoldenError(f"{path}: schema must be {GOLDEN_SCHEMA!r}, got {schema!r}")
    cases = raw.get("cases")
    if not isinstance(cases, list) or not cases:
        raise GoldenError(f"{path}: 'cases' must be a non-empty list")
    return raw, [_case(c, f"{path}: cases[{i}]") for i, c in enumerate(cases)]


# ---------------------------------------------------------------------------------------------
# Regeneration from the references


# float64 on both sides: only summation order differs (also the registry parity's tolerance).
REGISTRY_TOLERANCE = {"atol": 1e-12, "rtol": 1e-9}
_VERL_EPS = 1e-8  # verl's masked_mean adds it to the token count: its clipfrac is n_clipped / (n + 1e-8)
# Where `params.dppo` writes the registered DPPO loss's parameters.
_DPPO_PARAMS = {
    "clip_ratio": "dppo_delta",
    "clip_ratio_low (delta_low)": "dppo_delta",
    "clip_ratio_high (delta_high)": "dppo_delta",
    "clip_ratio_c (C, ratio cap)": "ratio_cap",
}


def _kept(stored: JsonValue, fresh: np.ndarray | float) -> JsonValue:
    """The stored value where the reference reproduces it, else the reference's."""
    want = np.asarray(fresh, dtype=np.float64)
    try:
        got = np.asarray(stored, dtype=np.float64)
    except (TypeError, ValueError):
        got = None
    if (
        got is not None
        and got.shape == want.shape
        and np.allclose(got, want, REGISTRY_TOLERANCE["rtol"], REGISTRY_TOLERANCE["atol"])
    ):
        return stored
    value: JsonValue = want.tolist()
    return value


BOUNDARY_CASE = "boundary_exact"
_READ_KEYS = ("name", "description", "shape", "log_prob", "rollout_log_prob", "advantages", "response_mask")
_NEAR = 1e-12  # "just beyond" / "just inside" delta: within this of it


def _diff(lp: np.ndarray, mu: np.ndarray) -> list[np.ndarray]:
    """p - q as numpy and as torch compute it in float64 (the reference and the packed path)."""
    import torch  # only when boundary rows are checked: the registry and plan loading stay torch-free

    t = torch.from_numpy(np.asarray(lp, dtype=np.float64)).exp() - torch.from_numpy(np.asarray(mu)).exp()
    return [np.exp(lp) - np.exp(mu), t.numpy()]


def _at_delta(lp_row: np.ndarray, mu_row: np.ndarray, delta: float) -> bool:
    """Whether a boundary row's p - q are +delta, just above, just below, -delta, just below, just above."""
    for d in _diff(lp_row, mu_row):
        if not (d[0] == delta and d[3] == -delta):
            return False
        beyond = (d[1] - delta, -delta - d[4])
        inside = (delta - d[2], d[5] + delta)
        if not all(0 < x <= _NEAR for x in beyond + inside):
            return False
    return True


def _pair(q: float, target: float, side: int) -> tuple[float, float]:
    """(lp, mu) whose p - q, numpy's and torch's alike, is `target` exactly (side 0) or within _NEAR
    above (side 1) or below (side -1) it, never on it; mu walks float64 steps down from log(q)."""
    mu = float(np.log(q))
    for _ in range(500):
        lp0 = float(np.log(np.exp(mu) + target))
        for k in range(-8, 9):
            lp = float(lp0 + k * np.spacing(lp0))
            off = [float(x[0]) - target for x in _diff(np.asarray([lp]), np.asarray([mu]))]
            if all(x == 0 if side == 0 else 0 < x * side <= _NEAR for x in off):
                return lp, mu
        mu = float(np.nextafter(mu, -np.inf))
    raise ValueError(f"no float64 pair gives p - q at {target!r} (side {side})")


def boundary_rows(delta: float) -> tuple[list[float], list[float]]:
    """(log_prob, rollout_log_prob) of a boundary row at `delta` (0 < delta < 0.75): p - q at +delta,
    just above, just below, at -delta, just below, just above."""
    if not 0 < delta < 0.75:
        raise ValueError(f"boundary rows need 0 < delta < 0.75, got {delta!r}")
    pairs = [_pair(0.2 + i / 100, delta, side) for i, side in enumerate((0, 1, -1))]
    pairs += [_pair(delta + 0.2 + i / 100, -delta, side) for i, side in enumerate((0, -1, 1))]
    return [lp for lp, _ in pairs], [mu for _, mu in pairs]


def _boundary_case(case: JsonObject, delta: float) -> JsonObject:
    """The boundary case with its first two rows at `delta` (kept when they already are)."""
    lp, mu = (np.asarray(case[k], dtype=np.float64) for k in ("log_prob", "rollout_log_prob"))
    if all(_at_delta(lp[r], mu[r], delta) for r in (0, 1)):
        return case
    lp_row, mu_row = boundary_rows(delta)
    lp[:2], mu[:2] = lp_row, mu_row
    out: JsonObject = {k: case[k] for k in _READ_KEYS if k in case}
    out.update(log_prob=lp.tolist(), rollout_log_prob=mu.tolist())
    out["description"] = (
        f"Rows 0 (A=+1) and 1 (A=-1): p - q == +{delta:g}, just above, just below, == -{delta:g}, just below, "
        f"just above (exact in float64; strict rule: ==+-delta is kept). Row 2 probes the GRPO ratio boundaries. "
        "Generated by dppo_harness.loss.golden at this delta."
    )
    out["dppo"] = {
        "mask": [],
        "prob_minus_rollout_prob": (np.exp(lp) - np.exp(mu)).tolist(),
        "metrics": {"n_invalid_tr_tokens": 0, "actor/pg_clipfrac": 0.0},
    }
    out["grpo_no_dual_clip"] = {"clipfrac": 0.0}
    return out


def _case_entry(case: JsonObject, entry: LossEntry) -> JsonObject:
    """The case's values for one registered loss, regenerated from its reference."""
    lp, mu, adv, mask = case_inputs(case)
    golden = entry.golden
    ref = entry.reference(lp, mu, adv, mask, golden.normalization, **entry.params, **golden.reference_params)
    old = case.get(golden.key)
    out: JsonObject = copy.deepcopy(old) if isinstance(old, dict) else {}
    out["loss"] = _kept(out.get("loss"), ref.loss)
    out["grad_log_prob"] = _kept(out.get("grad_log_prob"), ref.grad_BT)
    on = mask > 0
    if "mask" in out:  # the DPPO keep mask and the tokens it removes
        out["mask"] = _kept(out["mask"], ref.decision_BT.astype(np.float64))
        metrics = out.get("metrics")
        removed = on & (adv != 0) & ~ref.decision_BT.astype(bool)
        if isinstance(metrics, dict) and "n_invalid_tr_tokens" in metrics:
            metrics["n_invalid_tr_tokens"] = int(removed.sum())
        if isinstance(metrics, dict) and "actor/pg_clipfrac" in metrics:  # over nonzero-advantage tokens
            frac = float(removed.sum() / ((on & (adv != 0)).sum() + _VERL_EPS))
            metrics["actor/pg_clipfrac"] = _kept(metrics["actor/pg_clipfrac"], frac)
    if "clipfrac" in out:  # the clipped fraction, as verl's masked mean counts it
        out["clipfrac"] = _kept(out["clipfrac"], float(ref.decision_BT.sum() / (on.sum() + _VERL_EPS)))
    return out


def regenerate(doc: JsonObject, file: str) -> JsonObject:
    """`doc` (a golden file's JSON, stored at `file` relative to the project root) regenerated."""
    out = copy.deepcopy(doc)
    entries = [e for e in LOSSES.values() if e.golden.file == file]
    if not entries:
        raise ValueError(f"no registered loss keeps its golden cases in {file}")
    cases = out.get("cases")
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"{file}: no cases")
    delta = get_loss(DPPO_LOSS).params["dppo_delta"]
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            raise ValueError(f"{file}: a case is not an object")
        if case.get("name") == BOUNDARY_CASE:
            cases[i] = case = _boundary_case(case, delta)
        for entry in entries:
            case[entry.golden.key] = _case_entry(case, entry)
    params = out.get("params")
    dppo = params.get("dppo") if isinstance(params, dict) else None
    if isinstance(dppo, dict) and get_loss(DPPO_LOSS).golden.file == file:
        for key, param in _DPPO_PARAMS.items():
            if key in dppo:
                dppo[key] = get_loss(DPPO_LOSS).params[param]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dppo_harness.loss.golden", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", default=get_loss(DPPO_LOSS).golden.file, help="relative to the project root")
    parser.add_argument("--check", action="store_true", help="exit 1 unless FILE is the generator's fixed point")
    args = parser.parse_args(argv)
    path = project_root() / args.file
    text = path.read_text()
    fresh = json.dumps(regenerate(json.loads(text), args.file), indent=1)  # the golden file's layout
    if not args.check:
        if fresh != text:
            path.write_text(fresh)
        print(f"golden: {args.file} {'rewritten' if fresh != text else 'unchanged'}")
        return 0
    if fresh == text:
        print(f"golden: {args.file} is the references' fixed point")
        return 0
    old, new = json.loads(text)["cases"], json.loads(fresh)["cases"]
    differing = [o.get("name", "?") for o, n in zip(old, new) if o != n]
    print(f"golden: {args.file} differs from what the references give (cases {differing or 'none'}; params or layout)")
    return 1


if __name__ == "__main__":
    sys.exit(main())

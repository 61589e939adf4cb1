"""Golden parity's records, numpy only: the golden file's schema and the packed path's modes, the
error measures and their acceptance rule (max |error| <= atol + rtol x max |reference|, and cosine
>= min_cosine where the tolerance sets one), and a parity run's results. The parity run
(``correctness_golden``: torch, the SDK) and the block and its validator (``correctness``) both
read them; neither imports the other at module level.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TypedDict

import numpy as np
import numpy.typing as npt
from pydantic import JsonValue

from dppo_harness.json_types import JsonObject, as_object

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

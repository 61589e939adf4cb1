"""Fingerprints of what a training client was given and what it returned. Hashes are
length-prefixed, so different splits of the same bytes never collide; a shape mismatch never
passes a comparison."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NotRequired, TypedDict

import numpy as np
import tinker

from dppo_harness.train.clients import datum_arrays

LOGPROB_ATOL = 1e-6  # initial outputs must be bitwise equal or within 1e-6


class LogprobComparison(TypedDict):
    """`compare_logprobs`'s verdict, key for key as the evidence records it; `problem` only when
    the logprobs cannot be compared (count, shape, non-finite)."""

    bitwise_equal: bool
    max_abs_diff: float | None
    within_tolerance: bool
    atol: float
    problem: NotRequired[str]


def _update_array(h: hashlib._Hash, tag: bytes, arr: np.ndarray) -> None:
    # Length-prefixed, little-endian: concatenations of different splits cannot collide.
    data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    h.update(tag + len(arr).to_bytes(8, "little") + data)


def batch_sha256(batch: Sequence[tinker.Datum]) -> str:
    """sha256 over every datum's input token ids (int64), target ids (int64) and mask (float32)."""
    h = hashlib.sha256(b"dppo-harness/fixed-batch/v1")
    h.update(len(batch).to_bytes(8, "little"))
    for datum in batch:
        tokens_T, targets_T, mask_T = datum_arrays(datum)
        _update_array(h, b"T", tokens_T)
        _update_array(h, b"Y", targets_T)
        _update_array(h, b"M", mask_T)
    return h.hexdigest()


def logprobs_sha256(logprobs: Sequence[np.ndarray]) -> str:
    """sha256 over all per-token logprobs at the precision the server returned (no rounding)."""
    h = hashlib.sha256(b"dppo-harness/logprobs/v1")
    h.update(len(logprobs).to_bytes(8, "little"))
    for lp in logprobs:
        arr = np.asarray(lp)
        h.update(str(arr.dtype).encode() + b"|")
        _update_array(h, b"L", arr.reshape(-1))
    return h.hexdigest()


def compare_logprobs(a: Sequence[np.ndarray], b: Sequence[np.ndarray], atol: float = LOGPROB_ATOL) -> LogprobComparison:
    """Bitwise equality, max |a-b| and whether it is within `atol`. Shape mismatch never passes."""

    def refused(problem: str) -> LogprobComparison:
        return {
            "bitwise_equal": False,
            "max_abs_diff": None,
            "within_tolerance": False,
            "atol": atol,
            "problem": problem,
        }

    if len(a) != len(b):
        return refused(f"datum count differs: {len(a)} vs {len(b)}")
    max_abs = 0.0
    bitwise = True
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return refused(f"datum {i} shape differs: {x.shape} vs {y.shape}")
        bitwise = bitwise and x.dtype == y.dtype and x.tobytes() == y.tobytes()
        if x.size:
            d = np.abs(x.astype(np.float64) - y.astype(np.float64))
            if not np.all(np.isfinite(d)):
                return refused(f"datum {i} has non-finite logprobs")
            max_abs = max(max_abs, float(d.max()))
    return {
        "bitwise_equal": bool(bitwise),
        "max_abs_diff": max_abs,
        "within_tolerance": bool(bitwise or max_abs <= atol),
        "atol": atol,
    }

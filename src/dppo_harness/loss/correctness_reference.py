"""The golden cases in the padded [B, T] layout, and their packing into the layout under test.

Reads and validates a ``dppo_golden_v1`` file (rows of the pinned Stable-RL functions' inputs and
outputs, padded with a response mask) and lays each case out after junk prompt positions;
``correctness_packed`` runs the packed loss path on that layout and scatters its outputs back, so
the parity checks (``correctness_golden``) compare like with like. The independent padded
implementations themselves are ``references``. numpy only.

Modes of the packed path (``MODES``):
- ``float64``: the packed layout (prompt junk + responses, varied lengths) as flat float64 tensors
  through ``losses.packed_loss_call`` (tinker.Datum can only store float32, so this is the
  one mode that sees the golden inputs bit-exactly).
- ``float32``: real ``tinker.Datum`` packing + ``losses.make_loss_fn`` with float32 current logprob
  tensors (what the SDK hands a custom loss).
- ``float64-datum``: real Datums with float64 current logprob tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import JsonValue

from dppo_harness.json_types import JsonObject

GOLDEN_SCHEMA = "dppo_golden_v1"
MODES = ("float64", "float32", "float64-datum")
_REQUIRED_CASE_KEYS = ("name", "shape", "log_prob", "rollout_log_prob", "advantages", "response_mask", "dppo")


class GoldenError(ValueError):
    """The golden file is malformed; the message names the field."""


# ---------------------------------------------------------------------------------------------
# Golden file


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _array(case: JsonObject, keys: Sequence[str], shape: tuple[int, int]) -> np.ndarray:
    obj: JsonValue = case
    for k in keys:
        if not isinstance(obj, dict) or k not in obj:
            raise GoldenError(f"case {case.get('name', '?')!r}: missing {'.'.join(keys)}")
        obj = obj[k]
    try:
        arr = np.asarray(obj, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise GoldenError(f"case {case.get('name', '?')!r}: {'.'.join(keys)} is not numeric: {exc}") from exc
    if arr.shape != shape:
        raise GoldenError(f"case {case.get('name', '?')!r}: {'.'.join(keys)} has shape {arr.shape}, expected {shape}")
    return arr


def _scalar(case: JsonObject, keys: Sequence[str]) -> float:
    obj: JsonValue = case
    for k in keys:
        if not isinstance(obj, dict) or k not in obj:
            raise GoldenError(f"case {case.get('name', '?')!r}: missing {'.'.join(keys)}")
        obj = obj[k]
    if not isinstance(obj, (int, float)) or isinstance(obj, bool) or not math.isfinite(obj):
        raise GoldenError(f"case {case.get('name', '?')!r}: {'.'.join(keys)} must be a finite number, got {obj!r}")
    return float(obj)


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


def load_golden(path: Path) -> tuple[dict, list[GoldenCase]]:
    """Read and validate a ``dppo_golden_v1`` file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GoldenError(f"cannot read golden file {path}: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("schema") != GOLDEN_SCHEMA:
        raise GoldenError(
            f"{path}: schema must be {GOLDEN_SCHEMA!r}, got {raw.get('schema') if isinstance(raw, dict) else type(raw).__name__!r}"
        )
    cases_raw = raw.get("cases")
    if not isinstance(cases_raw, list) or not cases_raw:
        raise GoldenError(f"{path}: 'cases' must be a non-empty list")
    cases = []
    for i, c in enumerate(cases_raw):
        if not isinstance(c, dict):
            raise GoldenError(f"{path}: cases[{i}] is not an object")
        missing = [k for k in _REQUIRED_CASE_KEYS if k not in c]
        if missing:
            raise GoldenError(f"{path}: cases[{i}] ({c.get('name', '?')!r}) lacks {missing}")
        shape = c["shape"]
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise GoldenError(f"{path}: cases[{i}].shape must be [B, T], got {shape!r}")
        shp = (shape[0], shape[1])
        mask = _array(c, ["response_mask"], shp)
        if not np.isin(mask, (0.0, 1.0)).all():
            raise GoldenError(f"case {c['name']!r}: response_mask must be 0/1")
        grpo = c.get("grpo_no_dual_clip")
        removed = c["dppo"].get("metrics", {}).get("n_invalid_tr_tokens")
        cases.append(
            GoldenCase(
                name=str(c["name"]),
                lp_BT=_array(c, ["log_prob"], shp),
                mu_BT=_array(c, ["rollout_log_prob"], shp),
                adv_BT=_array(c, ["advantages"], shp),
                mask_BT=mask,
                dppo_mask_BT=_array(c, ["dppo", "mask"], shp),
                dppo_loss=_scalar(c, ["dppo", "loss"]),
                dppo_grad_BT=_array(c, ["dppo", "grad_log_prob"], shp),
                grpo_loss=_scalar(c, ["grpo_no_dual_clip", "loss"]) if grpo is not None else None,
                grpo_grad_BT=_array(c, ["grpo_no_dual_clip", "grad_log_prob"], shp) if grpo is not None else None,
                grpo_clipfrac=_scalar(c, ["grpo_no_dual_clip", "clipfrac"])
                if grpo is not None and "clipfrac" in grpo
                else None,
                dppo_removed=int(removed)
                if isinstance(removed, (int, float)) and not isinstance(removed, bool)
                else None,
            )
        )
    return raw, cases


# ---------------------------------------------------------------------------------------------
# Packing golden rows into real tinker.Datums (prompt junk, varied prompt lengths, stale sampler logprobs)


@dataclass
class PackedCase:
    """One golden case laid out as datums: row b -> prompt (mask 0, junk) + its response span."""

    prompt_lens: list[int]  # P_b: prompt tokens; loss positions 0..P_b-2 are prompt targets
    response_lens: list[int]  # R_b: golden columns carried (up to the last mask-1 column)
    lp_T: list[np.ndarray]  # float64 current logprobs per datum (junk on prompt positions)
    mu_T: list[np.ndarray]  # float64 sampler logprobs (junk on prompt positions)
    adv_T: list[np.ndarray]
    mask_T: list[np.ndarray]
    tokens: list[list[int]]


def pack_case(case: GoldenCase, seed: int = 0) -> PackedCase:
    rng = np.random.default_rng(seed)
    B, _T = case.mask_BT.shape
    packed = PackedCase([], [], [], [], [], [], [])
    for b in range(B):
        on = np.nonzero(case.mask_BT[b] > 0)[0]
        r_len = int(on[-1]) + 1 if on.size else 0
        p_len = int(rng.integers(2, 40))
        n_prompt_targets = p_len - 1
        # Junk that would dominate every term if the mask leaked: huge ratios, nonzero advantages.
        junk_lp = rng.uniform(-60.0, 0.0, n_prompt_targets)
        junk_mu = rng.choice([0.0, -80.0, 3.0, -1e4], n_prompt_targets)
        junk_adv = rng.normal(0.0, 5.0, n_prompt_targets) + 1.0
        packed.prompt_lens.append(p_len)
        packed.response_lens.append(r_len)
        packed.lp_T.append(np.concatenate([junk_lp, case.lp_BT[b, :r_len]]))
        packed.mu_T.append(np.concatenate([junk_mu, case.mu_BT[b, :r_len]]))
        packed.adv_T.append(np.concatenate([junk_adv, case.adv_BT[b, :r_len]]))
        packed.mask_T.append(np.concatenate([np.zeros(n_prompt_targets), case.mask_BT[b, :r_len]]))
        packed.tokens.append([int(t) for t in rng.integers(0, 151_000, p_len + r_len)])
    return packed

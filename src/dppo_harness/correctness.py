"""Correctness preflight: an independent padded [B, T] implementation, golden parity, and CLI.

The reference rules here are written again from ``/work/shared/reference/dppo-binary-tv.md`` in
numpy float64 with closed-form gradients (no autograd), on the reference's padded layout with a
response mask. They share nothing with ``losses.py`` beyond ``constants.py``; ``losses`` is only
imported to run the packed path under test.

Modes of the packed path checked per golden case:
- ``float64``: the packed layout (prompt junk + responses, varied lengths) as flat float64 tensors
  through ``losses.packed_loss_and_metrics`` (tinker.Datum can only store float32, so this is the
  one mode that sees the golden inputs bit-exactly).
- ``float32``: real ``tinker.Datum`` packing + ``losses.make_loss_fn`` with float32 current logprob
  tensors (what the SDK hands a custom loss).
- ``float64-datum``: real Datums with float64 current logprob tensors.
In Datum modes the sampler logprobs are float32-rounded; if that rounding moves a token across a
decision boundary (only the exact-boundary cases do), the expectation is the independent padded
implementation evaluated on the rounded inputs, and the line says so (``flips=k``).

CLI::

    python -m dppo_harness.correctness check-golden FILE [--json OUT] [--spec SPEC]
    python -m dppo_harness.correctness validate SPEC PREFLIGHT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dppo_harness.constants import BASELINE_REVISION, LOG_RATIO_CLAMP_MAX, REFERENCE_REVISION
from dppo_harness.references import ref_dppo, ref_ppo, token_count

GOLDEN_SCHEMA = "dppo_golden_v1"
PATH_ID = "grpo_dppo_custom_loss"
MODES = ("float64", "float32", "float64-datum")
CHECK_NAMES = ("baseline_loss", "baseline_gradient", "reference_loss", "reference_gradient")
# The spec's tolerances (plans/exp_e6b0965af3.json, correctness_preflight.paths[0].tolerances);
# used only when check-golden runs without --spec.
DEFAULT_TOLERANCES: dict[str, dict[str, float]] = {
    "baseline_loss": {"atol": 1e-5, "rtol": 1e-4},
    "baseline_gradient": {"atol": 1e-5, "rtol": 1e-3, "min_cosine": 0.9999},
    "reference_loss": {"atol": 1e-5, "rtol": 1e-4},
    "reference_gradient": {"atol": 1e-5, "rtol": 1e-3, "min_cosine": 0.9999},
}
# verl's vanilla PPO (the golden grpo_no_dual_clip entry) keeps a dual clip at c=1e4 and clamps the
# log-ratio to +-20; Tinker's ppo has neither. Used only to reproduce the golden values.
VERL_NO_DUAL_CLIP_C = 10000.0
_REQUIRED_CASE_KEYS = ("name", "shape", "log_prob", "rollout_log_prob", "advantages", "response_mask", "dppo")
_LOSSES_PY = Path(__file__).with_name("losses.py")


class GoldenError(ValueError):
    """The golden file is malformed; the message names the field."""


# ---------------------------------------------------------------------------------------------
# Registry parity: every registered loss against its own reference and golden cases

# float64 on both sides: only summation order differs.
REGISTRY_TOLERANCE = {"atol": 1e-12, "rtol": 1e-9}


@dataclass(frozen=True)
class LossParity:
    loss: str
    cases: int
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return self.cases > 0 and not self.failures


def _close(name: str, what: str, got: Any, want: Any, tol: Mapping[str, float]) -> list[str]:
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    bad = ~np.isclose(g, w, atol=tol["atol"], rtol=tol["rtol"])
    if bad.any():
        err = float(np.max(np.abs(g - w)))
        return [f"{name}: {what} differs (max |diff| {err:.3g}, {int(bad.sum())} of {bad.size} values)"]
    return []


def registered_loss_parity(name: str, root: Path, tol: Mapping[str, float] = REGISTRY_TOLERANCE) -> LossParity:
    """A registered loss on its golden cases: its numpy reference reproduces the golden values
    (with the golden's rule variant, `GoldenCases.reference_params`), and the packed training path
    (float64) matches the reference (as trained) in loss, gradient and, for DPPO, mask."""
    import torch

    from dppo_harness import losses

    entry = losses.get_loss(name)
    path = Path(root) / entry.golden.file
    try:
        cases = json.loads(path.read_text())["cases"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return LossParity(name, 0, (f"{name}: golden file {entry.golden.file} unreadable ({exc})",))
    norm = entry.golden.normalization
    cfg = losses.LossConfig.for_loss(name, norm)
    failures: list[str] = []
    for c in cases:
        label = f"{name}/{c.get('name', '?')}"
        try:
            shape = tuple(int(x) for x in c["shape"])
            lp, mu, adv, mask = (np.asarray(c[k], dtype=np.float64).reshape(shape)
                                 for k in ("log_prob", "rollout_log_prob", "advantages", "response_mask"))
            want = c[entry.golden.key]
            want_loss, want_grad = float(want["loss"]), np.asarray(want["grad_log_prob"], dtype=np.float64).reshape(shape)
        except (KeyError, TypeError, ValueError) as exc:
            failures.append(f"{label}: malformed golden case ({exc})")
            continue
        golden_ref = entry.reference(lp, mu, adv, mask, norm, **dict(entry.golden.reference_params))
        failures += _close(label, "reference loss vs golden", golden_ref.loss, want_loss, tol)
        failures += _close(label, "reference gradient vs golden", golden_ref.grad_BT, want_grad, tol)
        ref = entry.reference(lp, mu, adv, mask, norm)
        lp_N = torch.tensor(lp.ravel(), dtype=torch.float64, requires_grad=True)
        mu_N, adv_N, mask_N = (torch.from_numpy(np.ascontiguousarray(x.ravel())) for x in (mu, adv, mask))
        loss, _ = losses.packed_loss_and_metrics(lp_N, mu_N, adv_N, mask_N, cfg)
        if loss.requires_grad:
            loss.backward()
        grad = lp_N.grad.numpy().reshape(shape) if lp_N.grad is not None else np.zeros(shape)
        failures += _close(label, "packed loss vs reference", float(loss.detach()), ref.loss, tol)
        failures += _close(label, "packed gradient vs reference", grad, ref.grad_BT, tol)
    return LossParity(name, len(cases), tuple(failures))


# ---------------------------------------------------------------------------------------------
# Error measures


def parity_errors(actual: Any, reference: Any) -> dict[str, float | None]:
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


def errors_pass(errors: dict[str, Any], tol: dict[str, float]) -> tuple[bool, str]:
    """The brief's acceptance rule; returns (passed, reason)."""
    for key in ("max_abs_error", "reference_max_abs"):
        v = errors.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            return False, f"{key} must be a finite non-negative number, got {v!r}"
    bound = float(tol["atol"]) + float(tol.get("rtol", 0.0)) * errors["reference_max_abs"]
    if not errors["max_abs_error"] <= bound:
        return False, f"max_abs_error {errors['max_abs_error']:.3g} > atol+rtol*ref {bound:.3g}"
    if "min_cosine" in tol:
        cos = errors.get("cosine_similarity")
        exact_zero = errors["max_abs_error"] == 0 and errors["reference_max_abs"] == 0
        if cos is None and not exact_zero:
            return False, "cosine_similarity missing (zero vector) but min_cosine is required"
        if cos is not None and (not isinstance(cos, (int, float)) or not cos >= float(tol["min_cosine"])):
            return False, f"cosine {cos!r} < min_cosine {tol['min_cosine']}"
    return True, "ok"


def _utilization(errors: dict[str, Any], tol: dict[str, float]) -> float:
    bound = float(tol["atol"]) + float(tol.get("rtol", 0.0)) * errors["reference_max_abs"]
    return errors["max_abs_error"] / bound if bound > 0 else math.inf


# ---------------------------------------------------------------------------------------------
# Golden file


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _array(case: dict, keys: Sequence[str], shape: tuple[int, int]) -> np.ndarray:
    obj: Any = case
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


def _scalar(case: dict, keys: Sequence[str]) -> float:
    obj: Any = case
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
        raise GoldenError(f"{path}: schema must be {GOLDEN_SCHEMA!r}, got {raw.get('schema') if isinstance(raw, dict) else type(raw).__name__!r}")
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
                grpo_clipfrac=_scalar(c, ["grpo_no_dual_clip", "clipfrac"]) if grpo is not None and "clipfrac" in grpo else None,
                dppo_removed=int(removed) if isinstance(removed, (int, float)) and not isinstance(removed, bool) else None,
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


def to_datums(packed: PackedCase) -> list:
    import tinker

    datums = []
    for tokens, mu, adv, mask in zip(packed.tokens, packed.mu_T, packed.adv_T, packed.mask_T):
        datums.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                    "logprobs": mu.astype(np.float32),
                    "advantages": adv.astype(np.float32),
                    "mask": mask.astype(np.float32),
                },
            )
        )
    return datums


@dataclass
class PackedRun:
    loss: float
    grad_BT: np.ndarray
    keep_BT: np.ndarray
    clipped_BT: np.ndarray
    metrics: dict[str, float]
    used_lp_BT: np.ndarray  # the values the loss actually saw
    used_mu_BT: np.ndarray
    used_adv_BT: np.ndarray
    prompt_grad_max_abs: float
    missing_grads: int


def run_packed(case: GoldenCase, packed: PackedCase, arm: str, normalization: str, mode: str) -> PackedRun:
    """Run the packed path under test and scatter its outputs back into the padded layout."""
    import torch  # lazy: the validate CLI needs numpy only

    from dppo_harness import losses

    cfg = losses.LossConfig(loss=losses.DPPO_LOSS if arm == "dppo" else losses.GRPO_LOSS, normalization=normalization)
    B, T = case.mask_BT.shape
    if mode == "float64":
        lps = [torch.tensor(lp, dtype=torch.float64, requires_grad=True) for lp in packed.lp_T]
        logprobs_N = torch.cat(lps) if lps else torch.zeros(0, dtype=torch.float64)
        cat = lambda xs: torch.from_numpy(np.concatenate(xs)) if xs else torch.zeros(0, dtype=torch.float64)  # noqa: E731
        mu_N, adv_N, mask_N = cat(packed.mu_T), cat(packed.adv_T), cat(packed.mask_T)
        loss, metrics = losses.packed_loss_and_metrics(logprobs_N, mu_N, adv_N, mask_N, cfg)
        terms = losses.token_terms(logprobs_N.detach(), mu_N, adv_N, mask_N, cfg)
        used_mu, used_adv = packed.mu_T, packed.adv_T
    elif mode in ("float32", "float64-datum"):
        dtype = torch.float32 if mode == "float32" else torch.float64
        datums = to_datums(packed)
        lps = [torch.tensor(lp, dtype=dtype).requires_grad_(True) for lp in packed.lp_T]
        loss, metrics = losses.make_loss_fn(cfg)(datums, lps)
        terms = losses.datum_token_terms(datums, lps, cfg)
        used_mu = [mu.astype(np.float32).astype(np.float64) for mu in packed.mu_T]
        used_adv = [adv.astype(np.float32).astype(np.float64) for adv in packed.adv_T]
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    loss.backward()
    grad_BT = np.zeros((B, T))
    keep_BT = np.zeros((B, T), dtype=bool)
    clipped_BT = np.zeros((B, T), dtype=bool)
    used_lp_BT = case.lp_BT.copy()
    used_mu_BT = case.mu_BT.copy()
    used_adv_BT = case.adv_BT.copy()
    prompt_max = 0.0
    missing = 0
    offset = 0
    keep_N = terms.dppo_keep_N.numpy()
    clip_N = terms.ppo_clipped_N.numpy()
    for b, (lp, p_len, r_len) in enumerate(zip(lps, packed.prompt_lens, packed.response_lens)):
        n_prompt = p_len - 1
        if lp.grad is None:
            missing += 1
            g = np.zeros(lp.shape[0])
        else:
            g = lp.grad.detach().to(torch.float64).numpy()
        prompt_max = max(prompt_max, float(np.max(np.abs(g[:n_prompt]), initial=0.0)))
        grad_BT[b, :r_len] = g[n_prompt:]
        keep_BT[b, :r_len] = keep_N[offset + n_prompt : offset + n_prompt + r_len]
        clipped_BT[b, :r_len] = clip_N[offset + n_prompt : offset + n_prompt + r_len]
        used_lp_BT[b, :r_len] = lp.detach().to(torch.float64).numpy()[n_prompt:]
        used_mu_BT[b, :r_len] = used_mu[b][n_prompt:]
        used_adv_BT[b, :r_len] = used_adv[b][n_prompt:]
        offset += lp.shape[0]
    return PackedRun(float(loss.detach()), grad_BT, keep_BT, clipped_BT, metrics, used_lp_BT, used_mu_BT, used_adv_BT, prompt_max, missing)


# ---------------------------------------------------------------------------------------------
# Per-case checks


@dataclass
class SubCheck:
    name: str
    passed: bool
    detail: str
    errors: dict[str, dict[str, Any]] = field(default_factory=dict)  # check name -> error measures


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

    def to_json(self) -> dict:
        return {
            "case": self.case,
            "mode": self.mode,
            "passed": self.passed,
            "subchecks": [{"name": s.name, "passed": s.passed, "detail": s.detail, "errors": s.errors} for s in self.subchecks],
        }


def _loss_grad_check(
    name: str,
    loss: float,
    grad_BT: np.ndarray,
    exp_loss: float,
    exp_grad_BT: np.ndarray,
    tolerances: dict[str, dict[str, float]],
    loss_key: str,
    grad_key: str,
    extra_fail: list[str],
    note: str = "",
) -> SubCheck:
    le = parity_errors([loss], [exp_loss])
    ge = parity_errors(grad_BT, exp_grad_BT)
    ok_l, why_l = errors_pass(le, tolerances[loss_key])
    ok_g, why_g = errors_pass(ge, tolerances[grad_key])
    fails = list(extra_fail)
    if not ok_l:
        fails.append(f"loss {why_l}")
    if not ok_g:
        fails.append(f"grad {why_g}")
    cos = ge["cosine_similarity"]
    detail = f"loss_err={le['max_abs_error']:.2e} grad_err={ge['max_abs_error']:.2e} cos={'n/a' if cos is None else f'{cos:.9f}'}"
    if note:
        detail += f" {note}"
    if fails:
        detail += " | " + "; ".join(fails)
    return SubCheck(name, not fails, detail, {loss_key: le, grad_key: ge})


def check_case(case: GoldenCase, mode: str, tolerances: dict[str, dict[str, float]] | None = None, seed: int = 0) -> CaseResult:
    tol = tolerances or DEFAULT_TOLERANCES
    packed = pack_case(case, seed=seed)
    subs: list[SubCheck] = []

    if mode == "float64":
        # The independent implementation must itself reproduce the golden file (exact masks).
        rd = ref_dppo(case.lp_BT, case.mu_BT, case.adv_BT, case.mask_BT)
        fails = [] if np.array_equal(rd.decision_BT, case.dppo_mask_BT > 0) else ["mask differs"]
        subs.append(_loss_grad_check("ref_dppo_vs_golden", rd.loss, rd.grad_BT, case.dppo_loss, case.dppo_grad_BT, tol, "reference_loss", "reference_gradient", fails))
        if case.grpo_loss is not None:
            rv = ref_ppo(case.lp_BT, case.mu_BT, case.adv_BT, case.mask_BT, "token_mean", log_ratio_clamp=LOG_RATIO_CLAMP_MAX, dual_clip_c=VERL_NO_DUAL_CLIP_C)
            fails = []
            if case.grpo_clipfrac is not None:
                n = token_count(case.mask_BT)
                if int(rv.decision_BT.sum()) != round(case.grpo_clipfrac * (n + 1e-8)):
                    fails.append("clip count differs")
            subs.append(_loss_grad_check("ref_grpo_vs_golden", rv.loss, rv.grad_BT, case.grpo_loss, case.grpo_grad_BT, tol, "reference_loss", "reference_gradient", fails))

    # Treatment (reference parity): DPPO, token_mean.
    run = run_packed(case, packed, "dppo", "token_mean", mode)
    r_used = ref_dppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT)
    flips = int((r_used.decision_BT != (case.dppo_mask_BT > 0)).sum())
    if flips == 0:
        exp_loss, exp_grad, exp_mask, note = case.dppo_loss, case.dppo_grad_BT, case.dppo_mask_BT > 0, "vs golden"
    else:
        exp_loss, exp_grad, exp_mask = r_used.loss, r_used.grad_BT, r_used.decision_BT
        note = f"flips={flips} vs independent ref on rounded inputs"
    fails = _common_failures(run)
    if not np.array_equal(run.keep_BT, exp_mask):
        fails.append(f"mask differs on {int((run.keep_BT != exp_mask).sum())} tokens")
    fails += _metric_failures(run, case, exp_mask, flips == 0)
    subs.append(_loss_grad_check("dppo", run.loss, run.grad_BT, exp_loss, exp_grad, tol, "reference_loss", "reference_gradient", fails, note))

    # Baseline parity: GRPO path with sum normalization vs Tinker's built-in ppo formula.
    run = run_packed(case, packed, "grpo", "sum", mode)
    rb = ref_ppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, "sum")
    fails = _common_failures(run)
    if not np.array_equal(run.clipped_BT, rb.decision_BT):
        fails.append(f"clip decisions differ on {int((run.clipped_BT != rb.decision_BT).sum())} tokens")
    if run.metrics.get("ppo/clipped") != float(rb.decision_BT.sum()):
        fails.append("ppo/clipped metric differs")
    subs.append(_loss_grad_check("grpo_baseline", run.loss, run.grad_BT, rb.loss, rb.grad_BT, tol, "baseline_loss", "baseline_gradient", fails, "vs tinker ppo formula"))

    # Baseline parity under the normalization that is trained (token_mean; issue 11 point 10):
    # the same Tinker ppo formula divided by the call's loss-token count.
    run = run_packed(case, packed, "grpo", "token_mean", mode)
    rb = ref_ppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, "token_mean")
    fails = _common_failures(run)
    if not np.array_equal(run.clipped_BT, rb.decision_BT):
        fails.append(f"clip decisions differ on {int((run.clipped_BT != rb.decision_BT).sum())} tokens")
    subs.append(_loss_grad_check("grpo_baseline_token_mean", run.loss, run.grad_BT, rb.loss, rb.grad_BT, tol, "baseline_loss", "baseline_gradient", fails, "vs tinker ppo formula / loss tokens"))

    # GRPO path (token_mean) vs the golden grpo_no_dual_clip, on the domain where verl == Tinker ppo.
    if case.grpo_loss is not None:
        on = case.mask_BT > 0
        with np.errstate(over="ignore"):
            lr = np.where(on, case.lp_BT - case.mu_BT, 0.0)
            outside = on & ((np.abs(lr) > LOG_RATIO_CLAMP_MAX) | ((case.adv_BT < 0) & (np.exp(lr) > VERL_NO_DUAL_CLIP_C)))
        if outside.any():
            subs.append(SubCheck("grpo_golden", True, f"n/a: {int(outside.sum())} tokens beyond verl's +-20 log-ratio clamp or c=1e4 dual clip, which Tinker ppo lacks; covered by ref_grpo_vs_golden + grpo_baseline"))
        else:
            run = run_packed(case, packed, "grpo", "token_mean", mode)
            rv = ref_ppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, "token_mean")
            gold_clip = ref_ppo(case.lp_BT, case.mu_BT, case.adv_BT, case.mask_BT, "token_mean").decision_BT
            cflips = int((rv.decision_BT != gold_clip).sum())
            if cflips == 0:
                exp_loss, exp_grad, note = case.grpo_loss, case.grpo_grad_BT, "vs golden"
            else:
                exp_loss, exp_grad, note = rv.loss, rv.grad_BT, f"flips={cflips} vs independent ref on rounded inputs"
            fails = _common_failures(run)
            if case.grpo_clipfrac is not None and cflips == 0:
                n = token_count(case.mask_BT)
                if run.metrics["ppo/clipped"] != round(case.grpo_clipfrac * (n + 1e-8)):
                    fails.append("ppo/clipped differs from golden clipfrac")
            subs.append(_loss_grad_check("grpo_golden", run.loss, run.grad_BT, exp_loss, exp_grad, tol, "reference_loss", "reference_gradient", fails, note))
    return CaseResult(case.name, mode, subs)


def _common_failures(run: PackedRun) -> list[str]:
    fails = []
    if run.missing_grads:
        fails.append(f"{run.missing_grads} logprob tensors got no gradient")
    if run.prompt_grad_max_abs != 0.0:
        fails.append(f"nonzero gradient {run.prompt_grad_max_abs:.3g} on prompt positions")
    return fails


def _metric_failures(run: PackedRun, case: GoldenCase, exp_keep_BT: np.ndarray, vs_golden: bool) -> list[str]:
    on = case.mask_BT > 0
    nonzero = on & (case.adv_BT != 0)
    removed = nonzero & ~exp_keep_BT
    want = {
        "tokens/loss": float(on.sum()),
        "tokens/nonzero_adv": float(nonzero.sum()),
        "dppo/removed": float(removed.sum()),
        "dppo/removed_pos_adv": float((removed & (case.adv_BT > 0)).sum()),
        "dppo/removed_neg_adv": float((removed & (case.adv_BT < 0)).sum()),
        "dppo/mask_zero_adv": float((on & (case.adv_BT == 0) & ~exp_keep_BT).sum()),
    }
    fails = [f"{k}={run.metrics.get(k)} want {v}" for k, v in want.items() if run.metrics.get(k) != v]
    if vs_golden and case.dppo_removed is not None and run.metrics.get("dppo/removed") != float(case.dppo_removed):
        fails.append(f"dppo/removed={run.metrics.get('dppo/removed')} vs golden n_invalid_tr_tokens={case.dppo_removed}")
    return fails


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

    def to_json(self) -> dict:
        return {
            "golden_path": self.path,
            "golden_sha256": self.sha256,
            "passed": self.n_passed,
            "failed": self.n_failed,
            "results": [r.to_json() for r in self.results],
        }


def check_golden(path: Path, modes: Sequence[str] = MODES, tolerances: dict | None = None,
                 progress: Callable[[str], None] | None = None) -> GoldenReport:
    """Every golden case in every mode; `progress` gets a line at least every few seconds of work."""
    from dppo_harness.progress import Ticker, quiet

    _, cases = load_golden(path)
    ticker = Ticker(progress or quiet, "[preflight] correctness: golden parity", total=len(cases) * len(modes))
    ticker.start(f"{len(cases)} cases x {len(modes)} modes")
    results = []
    for c in cases:
        for m in modes:
            try:
                results.append(check_case(c, m, tolerances))
            except (ValueError, TypeError, FloatingPointError) as exc:  # bad case data: a failed line, not a crash
                results.append(CaseResult(c.name, m, [SubCheck("error", False, f"{type(exc).__name__}: {exc}")]))
            ticker.tick(len(results), f"{c.name} [{m}] {'ok' if results[-1].passed else 'FAILED'}")
    return GoldenReport(str(path), file_sha256(path), results)


# ---------------------------------------------------------------------------------------------
# correctness_preflight block


def spec_tolerances(spec: dict, path_id: str = PATH_ID) -> dict[str, dict[str, float]]:
    block = spec.get("correctness_preflight", spec)
    for p in block.get("paths", []) or []:
        if isinstance(p, dict) and p.get("id") == path_id:
            tol = p.get("tolerances")
            if not isinstance(tol, dict) or not tol:
                raise ValueError(f"spec path {path_id!r} has no tolerances")
            return tol
    raise ValueError(f"spec has no correctness_preflight path {path_id!r}")


def implementation_revision() -> str:
    return hashlib.sha256(_LOSSES_PY.read_bytes()).hexdigest()


def _worst(entries: list[dict[str, Any]], tol: dict[str, float]) -> dict[str, Any]:
    failing = [e for e in entries if not errors_pass(e, tol)[0]]
    pool = failing or entries
    return max(pool, key=lambda e: (_utilization(e, tol), -(e["cosine_similarity"] if e["cosine_similarity"] is not None else -2.0)))


def build_preflight_block(report: GoldenReport, spec: dict | None = None) -> dict:
    """The brief's ``correctness_preflight`` object; errors are the worst case over every case and mode."""
    tol = spec_tolerances(spec) if spec is not None else DEFAULT_TOLERANCES
    collected: dict[str, list[dict[str, Any]]] = {k: [] for k in CHECK_NAMES}
    for res in report.results:
        for sub in res.subchecks:
            if sub.name.startswith("ref_") or sub.name == "grpo_golden":
                continue  # reference-implementation self-checks and the informational GRPO-vs-verl line
            for key, err in sub.errors.items():
                collected[key].append(err)
    errors = {}
    for key in CHECK_NAMES:
        if collected[key]:
            errors[key] = _worst(collected[key], tol.get(key, DEFAULT_TOLERANCES[key]))
    modes = sorted({r.mode for r in report.results})
    flips = sum(1 for r in report.results for s in r.subchecks if "flips=" in s.detail)
    return {
        "required": True,
        "paths": [
            {
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
        ],
    }


# ---------------------------------------------------------------------------------------------
# Validator (the brief's contract: exit nonzero unless passed/not_applicable)


def _is_hex64(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(ch in "0123456789abcdef" for ch in v.lower())


def _nonempty_str(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def validate_preflight(spec: dict, preflight: dict) -> tuple[str, list[str]]:
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
    for sp in spec_block.get("paths", []) or []:
        pid = sp.get("id")
        p = by_id.get(pid)
        if p is None:
            msgs.append(f"FAIL path {pid!r} missing from preflight")
            continue
        fi = p.get("fixed_input")
        if not (isinstance(fi, dict) and _is_hex64(fi.get("sha256")) and _nonempty_str(fi.get("description"))):
            msgs.append(f"FAIL {pid}: fixed_input needs a 64-hex sha256 and a description")
        for key in ("baseline_revision", "reference_revision", "implementation_revision", "precision", "normalization"):
            v = p.get(key)
            if not _nonempty_str(v) or v.strip().upper().startswith("UNRESOLVED"):
                msgs.append(f"FAIL {pid}: {key} missing or unresolved ({v!r})")
        errors = p.get("errors")
        if not isinstance(errors, dict):
            msgs.append(f"FAIL {pid}: errors missing")
            errors = {}
        tols = sp.get("tolerances") or {}
        if not tols:
            msgs.append(f"FAIL {pid}: spec path has no tolerances")
        for check, tol in tols.items():
            if check == "lr_scaling":
                continue
            err = errors.get(check)
            if not isinstance(err, dict):
                msgs.append(f"FAIL {pid}.{check}: missing")
                continue
            ok, why = errors_pass(err, tol)
            rel = err.get("relative_l2_error")
            if ok and rel is None and err.get("reference_max_abs", 0) != 0:
                ok, why = False, "relative_l2_error is null for a nonzero reference"
            if ok and rel is not None and not (isinstance(rel, (int, float)) and math.isfinite(rel)):
                ok, why = False, f"relative_l2_error must be a finite number or null, got {rel!r}"
            msgs.append(f"{'ok  ' if ok else 'FAIL'} {pid}.{check}: {why}")
        lr = p.get("lr_scaling")
        if not isinstance(lr, list):
            msgs.append(f"FAIL {pid}: lr_scaling must be a list")
        else:
            lr_tol = tols.get("lr_scaling") if isinstance(tols, dict) else None
            unavailable = [e for e in lr if isinstance(e, dict) and e.get("available") is False]
            for e in unavailable:  # recorded as unmeasured with its reason: unverified, never a pass
                if not (isinstance(e.get("reason"), str) and e["reason"].strip()) or e.get("update_norm") is not None:
                    msgs.append(f"FAIL {pid}: an unavailable lr_scaling entry needs a reason and update_norm null")
            if unavailable and isinstance(lr_tol, dict):
                msgs.append(f"FAIL {pid}: lr_scaling unavailable ({unavailable[0].get('reason')}) but the spec sets a tolerance")
            elif unavailable:
                msgs.append(f"note {pid}: lr_scaling unavailable: {unavailable[0].get('reason')} (unverified; the spec "
                            "sets no LR-scaling tolerance for this path)")
            lr = [e for e in lr if not (isinstance(e, dict) and e.get("available") is False)]
            for i, e in enumerate(lr):
                good = isinstance(e, dict) and all(
                    isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool) and math.isfinite(e[k]) and e[k] > 0
                    for k in ("learning_rate", "update_norm")
                )
                if not good:
                    msgs.append(f"FAIL {pid}: lr_scaling[{i}] needs positive finite learning_rate and update_norm")
            if isinstance(lr_tol, dict) and not unavailable:
                msgs += _check_lr_scaling(pid, lr, lr_tol)
            elif not lr and not unavailable:
                msgs.append(f"note {pid}: lr_scaling empty (the spec sets no LR-scaling tolerance for this path)")
    status = "failed" if any(m.startswith("FAIL") for m in msgs) else "passed"
    return status, msgs


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


def _check_lr_scaling(pid: str, lr: list, tol: dict) -> list[str]:
    limit = tol.get("max_relative_error", tol.get("rtol"))
    if len(lr) < 2:
        return [f"FAIL {pid}.lr_scaling: the spec sets a tolerance but fewer than 2 probes were recorded"]
    if not isinstance(limit, (int, float)):
        return [f"FAIL {pid}.lr_scaling: spec tolerance needs max_relative_error, got {tol!r}"]
    try:
        errs = lr_scaling_error(lr)
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        return [f"FAIL {pid}.lr_scaling: malformed probes ({exc})"]
    worst = max(errs)
    ok = worst <= limit
    return [f"{'ok  ' if ok else 'FAIL'} {pid}.lr_scaling: max relative error {worst:.3g} (limit {limit})"]


# ---------------------------------------------------------------------------------------------
# CLI


def _load_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: cannot read {what} {path}: {exc}") from None


def run_validator_cli(spec_bytes: bytes, preflight_block: Mapping[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """Run `python -m dppo_harness.correctness validate` on the WRITTEN preflight block, as the brief
    asks of its validator, and return its exit code and output (issue 11 point 8)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        spec_f, pre_f = Path(d) / "spec.json", Path(d) / "correctness-preflight.json"
        spec_f.write_bytes(spec_bytes)
        pre_f.write_text(json.dumps(preflight_block, indent=1))
        cmd = [sys.executable, "-m", "dppo_harness.correctness", "validate", str(spec_f), str(pre_f)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    return {"kind": "correctness_validator", "command": "python -m dppo_harness.correctness validate <spec> <preflight>",
            "spec_sha256": hashlib.sha256(spec_bytes).hexdigest(),
            "preflight_sha256": hashlib.sha256(json.dumps(preflight_block, indent=1).encode()).hexdigest(),
            "exit_code": proc.returncode, "stdout": proc.stdout[-20000:], "stderr": proc.stderr[-4000:]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dppo_harness.correctness")
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
        import torch

        torch.set_num_threads(1)
        spec = _load_json(args.spec, "spec") if args.spec else None
        tol = spec_tolerances(spec) if spec is not None else None
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad:
            print(f"error: unknown modes {bad}; expected {MODES}", file=sys.stderr)
            return 2
        try:
            report = check_golden(Path(args.file), modes, tol)
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

    spec = _load_json(args.spec, "spec")
    pre = _load_json(args.preflight, "preflight")
    status, msgs = validate_preflight(spec, pre)
    for m in msgs:
        print(m)
    print(status)
    return 0 if status in ("passed", "not_applicable") else 1


if __name__ == "__main__":
    sys.exit(main())

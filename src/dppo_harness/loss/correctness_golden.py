"""Golden parity: every golden case through the packed loss path, in every mode, against the
golden values (or, where float32 rounding moves a token across a decision boundary, against the
independent padded implementation on the rounded inputs), and every registered loss against its
own reference and golden cases.

The error measures and their acceptance rule are ``correctness_measures``'; this module runs the
packed path (``correctness_packed``: torch and the SDK), so the numpy-only validator never imports it.

In Datum modes the sampler logprobs are float32-rounded; if that rounding moves a token across a
decision boundary (only the exact-boundary cases do), the expectation is the independent padded
implementation evaluated on the rounded inputs, and the line says so (``flips=k``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from dppo_harness.constants import LOG_RATIO_CLAMP_MAX
from dppo_harness.evidence.progress import Ticker, quiet
from dppo_harness.loss import losses
from dppo_harness.loss.correctness_measures import (
    DEFAULT_TOLERANCES,
    CaseResult,
    GoldenReport,
    SubCheck,
    Tolerances,
    errors_pass,
    parity_errors,
)
from dppo_harness.loss.correctness_packed import PackedRun, run_packed
from dppo_harness.loss.correctness_reference import MODES, GoldenCase, PackedCase, file_sha256, load_golden, pack_case
from dppo_harness.loss.loss_registry import DPPO_LOSS, get_loss
from dppo_harness.loss.references import ref_dppo, ref_ppo, token_count

# verl's vanilla PPO (the golden grpo_no_dual_clip entry) keeps a dual clip at c=1e4 and clamps the
# log-ratio to +-20; Tinker's ppo has neither. Used only to reproduce the golden values.
VERL_NO_DUAL_CLIP_C = 10000.0


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


def _close(name: str, what: str, got: npt.ArrayLike, want: npt.ArrayLike, tol: Mapping[str, float]) -> list[str]:
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    bad = ~np.isclose(g, w, atol=tol["atol"], rtol=tol["rtol"])
    if bad.any():
        err = float(np.max(np.abs(g - w)))
        return [f"{name}: {what} differs (max |diff| {err:.3g}, {int(bad.sum())} of {bad.size} values)"]
    return []


def registered_loss_parity(name: str, root: Path, tol: Mapping[str, float] = REGISTRY_TOLERANCE) -> LossParity:
    """A registered loss on its golden cases: its numpy reference reproduces the golden values
    (at the loss's parameters, with the golden's rule variant, `GoldenCases.reference_params`), and
    the packed training path (float64) matches the reference (as trained) in loss and gradient."""
    entry = get_loss(name)
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
            lp, mu, adv, mask = (
                np.asarray(c[k], dtype=np.float64).reshape(shape)
                for k in ("log_prob", "rollout_log_prob", "advantages", "response_mask")
            )
            want = c[entry.golden.key]
            want_loss, want_grad = (
                float(want["loss"]),
                np.asarray(want["grad_log_prob"], dtype=np.float64).reshape(shape),
            )
        except (KeyError, TypeError, ValueError) as exc:
            failures.append(f"{label}: malformed golden case ({exc})")
            continue
        golden_ref = entry.reference(lp, mu, adv, mask, norm, **entry.params, **entry.golden.reference_params)
        failures += _close(label, "reference loss vs golden", golden_ref.loss, want_loss, tol)
        failures += _close(label, "reference gradient vs golden", golden_ref.grad_BT, want_grad, tol)
        ref = entry.reference(lp, mu, adv, mask, norm, **entry.params)
        lp_N = torch.tensor(lp.ravel(), dtype=torch.float64, requires_grad=True)
        mu_N, adv_N, mask_N = (torch.from_numpy(np.ascontiguousarray(x.ravel())) for x in (mu, adv, mask))
        loss = losses.packed_loss_call(lp_N, mu_N, adv_N, mask_N, cfg).loss
        if loss.requires_grad:
            loss.backward()
        grad = lp_N.grad.numpy().reshape(shape) if lp_N.grad is not None else np.zeros(shape)
        failures += _close(label, "packed loss vs reference", float(loss.detach()), ref.loss, tol)
        failures += _close(label, "packed gradient vs reference", grad, ref.grad_BT, tol)
    return LossParity(name, len(cases), tuple(failures))


# ---------------------------------------------------------------------------------------------
# Per-case checks


def _dppo_params() -> Mapping[str, float]:
    """The registered DPPO rule's parameters (its delta is the plan's)."""
    return get_loss(DPPO_LOSS).params


def _loss_grad_check(
    name: str,
    loss: float,
    grad_BT: np.ndarray,
    exp_loss: float,
    exp_grad_BT: np.ndarray,
    tolerances: Tolerances,
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


def check_case(case: GoldenCase, mode: str, tolerances: Tolerances | None = None, seed: int = 0) -> CaseResult:
    """One golden case in one mode: in float64 the independent references against the golden file,
    then the packed DPPO path, the packed GRPO path against Tinker's ppo formula (sum and
    token_mean) and the packed GRPO path against the golden GRPO values."""
    tol = tolerances or DEFAULT_TOLERANCES
    packed = pack_case(case, seed=seed)
    subs = _reference_self_checks(case, tol) if mode == "float64" else []
    subs.append(_dppo_check(case, packed, mode, tol))
    subs += _baseline_checks(case, packed, mode, tol)
    if case.grpo_loss is not None:
        subs.append(_grpo_golden_check(case, packed, mode, tol))
    return CaseResult(case.name, mode, subs)


def _reference_self_checks(case: GoldenCase, tol: Tolerances) -> list[SubCheck]:
    """The independent implementation must itself reproduce the golden file (exact masks)."""
    rd = ref_dppo(case.lp_BT, case.mu_BT, case.adv_BT, case.mask_BT, "token_mean", **_dppo_params())
    fails = [] if np.array_equal(rd.decision_BT, case.dppo_mask_BT > 0) else ["mask differs"]
    subs = [
        _loss_grad_check(
            "ref_dppo_vs_golden",
            rd.loss,
            rd.grad_BT,
            case.dppo_loss,
            case.dppo_grad_BT,
            tol,
            "reference_loss",
            "reference_gradient",
            fails,
        )
    ]
    if case.grpo_loss is not None and case.grpo_grad_BT is not None:  # both or neither (the golden's GRPO entry)
        rv = ref_ppo(
            case.lp_BT,
            case.mu_BT,
            case.adv_BT,
            case.mask_BT,
            "token_mean",
            log_ratio_clamp=LOG_RATIO_CLAMP_MAX,
            dual_clip_c=VERL_NO_DUAL_CLIP_C,
        )
        fails = []
        if case.grpo_clipfrac is not None:
            n = token_count(case.mask_BT)
            if int(rv.decision_BT.sum()) != round(case.grpo_clipfrac * (n + 1e-8)):
                fails.append("clip count differs")
        subs.append(
            _loss_grad_check(
                "ref_grpo_vs_golden",
                rv.loss,
                rv.grad_BT,
                case.grpo_loss,
                case.grpo_grad_BT,
                tol,
                "reference_loss",
                "reference_gradient",
                fails,
            )
        )
    return subs


def _dppo_check(case: GoldenCase, packed: PackedCase, mode: str, tol: Tolerances) -> SubCheck:
    """Treatment (reference parity): DPPO, token_mean."""
    run = run_packed(case, packed, "dppo", "token_mean", mode)
    r_used = ref_dppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, "token_mean", **_dppo_params())
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
    return _loss_grad_check(
        "dppo", run.loss, run.grad_BT, exp_loss, exp_grad, tol, "reference_loss", "reference_gradient", fails, note
    )


def _baseline_checks(case: GoldenCase, packed: PackedCase, mode: str, tol: Tolerances) -> list[SubCheck]:
    """Baseline parity: the GRPO path against Tinker's built-in ppo formula, under sum
    normalization and under the normalization that is trained (token_mean: the same formula
    divided by the call's loss-token count)."""
    run = run_packed(case, packed, "grpo", "sum", mode)
    rb = ref_ppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, "sum")
    fails = _common_failures(run)
    if not np.array_equal(run.clipped_BT, rb.decision_BT):
        fails.append(f"clip decisions differ on {int((run.clipped_BT != rb.decision_BT).sum())} tokens")
    if run.metrics.get("ppo/clipped") != float(rb.decision_BT.sum()):
        fails.append("ppo/clipped metric differs")
    subs = [
        _loss_grad_check(
            "grpo_baseline",
            run.loss,
            run.grad_BT,
            rb.loss,
            rb.grad_BT,
            tol,
            "baseline_loss",
            "baseline_gradient",
            fails,
            "vs tinker ppo formula",
        )
    ]

    run = run_packed(case, packed, "grpo", "token_mean", mode)
    rb = ref_ppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, "token_mean")
    fails = _common_failures(run)
    if not np.array_equal(run.clipped_BT, rb.decision_BT):
        fails.append(f"clip decisions differ on {int((run.clipped_BT != rb.decision_BT).sum())} tokens")
    subs.append(
        _loss_grad_check(
            "grpo_baseline_token_mean",
            run.loss,
            run.grad_BT,
            rb.loss,
            rb.grad_BT,
            tol,
            "baseline_loss",
            "baseline_gradient",
            fails,
            "vs tinker ppo formula / loss tokens",
        )
    )
    return subs


def _grpo_golden_check(case: GoldenCase, packed: PackedCase, mode: str, tol: Tolerances) -> SubCheck:
    """GRPO path (token_mean) vs the golden grpo_no_dual_clip, on the domain where verl == Tinker ppo."""
    on = case.mask_BT > 0
    with np.errstate(over="ignore"):
        lr = np.where(on, case.lp_BT - case.mu_BT, 0.0)
        outside = on & ((np.abs(lr) > LOG_RATIO_CLAMP_MAX) | ((case.adv_BT < 0) & (np.exp(lr) > VERL_NO_DUAL_CLIP_C)))
    if outside.any():
        return SubCheck(
            "grpo_golden",
            True,
            f"n/a: {int(outside.sum())} tokens beyond verl's +-20 log-ratio clamp or c=1e4 dual clip, which Tinker ppo lacks; covered by ref_grpo_vs_golden + grpo_baseline",
        )
    run = run_packed(case, packed, "grpo", "token_mean", mode)
    rv = ref_ppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, "token_mean")
    gold_clip = ref_ppo(case.lp_BT, case.mu_BT, case.adv_BT, case.mask_BT, "token_mean").decision_BT
    cflips = int((rv.decision_BT != gold_clip).sum())
    if cflips == 0 and case.grpo_loss is not None and case.grpo_grad_BT is not None:  # check_case: both set
        exp_loss, exp_grad, note = case.grpo_loss, case.grpo_grad_BT, "vs golden"
    else:
        exp_loss, exp_grad, note = rv.loss, rv.grad_BT, f"flips={cflips} vs independent ref on rounded inputs"
    fails = _common_failures(run)
    if case.grpo_clipfrac is not None and cflips == 0:
        n = token_count(case.mask_BT)
        if run.metrics["ppo/clipped"] != round(case.grpo_clipfrac * (n + 1e-8)):
            fails.append("ppo/clipped differs from golden clipfrac")
    return _loss_grad_check(
        "grpo_golden",
        run.loss,
        run.grad_BT,
        exp_loss,
        exp_grad,
        tol,
        "reference_loss",
        "reference_gradient",
        fails,
        note,
    )


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
        fails.append(
            f"dppo/removed={run.metrics.get('dppo/removed')} vs golden n_invalid_tr_tokens={case.dppo_removed}"
        )
    return fails


def check_golden(
    path: Path,
    modes: Sequence[str] = MODES,
    tolerances: Tolerances | None = None,
    progress: Callable[[str], None] | None = None,
    torch_threads: int | None = None,
) -> GoldenReport:
    """Every golden case in every mode; `progress` gets a line at least every few seconds of work.
    `torch_threads` pins torch's intra-op threads first (the CLI runs on one)."""
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
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

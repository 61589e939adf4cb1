"""Golden parity: every golden case through the packed loss path, in every mode (``golden.MODES``,
docs/losses.md), against the golden values, and every registered loss against its own reference
and golden cases. Each case is laid out as datums after junk prompt positions (``pack_case``), run
through the packed path (``run_packed``) and scattered back, so like is compared with like. Where
the Datum modes' float32 rounding moves a token across a decision boundary, the expectation is the
independent implementation (``references``) on the rounded inputs (``flips=k``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import tinker
import torch

from dppo_harness.evidence.progress import Ticker, quiet
from dppo_harness.loss import losses
from dppo_harness.loss.golden import (
    DEFAULT_TOLERANCES,
    MODES,
    REGISTRY_TOLERANCE,
    CaseResult,
    GoldenCase,
    GoldenError,
    GoldenReport,
    SubCheck,
    Tolerances,
    case_inputs,
    case_value,
    errors_pass,
    file_sha256,
    load_golden,
    parity_errors,
)
from dppo_harness.loss.loss_registry import DPPO_LOSS, GRPO_LOSS, Normalization, get_loss
from dppo_harness.loss.references import RefResult, ref_dppo, ref_ppo
from dppo_harness.rollout.frozen_batch import rl_datum

# ---------------------------------------------------------------------------------------------
# The packed path under test: golden rows as datums (prompt junk, varied prompt lengths, stale sampler logprobs)


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


def to_datums(packed: PackedCase) -> list[tinker.Datum]:
    """The case's rows as the SDK stores them (float32)."""
    return [rl_datum(*row) for row in zip(packed.tokens, packed.mu_T, packed.adv_T, packed.mask_T)]


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


def run_packed(case: GoldenCase, packed: PackedCase, arm: str, normalization: Normalization, mode: str) -> PackedRun:
    """Run the packed path under test and scatter its outputs back into the padded layout."""

    cfg = losses.LossConfig(loss=DPPO_LOSS if arm == "dppo" else GRPO_LOSS, normalization=normalization)
    B, T = case.mask_BT.shape
    if mode == "float64":
        lps = [torch.tensor(lp, dtype=torch.float64, requires_grad=True) for lp in packed.lp_T]
        logprobs_N = torch.cat(lps) if lps else torch.zeros(0, dtype=torch.float64)
        cat = lambda xs: torch.from_numpy(np.concatenate(xs)) if xs else torch.zeros(0, dtype=torch.float64)  # noqa: E731
        mu_N, adv_N, mask_N = cat(packed.mu_T), cat(packed.adv_T), cat(packed.mask_T)
        call = losses.packed_loss_call(logprobs_N, mu_N, adv_N, mask_N, cfg)
        used_mu, used_adv = packed.mu_T, packed.adv_T
    elif mode in ("float32", "float64-datum"):
        dtype = torch.float32 if mode == "float32" else torch.float64
        datums = to_datums(packed)
        lps = [torch.tensor(lp, dtype=dtype).requires_grad_(True) for lp in packed.lp_T]
        _, call = losses.make_loss_fn(cfg).evaluate(datums, lps)
        used_mu = [mu.astype(np.float32).astype(np.float64) for mu in packed.mu_T]
        used_adv = [adv.astype(np.float32).astype(np.float64) for adv in packed.adv_T]
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    call.loss.backward()
    starts = np.cumsum([0] + [lp.shape[0] for lp in lps])[:-1]

    def scatter(values_N: np.ndarray, base_BT: np.ndarray) -> np.ndarray:
        out = base_BT.copy()
        for b, (start, p_len, r_len) in enumerate(zip(starts, packed.prompt_lens, packed.response_lens)):
            out[b, :r_len] = values_N[start + p_len - 1 : start + p_len - 1 + r_len]
        return out

    grad_N = np.concatenate([np.zeros(lp.shape[0]) if lp.grad is None else lp.grad.double().numpy() for lp in lps])
    prompt_N = np.concatenate([np.arange(start, start + p - 1) for start, p in zip(starts, packed.prompt_lens)])
    no_B = np.zeros((B, T), dtype=bool)
    return PackedRun(
        float(call.loss.detach()),
        scatter(grad_N, np.zeros((B, T))),
        scatter(call.terms.dppo_keep_N.numpy(), no_B),
        scatter(call.terms.ppo_clipped_N.numpy(), no_B),
        call.stats.metrics(),
        scatter(np.concatenate([lp.detach().double().numpy() for lp in lps]), case.lp_BT),
        scatter(np.concatenate(used_mu), case.mu_BT),
        scatter(np.concatenate(used_adv), case.adv_BT),
        float(np.max(np.abs(grad_N[prompt_N]), initial=0.0)),
        sum(lp.grad is None for lp in lps),
    )


# ---------------------------------------------------------------------------------------------
# Registry parity: every registered loss against its own reference and golden cases


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
            lp, mu, adv, mask = case_inputs(c, label)
            want_loss = float(case_value(c, (entry.golden.key, "loss")))
            want_grad = case_value(c, (entry.golden.key, "grad_log_prob"), (lp.shape[0], lp.shape[1]))
        except GoldenError as exc:
            failures.append(f"{label}: malformed golden case ({exc})")
            continue
        shape = lp.shape
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


_REF, _BASE = ("reference_loss", "reference_gradient"), ("baseline_loss", "baseline_gradient")


def _loss_grad_check(
    name: str,
    got: tuple[float, np.ndarray],
    want: tuple[float, np.ndarray],
    tolerances: Tolerances,
    keys: tuple[str, str],
    extra_fail: list[str],
    note: str = "",
) -> SubCheck:
    """(loss, gradient) against the expected pair under the tolerances of the checks `keys` names."""
    le, ge = parity_errors([got[0]], [want[0]]), parity_errors(got[1], want[1])
    (ok_l, why_l), (ok_g, why_g) = errors_pass(le, tolerances[keys[0]]), errors_pass(ge, tolerances[keys[1]])
    fails = [*extra_fail, *([f"loss {why_l}"] if not ok_l else []), *([f"grad {why_g}"] if not ok_g else [])]
    cos = ge["cosine_similarity"]
    detail = f"loss_err={le['max_abs_error']:.2e} grad_err={ge['max_abs_error']:.2e} cos={'n/a' if cos is None else f'{cos:.9f}'}"
    detail += (f" {note}" if note else "") + (" | " + "; ".join(fails) if fails else "")
    return SubCheck(name, not fails, detail, {keys[0]: le, keys[1]: ge})


def check_case(case: GoldenCase, mode: str, tolerances: Tolerances | None = None, seed: int = 0) -> CaseResult:
    """One golden case in one mode: the packed DPPO path, the packed GRPO path against Tinker's ppo formula (sum and
    token_mean) and the packed GRPO path against the golden GRPO values."""
    tol = tolerances or DEFAULT_TOLERANCES
    packed = pack_case(case, seed=seed)
    subs = [_dppo_check(case, packed, mode, tol)]
    for norm, name, note in (
        ("sum", "grpo_baseline", "vs tinker ppo formula"),
        ("token_mean", "grpo_baseline_token_mean", "vs tinker ppo formula / loss tokens"),
    ):
        run = run_packed(case, packed, "grpo", norm, mode)  # type: ignore[arg-type]
        rb = ref_ppo(run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, norm)
        subs.append(_baseline_check(name, note, run, rb, tol))
    if case.grpo_loss is not None:  # `run`, `rb`: the trained normalization's (token_mean)
        subs.append(_grpo_golden_check(case, run, rb, tol))
    return CaseResult(case.name, mode, subs)


def _dppo_check(case: GoldenCase, packed: PackedCase, mode: str, tol: Tolerances) -> SubCheck:
    """Treatment (reference parity): DPPO, token_mean."""
    run = run_packed(case, packed, "dppo", "token_mean", mode)
    r_used = ref_dppo(
        run.used_lp_BT, run.used_mu_BT, run.used_adv_BT, case.mask_BT, "token_mean", **get_loss(DPPO_LOSS).params
    )
    flips = int((r_used.decision_BT != (case.dppo_mask_BT > 0)).sum())
    if flips == 0:
        exp_loss, exp_grad, exp_mask, note = case.dppo_loss, case.dppo_grad_BT, case.dppo_mask_BT > 0, "vs golden"
    else:
        exp_loss, exp_grad, exp_mask = r_used.loss, r_used.grad_BT, r_used.decision_BT
        note = f"flips={flips} vs independent ref on rounded inputs"
    fails = _common_failures(run)
    if flips and mode == "float64":  # exact inputs: the reference must decide as the golden file does
        fails.append(f"reference mask differs from the golden on {flips} tokens")
    if not np.array_equal(run.keep_BT, exp_mask):
        fails.append(f"mask differs on {int((run.keep_BT != exp_mask).sum())} tokens")
    fails += _metric_failures(run, case, exp_mask, flips == 0)
    return _loss_grad_check("dppo", (run.loss, run.grad_BT), (exp_loss, exp_grad), tol, _REF, fails, note)


def _baseline_check(name: str, note: str, run: PackedRun, rb: RefResult, tol: Tolerances) -> SubCheck:
    """Baseline parity: the GRPO path against Tinker's built-in ppo formula (`rb`), under sum
    normalization and under the normalization that is trained (token_mean: the same formula
    divided by the call's loss-token count)."""
    fails = _common_failures(run)
    if not np.array_equal(run.clipped_BT, rb.decision_BT):
        fails.append(f"clip decisions differ on {int((run.clipped_BT != rb.decision_BT).sum())} tokens")
    if name == "grpo_baseline" and run.metrics.get("ppo/clipped") != float(rb.decision_BT.sum()):
        fails.append("ppo/clipped metric differs")
    return _loss_grad_check(name, (run.loss, run.grad_BT), (rb.loss, rb.grad_BT), tol, _BASE, fails, note)


def _grpo_golden_check(case: GoldenCase, run: PackedRun, rv: RefResult, tol: Tolerances) -> SubCheck:
    """GRPO path (token_mean, `run`; `rv` Tinker's ppo on its inputs) vs the golden
    grpo_no_dual_clip, on the domain where verl == Tinker ppo."""
    on, verl = case.mask_BT > 0, get_loss(GRPO_LOSS).golden.reference_params
    with np.errstate(over="ignore"):
        lr = np.where(on, case.lp_BT - case.mu_BT, 0.0)
        outside = on & (
            (np.abs(lr) > verl["log_ratio_clamp"]) | ((case.adv_BT < 0) & (np.exp(lr) > verl["dual_clip_c"]))
        )
    if outside.any():
        return SubCheck(
            "grpo_golden",
            True,
            f"n/a: {int(outside.sum())} tokens beyond verl's +-20 log-ratio clamp or c=1e4 dual clip, which Tinker ppo lacks; covered by the registry parity + grpo_baseline",
        )
    gold_clip = ref_ppo(case.lp_BT, case.mu_BT, case.adv_BT, case.mask_BT, "token_mean").decision_BT
    cflips = int((rv.decision_BT != gold_clip).sum())
    if cflips == 0 and case.grpo_loss is not None and case.grpo_grad_BT is not None:  # check_case: both set
        exp_loss, exp_grad, note = case.grpo_loss, case.grpo_grad_BT, "vs golden"
    else:
        exp_loss, exp_grad, note = rv.loss, rv.grad_BT, f"flips={cflips} vs independent ref on rounded inputs"
    fails = _common_failures(run)
    if case.grpo_clipfrac is not None and cflips == 0:
        n = float(case.mask_BT.sum())
        if run.metrics["ppo/clipped"] != round(case.grpo_clipfrac * (n + 1e-8)):
            fails.append("ppo/clipped differs from golden clipfrac")
    return _loss_grad_check("grpo_golden", (run.loss, run.grad_BT), (exp_loss, exp_grad), tol, _REF, fails, note)


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

"""The golden cases, regenerated from the numpy references at the registered losses' parameters.

    python -m dppo_harness.loss.golden [--check] [FILE]

For every case of FILE (default: the registered losses' golden file) and every registered loss
whose golden cases live in it, what the harness reads (`loss`, `grad_log_prob` and the decisions'
`mask`, `n_invalid_tr_tokens`, `actor/pg_clipfrac` and `clipfrac` where the case holds them) is
recomputed with the loss's reference (`LossEntry.reference` at its `params` and
`GoldenCases.reference_params`). A stored value the reference reproduces within the registry's
parity tolerance (float64 summation order) is kept as the implementation the file's `reference`
names computed it; any other is replaced; entries the harness does not read are left as they are,
and `params.dppo` follows the registered DPPO loss. The `boundary_exact` case's first two rows are
rebuilt at the registered delta unless they already sit on it (p - q exactly +-delta, just beyond
and just inside, in numpy's and torch's exp alike); a rebuilt case drops the entries no reference
here reproduces.
`--check` exits 1, naming the differing cases, when FILE is not the generator's fixed point.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence

import numpy as np

from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.loss.loss_registry import DPPO_LOSS, LOSSES, LossEntry, get_loss
from dppo_harness.project import project_root

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


def case_inputs(case: JsonObject) -> tuple[np.ndarray, ...]:
    """A case's (lp, mu, adv, mask) as float64 [B, T] arrays (KeyError, TypeError or ValueError when malformed)."""
    dims = case["shape"]
    shape = tuple(int(x) for x in dims) if isinstance(dims, list) else ()  # type: ignore[arg-type]
    keys = ("log_prob", "rollout_log_prob", "advantages", "response_mask")
    return tuple(np.asarray(case[k], dtype=np.float64).reshape(shape) for k in keys)


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

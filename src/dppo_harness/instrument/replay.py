"""Offline replay of saved loss calls with the INDEPENDENT numpy references.

    python -m dppo_harness.instrument.replay EVIDENCE_DIR

Reloads every record file of a bundle and recomputes every decision, p - q and r from the stored
tensors with `references.ref_terms` (numpy float64, nothing shared with `losses.py`); its
statistics are `terms.stats` of those independent decisions, so a disagreement can only come from
the decisions or tensors. Every decision, statistic and returned metric is compared with what was
logged, the anchor with the frozen batch when the bundle has one; it prints the counts and exits
non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dppo_harness.constants import DPPO_RATIO_CAP, PPO_EPS
from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.loss import references
from dppo_harness.loss import terms as loss_terms
from dppo_harness.loss.loss_registry import DPPO_DELTA
from dppo_harness.loss.terms import DECISION_FIELDS, DECISIONS, HIST_SIGNS, LossStats, TokenTerms
from dppo_harness.rollout.frozen_batch import FrozenBatch

# A decision may legitimately differ between two float64 exp() implementations only when p - q
# is within a few ulps of +-delta; such tokens are reported as ties, never silently accepted.
BOUNDARY_TIE = 1e-12
FLOAT_RTOL = 1e-9
FLOAT_ATOL = 1e-12


@dataclass
class RecordCheck:
    update_index: JsonValue  # the record's context update_index, else its call index
    recomputed: LossStats
    problems: list[str] = field(default_factory=list)
    ties: int = 0


def recompute(
    record: ins.LossCallRecord,
    delta: float = DPPO_DELTA,
    cap: float = DPPO_RATIO_CAP,
    eps: float = PPO_EPS,
) -> tuple[TokenTerms, LossStats]:
    """Terms and statistics of one record from the numpy references (`references.ref_terms`; their
    loss values, the only thing the normalization changes, are not compared)."""
    row = references.ref_terms(record.tensors, dppo_delta=delta, ratio_cap=cap, ppo_eps=eps)
    fields: dict[str, Any] = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in row.items()}
    terms = TokenTerms(**fields)
    return terms, loss_terms.stats(terms)


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(float(a), float(b), rel_tol=FLOAT_RTOL, abs_tol=FLOAT_ATOL)


def check_record(
    record: ins.LossCallRecord,
    delta: float = DPPO_DELTA,
    cap: float = DPPO_RATIO_CAP,
    eps: float = PPO_EPS,
) -> RecordCheck:
    """Every logged decision and statistic of one loss call against the independent recompute."""
    where = f"update {record.context.get('update_index', record.call_index)}"
    terms, stats = recompute(record, delta, cap, eps)
    check = RecordCheck(record.context.get("update_index", record.call_index), stats)
    near = np.abs(np.abs(terms.prob_diff_N.numpy()) - delta) <= BOUNDARY_TIE
    for name in DECISION_FIELDS:
        logged, replayed = np.asarray(record.tensors[name]).astype(bool), getattr(terms, name).numpy()
        if logged.shape != replayed.shape:
            check.problems.append(f"{where}: {name} has {logged.shape[0]} entries, recompute {replayed.shape[0]}")
            continue
        diff = logged != replayed
        if name == "dppo_keep_N":
            check.ties += int((diff & near).sum())
            diff &= ~near
        if diff.any():
            idx = np.flatnonzero(diff)
            check.problems.append(f"{where}: {name} differs on {idx.size} tokens (first packed index {int(idx[0])})")
    # p - q tails do not depend on any decision: always cross-checked; a tie moves counts, so the
    # decision statistics are compared only when the decisions agree exactly.
    counts = () if check.ties else LossStats.names("count")
    for key in LossStats.names("drift") + counts + (() if check.ties else LossStats.names("float")):
        same = record.stats[key] == stats[key] if key in counts else _close(record.stats[key], stats[key])
        if not same:
            check.problems.append(f"{where}: logged {key}={record.stats[key]}, replay {stats[key]}")
    if check.ties:
        return check
    for sign in HIST_SIGNS:
        if record.stats["hist"][sign] != stats["hist"][sign] or record.stats.hist.edges != stats.hist.edges:
            check.problems.append(f"{where}: logged p-q histogram (A {sign}) differs from replay")
    for key in LossStats.names(returned=True):  # what the loss itself returned to the SDK during training
        if key not in record.loss_metrics:
            check.problems.append(f"{where}: the loss did not report {key}")
        elif not _close(record.loss_metrics[key], stats[key]):
            check.problems.append(f"{where}: loss reported {key}={record.loss_metrics[key]}, replay {stats[key]}")
    return check


@dataclass
class ReplayReport:
    files: list[str]
    checks: list[RecordCheck]
    problems: list[str]
    pooled: JsonObject | None

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.checks)


def _files_dir(path: Path) -> Path:
    """Accept a run dir, its files/ dir, or an evidence root holding LATEST."""
    path = Path(path)
    if (path / "LATEST").exists() and not (path / "result.json").exists():
        path = path / (path / "LATEST").read_text().strip()
    return path / "files" if (path / "files").is_dir() else path


def load_records(files_dir: Path) -> tuple[list[str], list[ins.LossCallRecord]]:
    names, records = [], []
    for p in sorted(files_dir.glob("*.npz")):
        data = p.read_bytes()
        if ins.is_record_file(data):
            names.append(p.name)
            records.extend(ins.records_from_npz(data))
    return names, records


def _frozen_anchor_problems(files_dir: Path, records: Sequence[ins.LossCallRecord]) -> list[str]:
    """Each call's anchor, advantages, mask and tokens must be the frozen batch's, bit for bit."""
    stem = ins.FROZEN_BATCH_STEM
    npz, man = files_dir / f"{stem}.npz", files_dir / f"{stem}.manifest.json"
    if not (npz.exists() and man.exists()):
        return []
    try:
        fb = FrozenBatch.from_bytes(npz.read_bytes(), man.read_bytes())
    except Exception as exc:
        return [f"frozen batch does not load against its manifest: {exc}"]
    problems = []
    for r in records:
        seqs = r.context.get("sequence_indices")
        if seqs is None:
            continue
        parts = [fb.sequence(s) for s in seqs]
        want = {
            "sampler_logprobs_N": np.concatenate([p["logprobs"] for p in parts]),
            "advantages_N": np.concatenate([p["advantages"] for p in parts]),
            "mask_N": np.concatenate([p["mask"] for p in parts]),
            "target_tokens_N": np.concatenate([p["tokens"][1:] for p in parts]),
        }
        for name, w in want.items():
            got = r.tensors[name]
            if got.shape != w.shape or not np.array_equal(got.astype(np.float64), w.astype(np.float64)):
                problems.append(f"update {r.context.get('update_index')}: {name} differs from the frozen batch")
        if r.context.get("frozen_batch_sha256") not in (None, fb.sha256):
            problems.append(f"update {r.context.get('update_index')}: recorded frozen batch sha256 differs")
    return problems


def _pooled_problems(
    files_dir: Path, records: Sequence[ins.LossCallRecord], delta: float, cap: float, eps: float
) -> tuple[list[str], JsonObject | None]:
    """The logged pooled second-epoch analysis against a pooled recompute from the references."""
    second = [r for r in records if r.context.get("epoch") == 2]
    if not second:
        return [], None
    pooled = ins.pool_calls([recompute(r, delta, cap, eps)[0] for r in second])
    path = files_dir / ins.ANALYSIS_FILE
    if not path.exists():
        return [], pooled
    logged = json.loads(path.read_text()).get("pooled_second_epoch") or {}
    problems = []
    for key in LossStats.scalar_names():
        if key in logged and not _close(logged[key], pooled[key]):
            problems.append(f"pooled second epoch: logged {key}={logged[key]}, replay {pooled[key]}")
    return problems, pooled


def replay_bundle(path: Path) -> ReplayReport:
    files_dir = _files_dir(path)
    names, records = load_records(files_dir)
    analysis = files_dir / ins.ANALYSIS_FILE
    delta, cap, eps = DPPO_DELTA, DPPO_RATIO_CAP, PPO_EPS
    if analysis.exists():
        cfg = json.loads(analysis.read_text()).get("config", {})
        delta, cap, eps = cfg.get("delta", delta), cfg.get("ratio_cap", cap), cfg.get("ppo_eps", eps)
    checks = [check_record(r, delta, cap, eps) for r in records]
    problems = [p for c in checks for p in c.problems]
    problems += _frozen_anchor_problems(files_dir, records)
    pooled_problems, pooled = _pooled_problems(files_dir, records, delta, cap, eps)
    problems += pooled_problems
    if not records:
        problems.append(f"no loss-call record files found in {files_dir}")
    return ReplayReport(names, checks, problems, pooled)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dppo_harness.instrument.replay", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("evidence_dir", type=Path, help="run directory (or evidence root with LATEST)")
    args = parser.parse_args(argv)
    if not args.evidence_dir.exists():
        print(f"replay: {args.evidence_dir} does not exist", file=sys.stderr)
        return 2
    report = replay_bundle(args.evidence_dir)
    for c in report.checks:
        s = c.recomputed
        print(
            f"update {c.update_index}: loss tokens {s.tokens_loss}, removed {s.dppo_removed} "
            f"(+{s.dppo_removed_pos_adv}/-{s.dppo_removed_neg_adv}), exceed +{s.dppo_exceed_pos}"
            f"/-{s.dppo_exceed_neg}, cap hits {s.dppo_ratio_cap_hits}, ppo clipped {s.ppo_clipped}, "
            f"|p-q| q90 {s.drift_abs_p90:.6g} -> {'OK' if not c.problems else 'MISMATCH'}"
            + (f" ({c.ties} boundary ties)" if c.ties else "")
        )
    if report.pooled:
        p = LossStats.from_row(report.pooled)
        print(
            f"pooled second epoch: {report.pooled['calls']} calls, {p.tokens_loss} loss tokens, "
            + "".join(f"{d.verb} fraction {p[d.fraction()]:.6g}, " for d in DECISIONS)
            + f"|p-q| q90 {p.drift_abs_p90:.6g}"
        )
    for prob in report.problems:
        print(f"FAIL {prob}")
    n_ok = sum(not c.problems for c in report.checks)
    print(
        f"replay: {len(report.checks)} loss calls from {len(report.files)} files, {n_ok} matched, "
        f"{len(report.problems)} problem(s)"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

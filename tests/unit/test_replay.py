"""Offline replay: the independent padded recompute matches honest logs and catches tampering."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from diagnostic_rehearsal import simulate_records

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.instrument import replay


def update_record_name(update_index: int) -> str:
    """A file holding one update's recorded loss call alone (replay reads any record file)."""
    return f"diagnostic-update-{update_index:02d}.npz"


def _write_bundle(tmp_path: Path, records) -> Path:
    files = tmp_path / "run" / "files"
    files.mkdir(parents=True)
    for r in records:
        (files / update_record_name(r.context["update_index"])).write_bytes(ins.records_to_npz([r]))
    return tmp_path / "run"


def _tamper(path: Path, edit) -> None:
    """Rewrite one record file with `edit(arrays, meta)` applied."""
    with np.load(io.BytesIO(path.read_bytes())) as z:
        arrays = {k: z[k].copy() for k in z.files}
    meta = json.loads(bytes(arrays[ins.META_KEY]).decode())
    edit(arrays, meta)
    arrays[ins.META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    path.write_bytes(buf.getvalue())


@pytest.fixture(scope="module")
def records():
    return simulate_records(seed=3, n_updates=4, minibatches_per_epoch=2, sequences=6, drift_per_update=0.08)


def test_honest_logs_replay_clean_and_the_mask_fired(tmp_path, records, capsys):
    run = _write_bundle(tmp_path, records)
    report = replay.replay_bundle(run)
    assert report.ok, report.problems
    assert len(report.checks) == 4 and all(c.ties == 0 for c in report.checks)
    # Not a vacuous pass: the replayed run has removals on both signs and clipped tokens.
    total = {
        k: sum(c.recomputed[k] for c in report.checks)
        for k in ("dppo/removed_pos_adv", "dppo/removed_neg_adv", "ppo/clipped")
    }
    assert all(v > 0 for v in total.values()), total
    assert replay.main([str(run)]) == 0
    assert "4 matched, 0 problem(s)" in capsys.readouterr().out


def _first_loss_token(arrays, call="c0"):
    return int(np.flatnonzero(arrays[f"{call}.mask_N"] != 0)[0])


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            lambda a, m: a["c0.dppo_keep_N"].__setitem__(
                _first_loss_token(a), ~a["c0.dppo_keep_N"][_first_loss_token(a)]
            ),
            "dppo_keep_N differs",
        ),
        (
            lambda a, m: a["c0.ppo_clipped_N"].__setitem__(
                _first_loss_token(a), ~a["c0.ppo_clipped_N"][_first_loss_token(a)]
            ),
            "ppo_clipped_N differs",
        ),
        (
            lambda a, m: m["calls"][0]["stats"].__setitem__(
                "dppo/removed_neg_adv", m["calls"][0]["stats"]["dppo/removed_neg_adv"] + 1
            ),
            "logged dppo/removed_neg_adv",
        ),
        (
            lambda a, m: m["calls"][0]["stats"].__setitem__(
                "drift/abs_p99", m["calls"][0]["stats"]["drift/abs_p99"] * 0.9
            ),
            "logged drift/abs_p99",
        ),
        (lambda a, m: m["calls"][0]["loss_metrics"].__setitem__("dppo/removed", 0.0), "loss reported dppo/removed"),
    ],
    ids=["keep-bit", "clip-bit", "removed-count", "tail", "loss-metric"],
)
def test_one_corrupted_logged_decision_or_number_fails_replay(tmp_path, records, capsys, edit, needle):
    run = _write_bundle(tmp_path, records)
    target = run / "files" / update_record_name(4)
    _tamper(target, edit)
    report = replay.replay_bundle(run)
    assert not report.ok and any(needle in p for p in report.problems), report.problems
    assert replay.main([str(run)]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_empty_or_missing_dir_fails(tmp_path):
    (tmp_path / "files").mkdir()
    assert replay.main([str(tmp_path)]) == 1
    assert replay.main([str(tmp_path / "nope")]) == 2


@pytest.mark.integration  # a CLI in a subprocess: the default run, not unit parity
def test_cli_entry_point_exit_code(tmp_path, records):
    run = _write_bundle(tmp_path, records[:1])
    src = Path(__file__).parents[2] / "src"
    proc = subprocess.run(
        [sys.executable, "-m", "dppo_harness.instrument.replay", str(run)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 matched" in proc.stdout

"""The engine's training path on the diagnostic's own minibatches, in-process (no HTTP, no SDK).

    PYTHONPATH=src python benchmarks/training_path.py EVIDENCE_RUN_DIR [--updates 3] [--threads 2]
        [--no-retain]

EVIDENCE_RUN_DIR is a diagnostic bundle (`evidence/<run_id>`; its `diagnostic-frozen-batch.npz`
gives the 32 x 8 frozen batch). Per update, on minibatch k of the plan's 8 (4 complete groups,
32 sequences), it runs what `forward_backward_custom` + `optim_step` make the server do: a
zero-weight cross-entropy `forward`, a `forward_backward` on the same inputs with nonzero
weights, `optim_step` (lr 1e-2) on a fresh rank-32 LoRA client of the default preset. Prints per
call wall, user and system CPU seconds and minor page faults (fresh memory), the totals, the load
average, and a sha256 prefix per update over both passes' logprobs and the LoRA gradients: equal
prefixes between two code versions (or thread counts, or --no-retain) mean bitwise-equal results.

Environment variables such as OMP_WAIT_POLICY must be set before the run (they are read when
torch loads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dppo_harness.constants import BASE_MODEL
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.rollout.frozen_batch import FrozenBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from engine_reads import get_parameter_grads


def _usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def measured(fn):
    u0, s0, f0 = _usage()
    t0 = time.perf_counter()
    out = fn()
    u1, s1, f1 = _usage()
    return out, {"wall_s": time.perf_counter() - t0, "user_s": u1 - u0, "sys_s": s1 - s0, "minor_faults": f1 - f0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-retain", action="store_true", help="recompute the first pass in the second (the old path)")
    args = ap.parse_args()
    files = args.run_dir / "files" if (args.run_dir / "files").is_dir() else args.run_dir
    npz, manifest = files / "diagnostic-frozen-batch.npz", files / "diagnostic-frozen-batch.manifest.json"
    if not npz.is_file() or not manifest.is_file():
        sys.exit(f"{args.run_dir}: no diagnostic-frozen-batch.npz + manifest (give a diagnostic evidence run dir)")
    frozen = FrozenBatch.from_bytes(npz.read_bytes(), manifest.read_bytes())
    minibatches = frozen.split_minibatches(8)
    kwargs = {"retain_forward": False} if args.no_retain else {}
    try:
        engine = Engine(
            Path(tempfile.mkdtemp(prefix="training-path-")), num_threads=args.threads, batch_window_s=0.0, **kwargs
        )
    except TypeError:  # an engine from before retained first passes: it always recomputes
        engine = Engine(Path(tempfile.mkdtemp(prefix="training-path-")), num_threads=args.threads, batch_window_s=0.0)
    load0 = os.getloadavg()
    model = engine.create_model(BASE_MODEL, 32, 0)
    totals: dict[str, dict[str, float]] = {}
    try:
        for u in range(args.updates):
            mb = minibatches[u % len(minibatches)]
            data = []
            for d in frozen.to_datums(mb.sequence_indices):
                tokens = d.model_input.to_ints()
                targets = np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy())
                data.append((tokens, {"target_tokens": targets, "weights": np.zeros(len(tokens), np.float32)}))
            weighted = [
                (t, {**d, "weights": np.where(np.arange(len(t)) % 3 == 0, 1e-3, -1e-3).astype(np.float32)})
                for t, d in data
            ]
            (first, _), fwd = measured(lambda data=data: engine.forward(model, data, "cross_entropy"))
            (second, _), bwd = measured(lambda w=weighted: engine.forward_backward(model, w, "cross_entropy"))
            grads = get_parameter_grads(engine, model)
            _, opt = measured(lambda: engine.optim_step(model, {"learning_rate": 1e-2, "eps": 1e-8}))
            h = hashlib.sha256()
            for out in first + second:
                h.update(out["logprobs"].tobytes())
            for name in sorted(grads):
                h.update(grads[name].numpy().tobytes())
            row = {
                "update": u + 1,
                "tokens": sum(len(t) for t, _ in data),
                "forward": fwd,
                "forward_backward": bwd,
                "optim_step": opt,
                "sha256": h.hexdigest()[:16],
            }
            print(json.dumps(row), flush=True)
            for call in ("forward", "forward_backward", "optim_step"):
                for k, v in row[call].items():
                    totals.setdefault(call, {}).setdefault(k, 0.0)
                    totals[call][k] += v
    finally:
        engine.close()
    print(
        json.dumps(
            {
                "threads": args.threads,
                "retain_forward": getattr(engine, "retain_forward", False),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "totals": totals,
                "cpu_s_per_update": sum(t["user_s"] + t["sys_s"] for t in totals.values()) / max(1, args.updates),
                "loadavg_start": load0,
                "loadavg_end": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()

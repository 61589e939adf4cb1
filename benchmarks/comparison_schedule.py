"""Which arm schedule is faster: interleaved (arm after arm on one thread) or concurrent (both
arms' step at once on their own clients), on the embedded server with injected per-request
latency standing in for a remote service's round trips.

    python benchmarks/comparison_schedule.py [--latency-ms 300] [--plan PLAN.json]

Prints the wall seconds of each schedule for the same steps; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker

from dppo_harness import constants
from dppo_harness.data import gsm8k, tokenizer
from dppo_harness.local_server.process import LocalServerProcess
from dppo_harness.plans import load_plan
from dppo_harness.stages.comparison.run import make_loss, run_arm_step
from dppo_harness.train.restore import restore

ROOT = Path(__file__).parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-ms", type=float, default=300.0)
    # the size is the plan file's (default: 2 rollout steps x 2 groups, max_tokens 64)
    ap.add_argument(
        "--plan", type=Path, default=ROOT / "tests" / "fixtures" / "plans" / "comparison-ci-kill-resume.json"
    )
    args = ap.parse_args()
    run = load_plan(args.plan).spec_run
    renderer = tokenizer.make_renderer().renderer
    train = gsm8k.load_split("train", seed=0)
    faults = [f"--fault-latency-ms=*:{args.latency_ms:g}"] if args.latency_ms else []
    with tempfile.TemporaryDirectory() as tmp, LocalServerProcess(run_dir=Path(tmp), fault_args=faults) as srv:
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key=constants.LOCAL_API_KEY)
        init = (
            sc.create_lora_training_client(base_model=run.base_model, rank=32, seed=0)
            .result()
            .save_state("i")
            .result()
            .path
        )
        rows = {}
        for schedule in ("interleaved", "concurrent", "interleaved", "concurrent"):
            clients = {a.name: restore(sc, init, a.name).client for a in run.arms}
            arm_losses = {a.name: make_loss(a, run) for a in run.arms}
            tag = f"b{time.time_ns()}"
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(run.arms)) as pool:
                for step in range(run.rollout_steps):
                    items = train.batch(step, int(run.groups_per_batch.value))
                    steps = [
                        (a, step, items, renderer, arm_losses[a.name], tag) for a in run.arms
                    ]  # the same arm-step the comparison runs, arm after arm or at once
                    if schedule == "concurrent":
                        for f in [pool.submit(run_arm_step, clients[s[0].name], s[0], run, *s[1:]) for s in steps]:
                            f.result()
                    else:
                        for s in steps:
                            run_arm_step(clients[s[0].name], s[0], run, *s[1:])
            wall = time.perf_counter() - t0
            rows.setdefault(schedule, []).append(wall)
            print(
                f"{schedule:12s} {run.rollout_steps} steps x 2 arms: {wall:.1f}s "
                f"(latency {args.latency_ms:g} ms/request, {int(run.groups_per_batch.value)} groups x 8, max_tokens {int(run.max_tokens.value)})",
                flush=True,
            )
        # tinker 0.25 has no close: the server stops with the benchmark
    for k, v in rows.items():
        print(f"{k}: best {min(v):.1f}s of {len(v)} runs")


if __name__ == "__main__":
    main()

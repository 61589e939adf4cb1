"""Service round trips and seconds per update of the training core, with injected latency.

Starts the embedded server as a child process with `--fault-latency-ms *:MS` (every request,
retrieve_future polls included, waits MS before it is handled), samples one GSM8K batch
(the short diagnostic plan's shape: 4 groups x 4, max_tokens 96, 2 minibatches of 2 groups),
then runs the diagnostic's update call shape on a fresh training client per schedule:
`train_step.train_step` with a persist hook (the recorded loss, persisted before the optimizer
step) and a sentinel forward (8 fixed sequences, `cross_entropy`, weight 0) after every update.

- `--schedule sequential`: the old loop, every call awaited before the next is submitted;
- `--schedule pipelined`: optim_step and the sentinel forward submitted behind the custom loss,
  the sentinel awaited after the next update (what the diagnostic does now);
- `--schedule both` (default): both, one after the other, on the same server and sampled batch.

Requests are counted from the server's request log (one line per HTTP request: method, path,
status, ms), between the first update's submission and the last result. Printed per schedule:
requests per update (total and by path) and seconds per update, then one JSON line.

    PYTHONPATH=src python benchmarks/round_trips.py                    # 300 ms, 8 updates, both
    PYTHONPATH=src python benchmarks/round_trips.py --latency-ms 0 --updates 4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np
import tinker
from tinker import types

from dppo_harness import constants
from dppo_harness.instrument import instrumentation
from dppo_harness.local_server.process import LocalServerProcess
from dppo_harness.loss import losses
from dppo_harness.train import train_step
from dppo_harness.train.clients import make_datum

REQUEST_LINE = re.compile(r"dppo_harness\.local_server\.requests (\w+) (\S+) (\d+) ([\d.]+)ms")


def request_lines(log: Path, start: int) -> tuple[list[tuple[str, str]], int]:
    """(method, path) of the request-log lines after byte offset `start`, and the new offset."""
    data = log.read_bytes()
    lines = data[start:].decode(errors="replace").splitlines()
    return [(m.group(1), m.group(2)) for m in map(REQUEST_LINE.search, lines) if m], len(data)


def sampled_datums(sc: tinker.ServiceClient, groups: int, group_size: int, max_tokens: int) -> list[types.Datum]:
    """One sampled GSM8K batch in the harness datum layout (group-mean-centred advantages)."""
    from dppo_harness.data import gsm8k
    from dppo_harness.data.tokenizer import make_renderer

    renderer = make_renderer().renderer
    tc = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=8, seed=1)
    sampler = tc.save_weights_and_get_sampling_client()
    data = []
    for g, item in enumerate(gsm8k.load_split("train", seed=0).batch(0, groups)):
        ob, stop = gsm8k.build_prompt(item, renderer)
        res = sampler.sample(
            ob, group_size, types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=stop, seed=g)
        ).result()
        rewards = [gsm8k.grade_response(item, renderer, s.tokens).reward for s in res.sequences]
        prompt = ob.to_ints()
        for s, a in zip(res.sequences, np.asarray(rewards) - np.mean(rewards), strict=True):
            tokens, n_prompt = prompt + list(s.tokens), len(prompt) - 1
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * n_prompt + list(s.logprobs),
                        "advantages": [0.0] * n_prompt + [float(a)] * len(s.tokens),
                        "mask": np.array([0.0] * n_prompt + [1.0] * len(s.tokens), dtype=np.float32),
                    },
                )
            )
    return data


def run_schedule(
    sc: tinker.ServiceClient,
    log: Path,
    data: list[types.Datum],
    args: argparse.Namespace,
    sequential: bool,
    persist_dir: Path,
) -> dict:
    tc = sc.create_lora_training_client(base_model=constants.BASE_MODEL, rank=args.rank, seed=0)
    cfg = losses.LossConfig(loss="dppo_divergence_mask", normalization="token_mean")
    recorder, loss_fn = instrumentation.LossCallRecorder(cfg), losses.make_loss_fn(cfg)
    adam = tinker.AdamParams(learning_rate=2e-5, beta1=0.9, beta2=0.95, eps=1e-8)
    per_mb = len(data) // 2
    minibatches = [data[:per_mb], data[per_mb:]]
    sentinel = [
        make_datum(
            d.model_input.to_ints()[:1],
            d.model_input.to_ints()[1:] + [d.loss_fn_inputs["target_tokens"].data[-1]],
            completion_weight=0.0,
        )
        for d in data[:: max(1, len(data) // 8)][:8]
    ]

    def persist(rec: instrumentation.LossCallRecord) -> None:
        (persist_dir / f"update-{rec.call_index:04d}.npz").write_bytes(instrumentation.records_to_npz([rec]))

    _, offset = request_lines(log, 0)
    seconds, pending = [], None
    t_all = time.perf_counter()
    for u in range(args.updates):
        t0 = time.perf_counter()
        _, upd = train_step.train_step(
            tc,
            minibatches[u % 2],
            loss_fn,
            adam,
            recorder,
            {"update_index": u + 1},
            persist=persist,
            sequential=sequential,
            submit_behind=lambda: tc.forward(sentinel, "cross_entropy"),
        )
        if sequential:
            upd.behind.result()  # the old loop awaited the sentinel forward before the next update
        else:
            if pending is not None:
                pending.result()  # the previous update's sentinel, deferred like the diagnostic
            pending = upd.behind
        seconds.append(time.perf_counter() - t0)
    if pending is not None:
        pending.result()
    wall = time.perf_counter() - t_all
    time.sleep(0.5)  # let the server flush the last log lines
    lines, _ = request_lines(log, offset)
    by_path = collections.Counter(f"{m} {p}" for m, p in lines)
    return {
        "schedule": "sequential" if sequential else "pipelined",
        "updates": args.updates,
        "requests": len(lines),
        "requests_per_update": len(lines) / args.updates,
        "requests_per_update_by_path": {k: v / args.updates for k, v in sorted(by_path.items())},
        "seconds_per_update": wall / args.updates,
        "seconds_each": seconds,
        "seconds_median": statistics.median(seconds),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=("sequential", "pipelined", "both"), default="both")
    p.add_argument("--latency-ms", type=float, default=300.0, help="injected per request (all kinds)")
    p.add_argument("--updates", type=int, default=8, help="updates per round")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --schedule both: alternate the schedules this many times (sequential first, "
        "then pipelined, ...), so machine-load drift hits both alike",
    )
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--model", default=None, help="engine model preset (default: the server's default)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-round-trips-"))
    faults = ["--fault-latency-ms", f"*:{args.latency_ms:g}"] if args.latency_ms > 0 else []
    figures: dict = {"shape": vars(args).copy(), "runs": []}
    with LocalServerProcess(run_dir=work / "server", model=args.model, fault_args=faults) as server:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=constants.LOCAL_API_KEY)
        data = sampled_datums(sc, args.groups, args.group_size, args.max_tokens)
        figures["shape"]["sequences"] = len(data)
        schedules = [True, False] * args.rounds if args.schedule == "both" else [args.schedule == "sequential"]
        for i, sequential in enumerate(schedules):
            persist_dir = work / f"{'seq' if sequential else 'pipe'}-{i}"
            persist_dir.mkdir()
            r = run_schedule(sc, server.log_path, data, args, sequential, persist_dir)
            figures["runs"].append(r)
            paths = ", ".join(f"{k} {v:.2f}" for k, v in r["requests_per_update_by_path"].items())
            print(
                f"{r['schedule']:>10}: {r['requests_per_update']:.2f} requests/update, "
                f"{r['seconds_per_update']:.2f} s/update (median {r['seconds_median']:.2f} s) over "
                f"{r['updates']} updates at {args.latency_ms:g} ms/request  [{paths}]",
                flush=True,
            )
        # tinker 0.25 has no close: the server stops with the benchmark
    for name in ("sequential", "pipelined"):
        runs = [r for r in figures["runs"] if r["schedule"] == name]
        if len(runs) > 1:
            n = sum(r["updates"] for r in runs)
            agg = {
                "updates": n,
                "requests_per_update": sum(r["requests"] for r in runs) / n,
                "seconds_per_update": sum(r["seconds_per_update"] * r["updates"] for r in runs) / n,
            }
            figures[name] = agg
            print(
                f"{name:>10} (all {len(runs)} rounds): {agg['requests_per_update']:.2f} requests/update, "
                f"{agg['seconds_per_update']:.2f} s/update over {n} updates",
                flush=True,
            )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()

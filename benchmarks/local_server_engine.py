"""Engine-level figures at the bounded-diagnostic shape (in-process, no HTTP).

Wall times depend on machine load (printed); process CPU seconds much less so. Prints: engine start time, sampling tokens/s for 32 GSM8K train prompts x 8 samples at temperature 1
with max_tokens 512, the rollout signal (groups with non-constant cookbook reward), and seconds per
"forward_backward_custom + optim_step" (2 server passes: CE forward, CE forward+backward) on a
minibatch of 4 groups (32 sequences) of those rollouts, and the load average while measuring.

    PYTHONPATH=src python benchmarks/local_server_engine.py [--updates 4] [--model tiny-qwen3-gsm8k]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dppo_harness.local_server.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from warm_start_signal import signal_rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3-gsm8k")
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--groups", type=int, default=32)
    args = ap.parse_args()
    load0 = os.getloadavg()
    t0 = time.time()
    eng = Engine(Path(tempfile.mkdtemp(prefix="engine-bench-")), model_name=args.model, batch_window_s=0.2)
    start_s = time.time() - t0
    print(
        json.dumps(
            {
                "engine_start_seconds": start_s,
                "threads": torch.get_num_threads(),
                "base_info": {k: v for k, v in eng.base_info.items() if k != "key"},
            }
        )
    )
    try:
        c0 = time.process_time()
        res = signal_rate(eng, n_groups=args.groups, group_size=8, max_tokens=512)
        res["sample_process_cpu_seconds"] = time.process_time() - c0
        rewards = res.pop("rewards")
        print(json.dumps({"sampling": res}))
        # Minibatch of 4 groups, re-sampled sequences rebuilt as datums (prompt + response).
        from dppo_harness.constants import BASE_MODEL, STOP_TOKEN_ID
        from dppo_harness.data import gsm8k
        from dppo_harness.local_server.vocab import get_renderer

        renderer = get_renderer()
        items = gsm8k.load_split("train", seed=0).batch(0, 4)
        data = []
        for g, it in enumerate(items):
            prompt = gsm8k.build_prompt(it, renderer)[0].to_ints()
            for s in eng.sample(BASE_MODEL, prompt, 8, 512, 1.0, -1, 1.0, [STOP_TOKEN_ID], [], g, False):
                toks = prompt + s.tokens
                T = len(toks) - 1
                data.append((toks[:-1], {"target_tokens": np.asarray(toks[1:]), "weights": np.zeros(T, np.float32)}))
        mean_len = float(np.mean([len(t) for t, _ in data]))
        mid = eng.create_model(BASE_MODEL, 32, 0)
        times, cpu = [], []
        for _ in range(args.updates):
            t, c = time.time(), time.process_time()
            eng.forward(mid, data, "cross_entropy")
            eng.forward_backward(
                mid, [(t_, {**d, "weights": np.full(len(t_), 1e-3, np.float32)}) for t_, d in data], "cross_entropy"
            )
            eng.optim_step(mid, {"learning_rate": 1e-5, "eps": 1e-8})
            times.append(time.time() - t)
            cpu.append(time.process_time() - c)
        print(
            json.dumps(
                {
                    "update": {
                        "sequences": len(data),
                        "mean_tokens": mean_len,
                        "seconds_per_update": times,
                        "median_seconds": float(np.median(times)),
                        "process_cpu_seconds_per_update": cpu,
                    },
                    "loadavg_start": load0,
                    "loadavg_end": os.getloadavg(),
                }
            )
        )
        projected = res["sample_seconds"] + 16 * float(np.median(times))
        print(
            json.dumps(
                {
                    "projected_diagnostic_seconds(sample + 16 updates)": projected,
                    "nonconstant_groups": res["nonconstant_groups"],
                    "groups": len(rewards),
                }
            )
        )
    finally:
        eng.close()


if __name__ == "__main__":
    main()

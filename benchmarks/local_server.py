"""Benchmark the embedded server through HTTP with the stock tinker SDK.

Figures (printed, plus one JSON line at the end):
- server start time (the shipped warm start is loaded: no cache to be cold or warm);
- sampling throughput: G GSM8K train prompts x S samples, max_tokens, temperature 1, every request
  in flight together (the rollout shape of the bounded diagnostic);
- seconds per forward_backward_custom (harness DPPO loss) + optim_step on a minibatch of M groups.

    PYTHONPATH=src python benchmarks/local_server.py              # full shape: 32 x 8, 512, M=4
    PYTHONPATH=src python benchmarks/local_server.py --groups 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np
import tinker
from tinker import types

from dppo_harness import constants
from dppo_harness.local_server.process import LocalServerProcess
from dppo_harness.train.train_step import minibatch_update


def gsm8k_prompts(n: int) -> tuple[list, list, list, object]:
    from dppo_harness.data import gsm8k
    from dppo_harness.data.tokenizer import make_renderer

    renderer = make_renderer().renderer
    items = gsm8k.load_split("train", seed=0).batch(0, n)
    built = [gsm8k.build_prompt(item, renderer) for item in items]
    return list(items), [b[0] for b in built], [b[1] for b in built], renderer


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--minibatch-groups", type=int, default=4)
    p.add_argument("--updates", type=int, default=3, help="timed forward_backward_custom + optim_step rounds")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--model", default=None, help="engine model preset (default: the server's default)")
    args = p.parse_args(argv)
    figures: dict = {"shape": vars(args).copy()}
    work = Path(tempfile.mkdtemp(prefix="bench-local-server-"))

    # 1. start time ----------------------------------------------------------------------------
    server = LocalServerProcess(run_dir=work / "server", model=args.model).start()
    figures["start_s"] = float(server.start_seconds or 0.0)
    print(f"server start : {figures['start_s']:8.1f} s", flush=True)

    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=constants.LOCAL_API_KEY)
        tc = client.create_lora_training_client(base_model=constants.BASE_MODEL, rank=args.rank, seed=0)
        sampler = tc.save_weights_and_get_sampling_client()

        # 2. sampling throughput -----------------------------------------------------------------
        items, prompts, stops, renderer = gsm8k_prompts(args.groups)
        t0 = time.perf_counter()
        futures = [
            sampler.sample(
                ob,
                args.group_size,
                types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=stop, seed=g),
            )
            for g, (ob, stop) in enumerate(zip(prompts, stops))
        ]
        results = [f.result() for f in futures]
        sample_s = time.perf_counter() - t0
        n_tokens = sum(len(s.tokens) for r in results for s in r.sequences)
        n_stop = sum(s.stop_reason == "stop" for r in results for s in r.sequences)
        figures["sampling"] = {
            "seconds": sample_s,
            "tokens": n_tokens,
            "tokens_per_s": n_tokens / sample_s,
            "sequences": args.groups * args.group_size,
            "stopped": n_stop,
        }
        print(
            f"sampling {args.groups}x{args.group_size}, max_tokens {args.max_tokens}: {n_tokens} tokens in "
            f"{sample_s:.1f} s = {n_tokens / sample_s:.0f} tokens/s ({n_stop} stopped early)",
            flush=True,
        )

        # 3. forward_backward_custom + optim_step on a minibatch ---------------------------------
        from dppo_harness.data import gsm8k
        from dppo_harness.loss.losses import LossConfig, make_loss_fn

        data = []
        m = args.minibatch_groups
        for item, ob, res in zip(items[:m], prompts[:m], results[:m]):
            rewards = [gsm8k.grade_response(item, renderer, s.tokens).reward for s in res.sequences]
            adv = np.asarray(rewards) - np.mean(rewards)
            prompt = ob.to_ints()
            for s, a in zip(res.sequences, adv):
                tokens = prompt + list(s.tokens)
                n_prompt = len(prompt) - 1
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
        loss_fn = make_loss_fn(LossConfig(loss="dppo_divergence_mask", normalization="token_mean"))
        adam = types.AdamParams(learning_rate=1e-5, eps=1e-8)
        times = [minibatch_update(tc, data, loss_fn, adam).seconds for _ in range(args.updates)]
        n_train_tokens = sum(d.model_input.length for d in data)
        figures["update"] = {
            "sequences": len(data),
            "tokens": n_train_tokens,
            "seconds_each": times,
            "seconds_mean": statistics.mean(times),
        }
        print(
            f"forward_backward_custom + optim_step, {len(data)} sequences / {n_train_tokens} tokens: "
            f"mean {statistics.mean(times):.2f} s over {len(times)} (each {', '.join(f'{t:.2f}' for t in times)})",
            flush=True,
        )
        # tinker 0.25 has no close: the server stops with the benchmark
    finally:
        server.stop()
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()

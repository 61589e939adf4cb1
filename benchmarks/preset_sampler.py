"""Process CPU seconds of the preset sampler at a diagnostic-like shape (in-process, no HTTP).

GSM8K train prompts in cookbook order, rendered as the diagnostic renders them; each request
`--samples` samples of up to `--max-tokens` tokens at temperature 1, stopping at <|im_end|>; all
requests decoded as one batch (`Engine._decode_batch`), `--reps` times. Prints one JSON line:
CPU and wall seconds per repetition, new tokens, the load average, and the sha256 of every
sampled token and logprob (two versions that sample the same bits print the same one). CPU seconds depend much less on
the machine's load than wall seconds; compare two versions by alternating runs.

    PYTHONPATH=src python benchmarks/preset_sampler.py [--model tiny-qwen3-gsm8k] [--prompts 8] [--samples 8]
        [--max-tokens 128] [--reps 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from dppo_harness.constants import STOP_TOKEN_ID
from dppo_harness.data import gsm8k
from dppo_harness.local_server.engine import engine
from dppo_harness.local_server.vocab import get_renderer, prompt_messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3-gsm8k")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    eng = engine.Engine(
        Path(tempfile.mkdtemp(prefix="preset-sampler-")), model_name=a.model, seed=0, batch_window_s=0.0
    )
    try:
        net, renderer = eng._sampler_net("base"), get_renderer()
        items = gsm8k.load_split("train", seed=0).batch(0, a.prompts)
        prompts = [renderer.build_generation_prompt(prompt_messages(it.question)).to_ints() for it in items]
        runs = []
        for _ in range(a.reps):
            jobs = [
                engine._SampleJob(
                    key="base",
                    prompt=p,
                    n=a.samples,
                    max_tokens=a.max_tokens,
                    temperature=1.0,
                    top_k=-1,
                    top_p=1.0,
                    stop_ids=[STOP_TOKEN_ID],
                    stop_strings=[],
                    seed=100 + i,
                    want_prompt_lp=False,
                )
                for i, p in enumerate(prompts)
            ]
            c, t = time.process_time(), time.perf_counter()
            res = eng._decode_batch(net, jobs)
            runs.append(
                {
                    "cpu_s": round(time.process_time() - c, 2),
                    "wall_s": round(time.perf_counter() - t, 2),
                    "tokens": sum(len(s.tokens) for q in res for s in q),
                }
            )
        digest = hashlib.sha256(json.dumps([[[s.tokens, s.logprobs] for s in q] for q in res]).encode()).hexdigest()
        print(
            json.dumps(
                {
                    "engine": engine.__file__,
                    "model": a.model,
                    "shape": [a.prompts, a.samples, a.max_tokens],
                    "runs": runs,
                    "samples_sha256": digest,
                    "loadavg": os.getloadavg(),
                }
            )
        )
    finally:
        eng.close()


if __name__ == "__main__":
    main()

"""How much a sampled row depends on the batch it ran in (embedded server, preset sampler).

The same seeded request is decoded alone and batched with the other requests (engine
`Engine._decode_batch`, base weights of the default preset, temperature 1); prints, as one JSON line, how
many target rows got other tokens, how many got logprobs that are not bitwise equal, and the
largest |logprob difference| over the common token prefix. `--same-length` cuts or extends the
companions to the target's prompt length, so only the batch's rows differ (no padding).
`--per-request-cost` instead times the whole shape batched vs every request decoded alone.

    PYTHONPATH=src python benchmarks/sampler_batch_invariance.py --prompts 8 --samples 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dppo_harness.constants import STOP_TOKEN_ID
from dppo_harness.data import gsm8k
from dppo_harness.local_server.engine.engine import Engine, _SampleJob
from dppo_harness.local_server.vocab import get_renderer, prompt_messages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--targets", type=int, default=None, help="requests checked alone vs batched (default: all)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--same-length", action="store_true")
    p.add_argument("--per-request-cost", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(2)
    eng = Engine(Path(tempfile.mkdtemp()), model_name="tiny-qwen3-gsm8k", seed=0, batch_window_s=0.0)
    net, renderer = eng._sampler_net("base"), get_renderer()
    items = gsm8k.load_split("train", seed=0).batch(0, a.prompts)
    prompts = [renderer.build_generation_prompt(prompt_messages(it.question)).to_ints() for it in items]

    def job(i: int, length: int | None = None) -> _SampleJob:
        prompt = prompts[i] if length is None else (prompts[i] * (length // len(prompts[i]) + 1))[:length]
        return _SampleJob(
            key="base",
            prompt=prompt,
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

    def run(jobs: list[_SampleJob]):
        return eng._decode_batch(net, jobs)

    if a.per_request_cost:
        out = {}
        for mode in ("batched", "per_request", "batched"):
            t0 = time.perf_counter()
            res = (
                run([job(i) for i in range(len(prompts))])
                if mode == "batched"
                else [run([job(i)])[0] for i in range(len(prompts))]
            )
            dt = time.perf_counter() - t0
            ntok = sum(len(s.tokens) for seqs in res for s in seqs)
            out.setdefault(mode, []).append(
                {"seconds": round(dt, 2), "tokens": ntok, "tokens_per_s": round(ntok / dt, 1)}
            )
        print(json.dumps({"shape": [a.prompts, a.samples, a.max_tokens], **out}))
        return
    tot = {"rows": 0, "rows_other_tokens": 0, "rows_logprobs_not_bitwise_equal": 0, "max_abs_logprob_diff": 0.0}
    for t in range(a.targets or len(prompts)):
        alone = run([job(t)])[0]
        length = len(prompts[t]) if a.same_length else None
        others = [job(i, length) for i in range(len(prompts)) if i != t]
        half = len(others) // 2
        batched = run(others[:half] + [job(t)] + others[half:])[half]
        for sa, sb in zip(alone, batched, strict=True):
            tot["rows"] += 1
            tot["rows_other_tokens"] += sa.tokens != sb.tokens
            tot["rows_logprobs_not_bitwise_equal"] += sa.logprobs != sb.logprobs
            n = next(
                (k for k, (x, y) in enumerate(zip(sa.tokens, sb.tokens)) if x != y), min(len(sa.tokens), len(sb.tokens))
            )
            if n:
                d = max(abs(x - y) for x, y in zip(sa.logprobs[:n], sb.logprobs[:n]))
                tot["max_abs_logprob_diff"] = max(tot["max_abs_logprob_diff"], d)
    print(json.dumps({"same_length": a.same_length, "shape": [a.prompts, a.samples, a.max_tokens], **tot}))


if __name__ == "__main__":
    main()

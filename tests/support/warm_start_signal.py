"""Whether the warm-started stand-in carries the RL signal the diagnostic needs (its test and
benchmarks/local_server_engine.py measure it)."""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

from dppo_harness.constants import BASE_MODEL, STOP_TOKEN_ID
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.vocab import get_renderer


def signal_rate(
    engine: Engine,
    n_groups: int = 32,
    group_size: int = 8,
    max_tokens: int = 512,
    temperature: float = 1.0,
    sample_seed: int = 0,
    shuffle_seed: int = 0,
) -> dict:
    """Sample the first ``n_groups`` GSM8K train prompts (cookbook order) x ``group_size`` from the
    engine's base model and score them with the cookbook MathEnv reward. Returns counts, including
    how many groups have non-constant rewards (the RL signal the diagnostic needs)."""
    from dppo_harness.data import gsm8k  # imports tinker and the cookbook's math env: kept off the server's start

    renderer = get_renderer()
    items = gsm8k.load_split("train", seed=shuffle_seed).batch(0, n_groups)
    prompts = [gsm8k.build_prompt(it, renderer)[0].to_ints() for it in items]
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=n_groups) as pool:
        sample = functools.partial(engine.sample, temperature=temperature, stop_token_ids=[STOP_TOKEN_ID])
        futs = [
            pool.submit(sample, BASE_MODEL, p, group_size, max_tokens, seed=sample_seed + g)
            for g, p in enumerate(prompts)
        ]
        groups = [f.result() for f in futs]
    seconds = time.time() - t0
    rewards, fmt, correct, stops, n_tokens = [], 0, 0, 0, 0
    for it, seqs in zip(items, groups, strict=True):
        graded = [gsm8k.grade_response(it, renderer, s.tokens) for s in seqs]
        rewards.append([g.reward for g in graded])
        fmt += sum(g.format_ok for g in graded)
        correct += sum(g.correct for g in graded)
        stops += sum(s.stop_reason == "stop" for s in seqs)
        n_tokens += sum(len(s.tokens) for s in seqs)
    nonconst = sum(len(set(r)) > 1 for r in rewards)
    n = n_groups * group_size
    return {
        "groups": n_groups,
        "group_size": group_size,
        "nonconstant_groups": nonconst,
        "format_ok": fmt,
        "correct": correct,
        "stopped": stops,
        "samples": n,
        "sampled_tokens": n_tokens,
        "sample_seconds": seconds,
        "tokens_per_second": n_tokens / seconds,
        "rewards": rewards,
    }

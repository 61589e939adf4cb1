"""sha256 fingerprints of what a preset engine computes, to prove a refactor left its numbers bitwise alone.

`preset_fingerprint(model_name, run_dir)` drives one `Engine` through a fixed script and hashes four
sections separately:
- `training`: `forward` (cross_entropy) and `forward_backward` (importance_sampling, then ppo)
  outputs on three GSM8K-prompt datums of different lengths (one with an out-of-vocabulary id),
  plus the accumulated LoRA gradients;
- `optim`: the `optim_step` metrics (clipping engaged), the LoRA weights after it and a `forward`
  on them;
- `sampling`: tokens, logprobs and stop reasons of seeded batches that mix prompt lengths, sample
  counts, temperature 0 / 1 / 0.7, top_k, top_p, stop tokens and stop strings, from the base
  weights and from the trained sampler weights, plus one request through the engine's queue;
- `prompt_logprobs`: the prompt logprobs those requests asked for.

Every float is hashed as its exact bytes, so any change in any output changes the section's hash.
The figures hold for one torch build, CPU capability and thread count (all recorded), and one set
of CPU kernels: two machines with the same torch and capability can still round differently (BLAS
blocking follows the CPU model and its caches), so `platform_sha256` hashes what plain torch
computes on this machine (the matmul shapes, softmax, attention, backward and AdamW step the presets
use, no harness code). Where it differs from the pin's, the pin says nothing about this machine.

    python -m dppo_harness.local_server.fingerprint --model tiny-qwen3-random
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dppo_harness.constants import BASE_MODEL, STOP_TOKEN_ID
from dppo_harness.local_server.engine.engine import Engine, SampledSeq, _SampleJob
from dppo_harness.local_server.engine.trainer import FwdBwdOut
from dppo_harness.local_server.vocab import Vocab, get_renderer, prompt_messages

THREADS = 2
QUESTIONS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "What is 3 + 4?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
)
OOV_REAL_ID = 200_000  # a Qwen3.5 id outside the restricted vocabulary (checked below)


@dataclass(frozen=True)
class Fingerprint:
    model: str
    base_sha256: str  # the preset's base weights (the warm start for tiny-qwen3-gsm8k)
    torch: str
    cpu_capability: str
    threads: int
    platform_sha256: str  # plain torch kernels on this machine (platform_sha256())
    sections: dict[str, str]
    coverage: dict[str, int]  # sampled rows per way of finishing: length, stop (token id), stop_string


class _Hasher:
    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def add(self, key: str, value: object) -> None:
        self.h.update(json.dumps(key).encode())
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray):
            self.h.update(json.dumps([str(value.dtype), list(value.shape)]).encode())
            self.h.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, float):
            self.h.update(np.float64(value).tobytes())
        else:
            self.h.update(json.dumps(value).encode())

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def platform_sha256(threads: int = THREADS) -> str:
    """sha256 of plain torch kernels on this machine at `threads` threads: float32 matmuls in the
    presets' shapes (hidden 64/128, MLP 128/384, heads 32, the restricted vocabulary's width),
    log-softmax, grouped attention, a linear layer's backward and an AdamW step. It depends on the
    torch build and the CPU's kernels only, never on harness code."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        hs = _Hasher()
        for rows in (1, 7, 64, 333):
            for k, n in ((64, 128), (128, 384), (384, 128), (128, 64), (32, 32), (128, 4000)):
                a, b = torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g)
                hs.add(f"mm{rows}x{k}x{n}", a @ b)
        logits = torch.randn(9, 4000, generator=g) * 3
        hs.add("log_softmax", torch.log_softmax(logits, dim=-1))
        q, kv = torch.randn(2, 4, 37, 32, generator=g), torch.randn(2, 2, 37, 32, generator=g)
        hs.add(
            "sdpa",
            torch.nn.functional.scaled_dot_product_attention(
                q, kv.repeat_interleave(2, dim=1), kv.flip(-1).repeat_interleave(2, dim=1), is_causal=True
            ),
        )
        layer = torch.nn.Linear(128, 384)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(384, 128, generator=g) * 0.02)
            layer.bias.zero_()
        x = torch.randn(50, 128, generator=g)
        loss = torch.log_softmax(layer(x), dim=-1)[:, 0].mean()
        loss.backward()
        hs.add("grad_w", layer.weight.grad)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.01)
        opt.step()
        hs.add("adamw", layer.weight)
        return hs.hexdigest()
    finally:
        torch.set_num_threads(prev)


def _prompts() -> list[list[int]]:
    renderer = get_renderer()
    return [renderer.build_generation_prompt(prompt_messages(q)).to_ints() for q in QUESTIONS]


def _datums(prompts: list[list[int]]) -> list[list[int]]:
    seqs = [prompts[0][:90], prompts[1], prompts[2][:70]]
    seqs[1] = seqs[1][:20] + [OOV_REAL_ID] + seqs[1][20:]
    return seqs


def _train_inputs(seqs: list[list[int]], kind: str) -> list[tuple[list[int], dict[str, np.ndarray]]]:
    rng = np.random.default_rng(7)
    out = []
    for s in seqs:
        T = len(s) - 1
        inp = {"target_tokens": np.asarray(s[1:], np.int64)}
        if kind == "cross_entropy":
            inp["weights"] = rng.uniform(0.0, 1.0, T).astype(np.float32)
        else:
            inp["logprobs"] = rng.normal(-4.0, 1.0, T).astype(np.float32)
            inp["advantages"] = rng.normal(0.0, 1.0, T).astype(np.float32)
        out.append((s[:-1], inp))
    return out


def _add_outputs(hs: _Hasher, tag: str, res: FwdBwdOut) -> None:
    outputs, metrics = res
    for i, o in enumerate(outputs):
        for k in sorted(o):
            hs.add(f"{tag}/{i}/{k}", np.asarray(o[k]))
    for k in sorted(metrics):
        hs.add(f"{tag}/metric/{k}", float(metrics[k]))


def _probe(eng: Engine, prompts: list[list[int]], key: str) -> tuple[list[int], str]:
    """Stop ids and a stop string taken from seeded draws of the same prompts and seeds, so the
    batch below has rows that stop on a token id, rows that stop on a string and rows that run to
    max_tokens (random weights never emit <|im_end|>)."""
    net = eng._sampler_net(key)
    a = eng._decode_batch(
        net,
        [
            _SampleJob(
                key=key,
                prompt=prompts[0],
                n=4,
                max_tokens=12,
                temperature=1.0,
                top_k=-1,
                top_p=1.0,
                stop_ids=[],
                stop_strings=[],
                seed=11,
                want_prompt_lp=False,
            )
        ],
    )[0]
    b = eng._decode_batch(
        net,
        [
            _SampleJob(
                key=key,
                prompt=prompts[1],
                n=3,
                max_tokens=8,
                temperature=0.7,
                top_k=20,
                top_p=1.0,
                stop_ids=[],
                stop_strings=[],
                seed=12,
                want_prompt_lp=False,
            )
        ],
    )[0]
    text = eng._decode_text([b[0].tokens[4]]) or eng._decode_text(b[0].tokens[4:6])
    return [a[0].tokens[3], a[1].tokens[9]], text


def _jobs(prompts: list[list[int]], key: str, stop_ids: list[int], stop_string: str) -> list[_SampleJob]:
    """One batch: different prompt lengths, sample counts and sampling settings."""
    p0, p1, p2 = prompts
    return [
        _SampleJob(
            key=key,
            prompt=p0,
            n=4,
            max_tokens=24,
            temperature=1.0,
            top_k=-1,
            top_p=1.0,
            stop_ids=[STOP_TOKEN_ID, *stop_ids],
            stop_strings=[],
            seed=11,
            want_prompt_lp=True,
        ),
        _SampleJob(
            key=key,
            prompt=p1,
            n=3,
            max_tokens=16,
            temperature=0.7,
            top_k=20,
            top_p=1.0,
            stop_ids=[STOP_TOKEN_ID],
            stop_strings=[stop_string],
            seed=12,
            want_prompt_lp=False,
        ),
        _SampleJob(
            key=key,
            prompt=p2,
            n=2,
            max_tokens=20,
            temperature=1.0,
            top_k=-1,
            top_p=0.9,
            stop_ids=[],
            stop_strings=[],
            seed=13,
            want_prompt_lp=True,
        ),
        _SampleJob(
            key=key,
            prompt=p1[:12],
            n=2,
            max_tokens=8,
            temperature=0.0,
            top_k=-1,
            top_p=1.0,
            stop_ids=[STOP_TOKEN_ID],
            stop_strings=[],
            seed=14,
            want_prompt_lp=False,
        ),
    ]


def _add_samples(
    hs: _Hasher,
    hp: _Hasher,
    tag: str,
    jobs: list[_SampleJob],
    results: list[list[SampledSeq]],
    coverage: dict[str, int],
) -> None:
    for j, seqs in enumerate(results):
        for r, s in enumerate(seqs):
            how = "stop_string" if s.stop_reason == "stop" and s.tokens[-1] not in jobs[j].stop_ids else s.stop_reason
            coverage[how] = coverage.get(how, 0) + 1
            hs.add(f"{tag}/{j}/{r}/tokens", s.tokens)
            hs.add(f"{tag}/{j}/{r}/logprobs", np.asarray(s.logprobs, np.float64))
            hs.add(f"{tag}/{j}/{r}/stop_reason", s.stop_reason)
            if s.prompt_logprobs is not None:
                hp.add(f"{tag}/{j}/{r}", np.asarray([np.nan if x is None else x for x in s.prompt_logprobs]))


def run_script(eng: Engine, coverage: dict[str, int]) -> dict[str, str]:
    """The fixed script on a fresh engine; section -> sha256. `coverage` receives the count of
    sampled rows per stop reason."""
    if not isinstance(eng.vocab, Vocab):
        raise TypeError("the fingerprint script runs on a preset's restricted vocabulary")
    if OOV_REAL_ID in eng.vocab:
        raise RuntimeError(f"{OOV_REAL_ID} is in the restricted vocabulary; pick another out-of-vocabulary id")
    prompts = _prompts()
    seqs = _datums(prompts)
    train, optim, samp, plp = _Hasher(), _Hasher(), _Hasher(), _Hasher()
    mid = eng.create_model(BASE_MODEL, 8, 0)
    _add_outputs(train, "forward", eng.forward(mid, _train_inputs(seqs, "cross_entropy"), "cross_entropy"))
    _add_outputs(train, "fb/is", eng.forward_backward(mid, _train_inputs(seqs, "rl"), "importance_sampling"))
    _add_outputs(train, "fb/ppo", eng.forward_backward(mid, _train_inputs(seqs, "rl"), "ppo"))
    for name, g in sorted(eng.get_parameter_grads(mid).items()):
        train.add(f"grad/{name}", g)
    metrics = eng.optim_step(mid, {"learning_rate": 1e-2, "weight_decay": 0.01, "grad_clip_norm": 1e-3})
    for k in sorted(metrics):
        optim.add(f"optim/{k}", float(metrics[k]))
    for name, q in sorted(eng.get_parameters(mid).items()):
        optim.add(f"param/{name}", q)
    _add_outputs(optim, "forward_after", eng.forward(mid, _train_inputs(seqs, "cross_entropy"), "cross_entropy"))
    path = eng.save_for_sampler(mid, "fingerprint")
    for key, tag in (("base", "base"), (path, "trained")):
        stop_ids, stop_string = _probe(eng, prompts, key)
        samp.add(f"{tag}/probe", [stop_ids, stop_string])
        jobs = _jobs(prompts, key, stop_ids, stop_string)
        _add_samples(samp, plp, tag, jobs, eng._decode_batch(eng._sampler_net(key), jobs), coverage)
    queued = _SampleJob(
        key="base",
        prompt=prompts[2],
        n=3,
        max_tokens=12,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        stop_ids=[STOP_TOKEN_ID],
        stop_strings=[],
        seed=21,
        want_prompt_lp=True,
    )
    out = eng.sample(
        BASE_MODEL,
        queued.prompt,
        queued.n,
        queued.max_tokens,
        queued.temperature,
        queued.top_k,
        queued.top_p,
        queued.stop_ids,
        queued.stop_strings,
        queued.seed,
        queued.want_prompt_lp,
    )
    _add_samples(samp, plp, "queued", [queued], [out], coverage)
    return {
        "training": train.hexdigest(),
        "optim": optim.hexdigest(),
        "sampling": samp.hexdigest(),
        "prompt_logprobs": plp.hexdigest(),
    }


def preset_fingerprint(model_name: str, run_dir: Path, cache_dir: Path | None = None) -> Fingerprint:
    eng = Engine(run_dir, model_name=model_name, seed=0, batch_window_s=0.0, num_threads=THREADS, cache_dir=cache_dir)
    try:
        coverage: dict[str, int] = {}
        sections = run_script(eng, coverage)
    finally:
        eng.close()
    return Fingerprint(
        model=model_name,
        base_sha256=eng.base_sha256,
        torch=torch.__version__,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        threads=THREADS,
        platform_sha256=platform_sha256(),
        sections=sections,
        coverage=coverage,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3-random")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as d:
        print(json.dumps(asdict(preset_fingerprint(args.model, Path(d)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Client-side loss + metrics time for one 4-group minibatch (32 sequences x ~500 tokens), one core.

Times what ``TrainingClient.forward_backward_custom`` runs locally: the loss function (datum
unpacking, per-token terms, loss, metrics) and ``loss.backward()`` into the per-datum logprob
tensors. Prints the median over repeats for both arms. Target: <= 20 ms.

    PYTHONPATH=src python benchmarks/loss_overhead.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import tinker
import torch

from dppo_harness.loss.losses import LossConfig, make_loss_fn


def make_minibatch(
    n_groups: int = 4, group_size: int = 8, seed: int = 0
) -> tuple[list[tinker.Datum], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    datums, current = [], []
    for _ in range(n_groups):
        prompt_len = int(rng.integers(90, 130))
        prompt = rng.integers(0, 150_000, prompt_len)
        rewards = rng.integers(0, 2, group_size).astype(np.float64)
        advantages_G = rewards - rewards.mean()
        for g in range(group_size):
            resp_len = int(rng.integers(300, 480))
            tokens = np.concatenate([prompt, rng.integers(0, 150_000, resp_len)])
            T = len(tokens) - 1
            sampler_T = np.zeros(T)
            sampler_T[prompt_len - 1 :] = np.log(rng.uniform(0.05, 1.0, resp_len))
            mask_T = np.zeros(T, dtype=np.float32)
            mask_T[prompt_len - 1 :] = 1.0
            adv_T = mask_T * advantages_G[g]
            datums.append(
                tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(tokens[:-1].tolist()),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:].astype(np.int64),
                        "logprobs": sampler_T.astype(np.float32),
                        "advantages": adv_T.astype(np.float32),
                        "mask": mask_T,
                    },
                )
            )
            current.append((sampler_T + rng.normal(0, 0.1, T)).astype(np.float32))
    return datums, current


def time_call(loss_fn, datums, current, repeats: int) -> tuple[float, float]:
    call_ms, total_ms = [], []
    for _ in range(repeats):
        # Same construction as the SDK's _compute_custom_loss: fresh leaf tensors per call.
        lps = [torch.tensor(c).requires_grad_(True) for c in current]
        t0 = time.perf_counter()
        loss, _metrics = loss_fn(datums, lps)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        call_ms.append((t1 - t0) * 1e3)
        total_ms.append((t2 - t0) * 1e3)
    return statistics.median(call_ms), statistics.median(total_ms)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    datums, current = make_minibatch()
    n_tokens = sum(len(c) for c in current)
    n_loss = int(sum(d.loss_fn_inputs["mask"].to_numpy().sum() for d in datums))
    print(f"minibatch: {len(datums)} sequences, {n_tokens} positions ({n_loss} loss tokens), torch threads=1")
    for arm in ("grpo_clip_eps0.2", "dppo_divergence_mask"):
        loss_fn = make_loss_fn(LossConfig(loss=arm, normalization="token_mean"))
        time_call(loss_fn, datums, current, 3)  # warm-up
        call, total = time_call(loss_fn, datums, current, args.repeats)
        print(f"{arm}: loss+metrics {call:.2f} ms, loss+metrics+backward {total:.2f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()

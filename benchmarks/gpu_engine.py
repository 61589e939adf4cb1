"""GPU figures of the `--model-path` engine on a random 2B-shaped Qwen3 checkpoint (issue 13).

One prepared run (meant to finish in under 6 minutes on one H200):
1. build a random-weight Qwen3 checkpoint of the anchor's shape (hidden 2048, 28 layers, 16 heads /
   8 KV heads, head dim 128, MLP 6144, vocabulary 248,320, tied embeddings, 1.92 B parameters) in
   bf16 on the device and `save_pretrained` it to local disk;
2. start the engine on it exactly as `--model-path` does (`Engine(model_path=...)`);
3. updates on 32 x 600 tokens, LoRA r32 on all 7 projections: `forward` (logprobs), then
   `forward_backward` with weights, then `optim_step` (AdamW); prints seconds per update;
4. sampling: 32 prompts x 8 samples = 256 sequences x 512 new tokens at temperature 1, full
   vocabulary, no stop tokens, all requests in flight together; prints new tokens/s and the decode
   mode that ran (CUDA graph of the decode step by default on CUDA; "static" if capture failed);
5. peak device memory of each phase, and the diagnostic-compute projection (sampling + 16 updates).

Every figure is printed as one JSON line. `--tiny` runs the same steps on a 2-layer hidden-64
checkpoint (still the full vocabulary) with small shapes: a CPU smoke test of the script.

    PYTHONPATH=src python benchmarks/gpu_engine.py                 # GPU, full shape
    PYTHONPATH=src python benchmarks/gpu_engine.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from dppo_harness.constants import BASE_MODEL
from dppo_harness.local_server import hf_model as HF
from dppo_harness.local_server.engine import Engine

FULL = dict(vocab_size=248_320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128)
TINY = dict(vocab_size=248_320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32)
# (prompts, samples per prompt, prompt tokens, new tokens, update sequences, update tokens, timed updates)
SHAPES = {"full": (32, 8, 128, 512, 32, 600, 3), "tiny": (2, 4, 32, 16, 4, 64, 2)}
DIAGNOSTIC_UPDATES = 16  # the bounded diagnostic: one 32 x 8 batch, then 16 updates
T0 = time.perf_counter()


def emit(**fields) -> None:
    print(json.dumps({"t_s": round(time.perf_counter() - T0, 2), **fields}), flush=True)


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_gpu_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
                "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}
    return {"peak_process_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}  # KiB on Linux


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def build_checkpoint(out: Path, cfg: dict, device: torch.device, dtype: torch.dtype) -> dict:
    t = time.perf_counter()
    HF.save_random_checkpoint(out, HF.qwen3_config(**cfg), seed=0, dtype=dtype, device=str(device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {"checkpoint_build_s": time.perf_counter() - t, "checkpoint_bytes": size}


def sample_all(eng: Engine, path: str, prompts: list[list[int]], n: int, new_tokens: int) -> tuple[float, int]:
    """Every prompt's request in flight at once (the engine batches them into one decode loop)."""
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = eng.sample(path, prompts[i], n, new_tokens, 1.0, -1, 1.0, [], [], 1000 + i, False)

    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    return wall, sum(len(s.tokens) for r in results for s in r)


def update(eng: Engine, mid: str, data_fwd: list, data_fb: list) -> float:
    t = time.perf_counter()
    eng.forward(mid, data_fwd, "cross_entropy")
    eng.forward_backward(mid, data_fb, "cross_entropy")
    eng.optim_step(mid, {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip_norm": 1.0})
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="2-layer hidden-64 checkpoint, small shapes (CPU smoke)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--decode-mode", choices=("auto", "dynamic", "static", "graph"), default="auto",
                    help="sampler decode step (sampling.py): auto = CUDA graph on CUDA, eager elsewhere")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    args = ap.parse_args()
    device = HF.resolve_device(args.device)
    dtype = HF.resolve_dtype(args.dtype, device)
    cfg = TINY if args.tiny else FULL
    n_prompts, n_samples, prompt_len, new_tokens, upd_seqs, upd_tokens, n_updates = SHAPES["tiny" if args.tiny else "full"]
    emit(event="start", date_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
         device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         torch=torch.__version__, transformers=transformers.__version__, dtype=str(dtype), config=cfg,
         shape="tiny" if args.tiny else "full", threads=torch.get_num_threads())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-engine-bench-"))
    ckpt = work / ("tiny-qwen3-full-vocab" if args.tiny else "random-qwen3-2b-shape")
    try:
        emit(event="checkpoint", **build_checkpoint(ckpt, cfg, device, dtype))
        t = time.perf_counter()
        eng = Engine(work / "run", model_path=ckpt, device=str(device), dtype=str(dtype).removeprefix("torch."),
                     batch_window_s=0.5, decode_mode=args.decode_mode)
        n_params = sum(p.numel() for p in eng.base_model.parameters())
        emit(event="engine_ready", engine_start_s=time.perf_counter() - t, base_parameters=n_params,
             **{k: v for k, v in eng.base_info.items() if k != "checkpoint"})
        run(eng, device, n_prompts, n_samples, prompt_len, new_tokens, upd_seqs, upd_tokens, n_updates)
        eng.close()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    emit(event="done", total_s=time.perf_counter() - T0)


def run(eng: Engine, device: torch.device, n_prompts: int, n_samples: int, prompt_len: int, new_tokens: int,
        upd_seqs: int, upd_tokens: int, n_updates: int) -> None:
    """Updates first (plain eager PyTorch), then sampling (the CUDA-graph decode has never run on a
    GPU; if it fails, the update figures are already printed and the failure is reported)."""
    rng = np.random.default_rng(0)
    V = eng.vocab.size
    mid = eng.create_model(BASE_MODEL, 32, 0, train_unembed=False)  # LoRA r32 on the 7 projections
    lora_params = sum(q.numel() for _, q in eng._models[mid].params)
    emit(event="lora", rank=32, targets=list(eng._models[mid].targets), lora_parameters=lora_params)

    # ---- updates ----
    toks = [rng.integers(0, V, upd_tokens + 1).tolist() for _ in range(upd_seqs)]
    data_fwd = [(t[:-1], {"target_tokens": np.asarray(t[1:]), "weights": np.zeros(upd_tokens, np.float32)})
                for t in toks]
    data_fb = [(t[:-1], {"target_tokens": np.asarray(t[1:]),
                         "weights": rng.normal(0, 1e-3, upd_tokens).astype(np.float32)}) for t in toks]
    warm = update(eng, mid, data_fwd, data_fb)
    reset_peak(device)
    times = [update(eng, mid, data_fwd, data_fb) for _ in range(n_updates)]
    mean_update = float(np.mean(times))
    emit(event="update", sequences=upd_seqs, tokens_per_seq=upd_tokens, warmup_s=warm, seconds=times,
         mean_s=mean_update, **peak_memory(device))

    # ---- sampling ----
    path = eng.save_for_sampler(mid, "bench")
    prompts = [rng.integers(0, V, prompt_len).tolist() for _ in range(n_prompts)]
    try:
        warm_s, _ = sample_all(eng, path, prompts[:2], 2, 4)  # builds the merged sampler, warms kernels
        reset_peak(device)
        wall, n_tok = sample_all(eng, path, prompts, n_samples, new_tokens)
    except Exception as exc:
        emit(event="sampling", available=False, error=f"{type(exc).__name__}: {exc}"[:500])
        emit(event="diagnostic_projection", available=False, reason="sampling failed")
        return
    emit(event="sampling", sequences=n_prompts * n_samples, new_tokens_per_seq=new_tokens, new_tokens=n_tok,
         wall_s=wall, tokens_per_s=n_tok / wall, warmup_s=warm_s, **eng.last_sample_stats, **peak_memory(device))
    emit(event="diagnostic_projection", formula=f"sampling wall + {DIAGNOSTIC_UPDATES} x mean update",
         seconds=wall + DIAGNOSTIC_UPDATES * mean_update)


if __name__ == "__main__":
    sys.exit(main())

"""GPU figures of the `--model-path` engine on a random Qwen3.5 2B-class checkpoint, with and without the fast
linear-attention kernels.

One prepared run (sized for one H200 within a single 10-minute device command):
1. build a random-weight checkpoint and `save_pretrained` it to local disk, in bf16 on the device.
   Default `--arch qwen3_5`: `QWEN35_2B` below, a Qwen3.5 text model of the 2B class (transformers
   ships only the 27B shape as defaults and the real 2B config is not on this machine, so this
   shape is a stated choice, not a copy: width 2048 and MLP 6144 as in the gpu-anchor model, 24
   layers in the hub's pattern of three Gated DeltaNet layers then one gated full-attention layer,
   full attention 8 heads / 2 KV heads x 256, linear attention 16 key and 16 value heads x 128,
   conv kernel 4, vocabulary 248,320, tied embeddings; about 1.88 B parameters, printed).
   `--arch qwen3` builds the gpu-anchor's Qwen3 shape instead;
2. start the engine on it exactly as `--model-path` does (`Engine(model_path=...)`) and print
   its kernel report (which implementation each layer type runs);
3. for each arm of `--kernels` (default `fast,torch`: the kernels transformers picked at load,
   then `hf_model.use_torch_linear_attention`, transformers' torch fallback):
   - updates on 32 x 600 tokens, LoRA r32 on every attention / linear-attention projection and
     the MLP (not the head): `forward` (logprobs), `forward_backward` with weights, `optim_step`
     (AdamW); one warm-up, then timed; seconds per update and peak memory;
   - sampling 32 prompts x 8 samples = 256 sequences x 512 new tokens at temperature 1, full
     vocabulary, no stop tokens, all requests in flight together; new tokens/s, the decode mode
     that ran (CUDA graph of the whole step on CUDA unless `--decode-mode`) and peak memory;
   - the diagnostic-compute projection: sampling wall + 16 x mean update.

Every figure is one JSON line (also appended to `--out`). `--tiny` runs the same steps on a
2-layer hidden-64 checkpoint (one layer of each kind, full vocabulary) with small shapes: a CPU
smoke test of the script, not a figure.

    PYTHONPATH=src python benchmarks/gpu_engine.py                          # GPU, full shape
    PYTHONPATH=src python benchmarks/gpu_engine.py --tiny --device cpu      # CPU smoke test
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
from dppo_harness.local_server.engine import hf_model
from dppo_harness.local_server.engine.engine import Engine

QWEN35_2B = dict(
    vocab_size=248_320,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    tie_word_embeddings=True,
    max_position_embeddings=32_768,
)
QWEN35_TINY = dict(
    vocab_size=248_320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    tie_word_embeddings=True,
)
QWEN3_ANCHOR = dict(
    vocab_size=248_320,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)
QWEN3_TINY = dict(
    vocab_size=248_320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)
# (prompts, samples per prompt, prompt tokens, new tokens, update sequences, update tokens, timed updates)
SHAPES = {"full": (32, 8, 128, 512, 32, 600, 3), "tiny": (2, 4, 32, 16, 4, 64, 2)}
DIAGNOSTIC_UPDATES = 16  # the bounded diagnostic: one 32 x 8 batch, then 16 updates
T0 = time.perf_counter()
OUT: Path | None = None


def emit(**fields) -> None:
    line = json.dumps({"t_s": round(time.perf_counter() - T0, 2), **fields})
    print(line, flush=True)
    if OUT is not None:
        with OUT.open("a") as f:
            f.write(line + "\n")


def model_config(arch: str, tiny: bool) -> transformers.PretrainedConfig:
    if arch == "qwen3":
        return hf_model.qwen3_config(**(QWEN3_TINY if tiny else QWEN3_ANCHOR))
    return transformers.Qwen3_5TextConfig(**(QWEN35_TINY if tiny else QWEN35_2B))


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "peak_gpu_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
            "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
        }
    return {"peak_process_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}  # KiB on Linux


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def build_checkpoint(out: Path, config, device: torch.device, dtype: torch.dtype) -> dict:
    t = time.perf_counter()
    hf_model.save_random_checkpoint(out, config, seed=0, dtype=dtype, device=str(device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {"checkpoint_build_s": time.perf_counter() - t, "checkpoint_bytes": size}


def sample_all(eng: Engine, path: str, prompts: list[list[int]], n: int, new_tokens: int) -> tuple[float, int]:
    """Every prompt's request in flight at once (the engine batches them into one decode loop)."""
    results: list = [None] * len(prompts)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = eng.sample(path, prompts[i], n, new_tokens, 1.0, -1, 1.0, [], [], 1000 + i, False)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    wall = time.perf_counter() - t
    return wall, sum(len(s.tokens) for r in results for s in r)


def update(eng: Engine, mid: str, data_fwd: list, data_fb: list) -> float:
    t = time.perf_counter()
    eng.forward(mid, data_fwd, "cross_entropy")
    eng.forward_backward(mid, data_fb, "cross_entropy")
    eng.optim_step(mid, {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip_norm": 1.0})
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def run_arm(eng: Engine, arm: str, shape: tuple, rng: np.random.Generator) -> None:
    """Updates first (plain eager PyTorch), then sampling; a failing sampler is reported, not fatal."""
    n_prompts, n_samples, prompt_len, new_tokens, upd_seqs, upd_tokens, n_updates = shape
    device, V = eng.device, eng.vocab.size
    la = eng.kernels.get("linear_attention")
    path_field = {"linear_attention_path": la["path"] if la else None}  # what the arm really ran
    mid = eng.create_model(BASE_MODEL, 32, 0, train_unembed=False)
    emit(
        event="lora",
        arm=arm,
        rank=32,
        targets=list(eng._models[mid].targets),
        lora_parameters=sum(q.numel() for _, q in eng._models[mid].params),
    )
    toks = [rng.integers(0, V, upd_tokens + 1).tolist() for _ in range(upd_seqs)]
    data_fwd = [
        (t[:-1], {"target_tokens": np.asarray(t[1:]), "weights": np.zeros(upd_tokens, np.float32)}) for t in toks
    ]
    data_fb = [
        (t[:-1], {"target_tokens": np.asarray(t[1:]), "weights": rng.normal(0, 1e-3, upd_tokens).astype(np.float32)})
        for t in toks
    ]
    try:
        warm = update(eng, mid, data_fwd, data_fb)
        reset_peak(device)
        times = [update(eng, mid, data_fwd, data_fb) for _ in range(n_updates)]
    except Exception as exc:
        emit(event="update", arm=arm, available=False, error=f"{type(exc).__name__}: {exc}"[:500])
        return
    mean_update = float(np.mean(times))
    emit(
        event="update",
        arm=arm,
        **path_field,
        sequences=upd_seqs,
        tokens_per_seq=upd_tokens,
        warmup_s=warm,
        seconds=times,
        mean_s=mean_update,
        **peak_memory(device),
    )
    path = eng.save_for_sampler(mid, f"bench-{arm}")
    eng.unload_model(mid)
    prompts = [rng.integers(0, V, prompt_len).tolist() for _ in range(n_prompts)]
    try:
        warm_s, _ = sample_all(eng, path, prompts[:2], 2, 4)  # builds the merged sampler, warms kernels
        reset_peak(device)
        wall, n_tok = sample_all(eng, path, prompts, n_samples, new_tokens)
    except Exception as exc:
        emit(event="sampling", arm=arm, available=False, error=f"{type(exc).__name__}: {exc}"[:500])
        emit(event="diagnostic_projection", arm=arm, available=False, reason="sampling failed")
        return
    emit(
        event="sampling",
        arm=arm,
        **path_field,
        sequences=n_prompts * n_samples,
        new_tokens_per_seq=new_tokens,
        new_tokens=n_tok,
        wall_s=wall,
        tokens_per_s=n_tok / wall,
        warmup_s=warm_s,
        **eng.last_sample_stats,
        **peak_memory(device),
    )
    emit(
        event="diagnostic_projection",
        arm=arm,
        formula=f"sampling wall + {DIAGNOSTIC_UPDATES} x mean update",
        seconds=wall + DIAGNOSTIC_UPDATES * mean_update,
    )
    with eng._sampler_cache_lock:
        eng._sampler_cache.clear()  # the next arm's sampler is built from its own base


def main(argv: list[str] | None = None) -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="2-layer hidden-64 checkpoint, small shapes (CPU smoke)")
    ap.add_argument("--arch", choices=("qwen3_5", "qwen3"), default="qwen3_5")
    ap.add_argument(
        "--kernels",
        default="fast,torch",
        help="arms in order: 'fast' = the kernels transformers picked at load, 'torch' = its torch fallback",
    )
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default=None, help="default: bfloat16 on CUDA, float32 on CPU"
    )
    ap.add_argument(
        "--decode-mode",
        choices=("auto", "dynamic", "static", "graph"),
        default="auto",
        help="sampler decode step (sampling.py): auto = CUDA graph on CUDA, eager elsewhere",
    )
    ap.add_argument(
        "--workdir", default=None, help="where the checkpoint is written and kept (default: a temp dir, removed)"
    )
    ap.add_argument("--out", default=None, help="also append every JSON line to this file")
    ap.add_argument("--build-only", action="store_true", help="write the checkpoint into --workdir and stop")
    args = ap.parse_args(argv)
    OUT = Path(args.out) if args.out else None
    arms = [a.strip() for a in args.kernels.split(",") if a.strip()]
    if not arms or set(arms) - {"fast", "torch"}:
        ap.error(f"--kernels takes fast and/or torch, got {args.kernels!r}")
    device = hf_model.resolve_device(args.device)
    dtype = hf_model.resolve_dtype(args.dtype, device)
    config = model_config(args.arch, args.tiny)
    emit(
        event="start",
        date_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        dtype=str(dtype),
        arch=args.arch,
        config={k: v for k, v in config.to_dict().items() if k in (QWEN35_2B | QWEN3_ANCHOR)},
        shape="tiny" if args.tiny else "full",
        threads=torch.get_num_threads(),
        arms=arms,
    )
    if args.build_only and not args.workdir:
        ap.error("--build-only needs --workdir (the checkpoint is kept there)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-engine-bench-"))
    ckpt = work / f"random-{args.arch}-{'tiny' if args.tiny else '2b-class'}"
    try:
        if (ckpt / hf_model.CONFIG_FILE).is_file():
            emit(event="checkpoint", reused=str(ckpt))
        else:
            emit(event="checkpoint", path=str(ckpt), **build_checkpoint(ckpt, config, device, dtype))
        if args.build_only:
            return 0
        t = time.perf_counter()
        eng = Engine(
            work / "run",
            model_path=ckpt,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            batch_window_s=0.5,
            decode_mode=args.decode_mode,
        )
        emit(
            event="engine_ready",
            engine_start_s=time.perf_counter() - t,
            base_parameters=sum(p.numel() for p in eng.base_model.parameters()),
            **{k: v for k, v in eng.base_info.items() if k != "checkpoint"},
        )
        rng = np.random.default_rng(0)
        try:
            for arm in arms:
                if arm == "torch":
                    hf_model.use_torch_linear_attention(eng.base_model)
                    eng.kernels = hf_model.kernel_report(eng.base_model)
                emit(event="kernels", arm=arm, summary=hf_model.kernel_summary(eng.kernels), report=eng.kernels)
                run_arm(eng, arm, SHAPES["tiny" if args.tiny else "full"], rng)
        finally:
            eng.close()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    emit(event="done", total_s=time.perf_counter() - T0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A local Hugging Face checkpoint (Qwen3 / Qwen3.5 families) as the engine's base model.

`python -m dppo_harness.local_server --model-path DIR` loads DIR through `transformers`
(AutoConfig + AutoModelForCausalLM, ``local_files_only``: nothing is downloaded) with its full
vocabulary: token ids at the interface are the model's own ids, no restricted-vocabulary map.
A missing or incomplete DIR raises `CheckpointError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeGuard

import numpy as np
import torch
import transformers
from transformers.utils import import_utils

from dppo_harness.local_server.engine import attention

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
SINGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# model_type prefixes of the families this backend is built and tested for (LoRA target names,
# KV / linear-attention caches).
SUPPORTED_MODEL_TYPES = ("qwen3",)

# LoRA target modules by Tinker's train_attn / train_mlp / train_unembed switches (only nn.Linear
# modules are adapted). train_attn: full-attention layers' q/k/v/o projections (Qwen3.5's q_proj
# also carries the output gate) and the linear-attention (Gated DeltaNet) layers' in_proj_qkv,
# in_proj_z (output gate), in_proj_b (beta), in_proj_a (decay input) and out_proj; the DeltaNet's
# depthwise conv1d, A_log, dt_bias and gated RMSNorm are not linear layers and stay frozen.
# train_mlp: gate/up/down in every layer; train_unembed: lm_head.
ATTN_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)


class CheckpointError(Exception):
    """A --model-path that cannot be served (one-line message)."""


@dataclass
class LoadedCheckpoint:
    net: transformers.PreTrainedModel
    path: Path
    name: str  # the checkpoint's name (hub id for a hub-cache snapshot, else the directory name)
    dir_name: str  # last path component: the stand-in identity is "local/<dir_name>"
    identity_sha256: str  # config.json bytes + weight-file names and sizes (not a content hash)
    vocab_size: int
    max_position_embeddings: int
    model_type: str
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True)
class ContextConfig:
    """What the HTTP side reads from `Engine.config` (max context)."""

    max_position_embeddings: int


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda: no CUDA device is available to this torch build")
    if device not in ("cuda", "cpu"):
        raise CheckpointError(f"--device must be auto, cuda or cpu, got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """Default: bfloat16 on CUDA, float32 on CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in ("bfloat16", "float32"):
        raise CheckpointError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
    return getattr(torch, dtype)


def weight_files(path: Path) -> list[Path]:
    """Every weight file the checkpoint needs; raises CheckpointError if any is absent."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = path / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"--model-path {path}: unreadable {index_name} ({exc})") from None
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise CheckpointError(
                    f"--model-path {path}: incomplete checkpoint, missing shard(s) {missing[:3]}"
                    f"{' ...' if len(missing) > 3 else ''} listed in {index_name}"
                )
            return [path / s for s in shards]
    for name in SINGLE_WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    raise CheckpointError(
        f"--model-path {path}: no weights found (expected {SINGLE_WEIGHT_FILES[0]}, "
        f"{SAFETENSORS_INDEX} with its shards, or {SINGLE_WEIGHT_FILES[1]})"
    )


def check_checkpoint_dir(path: Path | str) -> tuple[Path, dict, list[Path]]:
    """(resolved dir, config dict, weight files) of a servable checkpoint, or CheckpointError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"--model-path {p}: no such directory")
    if not p.is_dir():
        raise CheckpointError(f"--model-path {p}: not a directory")
    cfg_file = p / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"--model-path {p}: missing {CONFIG_FILE} (not a Hugging Face checkpoint)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"--model-path {p}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    model_type = str(cfg.get("model_type", ""))
    if not model_type.startswith(SUPPORTED_MODEL_TYPES):
        raise CheckpointError(f"--model-path {p}: model_type {model_type!r} is not a Qwen3 / Qwen3.5 checkpoint")
    return p.resolve(), cfg, weight_files(p)


def checkpoint_name(path: Path) -> str:
    """Hub-cache snapshots (.../models--ORG--NAME/snapshots/REV) are named ORG/NAME; otherwise the
    directory name."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name[len("models--") :].replace("--", "/")
    return path.name


def identity_sha256(path: Path, files: list[Path]) -> str:
    """Cheap identity of the base weights for checkpoint compatibility checks: config.json bytes and
    each weight file's name and size (hashing gigabytes of weights at every start is too slow)."""
    h = hashlib.sha256((path / CONFIG_FILE).read_bytes())
    for f in sorted(files):
        h.update(json.dumps([f.name, f.stat().st_size]).encode())
    return h.hexdigest()


def text_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_checkpoint(path: Path | str, device: str = "auto", dtype: str | None = None) -> LoadedCheckpoint:
    """Load a local checkpoint for serving: eval mode, frozen, on `device` in `dtype`."""
    p, _, files = check_checkpoint_dir(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces next to local_files_only
    try:
        config = transformers.AutoConfig.from_pretrained(p, local_files_only=True)
        net = transformers.AutoModelForCausalLM.from_pretrained(
            p, config=config, dtype=dt, local_files_only=True, attn_implementation="sdpa"
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"--model-path {p}: cannot load the checkpoint ({first})") from None
    # transformers declares PreTrainedModel.to with functools.wraps(nn.Module.to): mypy reads it as
    # an unbound function that wants the model as its first argument.
    net = net.to(dev).eval()  # type: ignore[arg-type]
    if dev.type == "cpu":  # sdpa without the K/V repeat where that is bitwise the same (attention.py)
        net.set_attn_implementation(attention.register())
    for q in net.parameters():
        q.requires_grad_(False)
    tcfg = text_config(net.config)
    return LoadedCheckpoint(
        net=net,
        path=p,
        name=checkpoint_name(p),
        dir_name=p.name,
        identity_sha256=identity_sha256(p, files),
        vocab_size=int(net.get_output_embeddings().weight.shape[0]),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 2048)),
        model_type=str(net.config.model_type),
        device=dev,
        dtype=dt,
    )


def lora_targets(
    net: torch.nn.Module, train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True
) -> list[str]:
    """Linear-module names present in `net` that the three switches select (sorted)."""
    wanted: set[str] = set()
    if train_attn:
        wanted.update(ATTN_TARGETS)
    if train_mlp:
        wanted.update(MLP_TARGETS)
    if train_unembed:
        wanted.update(UNEMBED_TARGETS)
    present = {name.rsplit(".", 1)[-1] for name, mod in net.named_modules() if isinstance(mod, torch.nn.Linear)}
    return sorted(wanted & present)


def untie_output_head(net: transformers.PreTrainedModel) -> None:
    """Give the output head its own weight, so merging a LoRA delta into it leaves the input
    embedding unchanged (Qwen3 small models tie the two)."""
    head, emb = net.get_output_embeddings(), net.get_input_embeddings()
    if head is not None and emb is not None and head.weight is emb.weight:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
        net.config.tie_word_embeddings = False
        if hasattr(net.config, "get_text_config"):
            net.config.get_text_config().tie_word_embeddings = False


def qwen3_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 4096,
) -> transformers.Qwen3Config:
    # Qwen3Config is a @strict dataclass whose fields mypy does not see (model.qwen3_config).
    return transformers.Qwen3Config(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=1_000_000.0,
        use_cache=True,
    )


def save_random_checkpoint(
    out_dir: Path | str,
    config: transformers.PretrainedConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Path:
    """Random-weight checkpoint (transformers' own init, seeded) written with save_pretrained:
    CI fixture and GPU benchmark input."""
    out = Path(out_dir)
    torch.manual_seed(int(seed))
    # A config with a vision tower (Qwen3.5's hub layout, Qwen3_5ForConditionalGeneration) is
    # saved as that whole model; the loader serves its text model.
    auto = (
        transformers.AutoModelForImageTextToText
        if hasattr(config, "vision_config")
        else transformers.AutoModelForCausalLM
    )
    with torch.device(device):
        net = auto.from_config(config, dtype=dtype)
    net.save_pretrained(out)
    del net
    return out


FAST_MODULE_PREFIXES = ("fla.", "causal_conv1d")


class _GatedNorm(Protocol):
    weight: torch.Tensor


class GatedDeltaNetLayer(Protocol):
    """What this module reads and repoints on a transformers Gated DeltaNet (linear-attention) layer."""

    causal_conv1d_fn: Callable[..., torch.Tensor] | None
    causal_conv1d_update: Callable[..., torch.Tensor]
    chunk_gated_delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    recurrent_gated_delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    conv1d: torch.nn.Module
    norm: _GatedNorm
    layer_norm_epsilon: float


def is_gated_delta_net(m: torch.nn.Module) -> TypeGuard[GatedDeltaNetLayer]:
    """A Qwen3.5 Gated DeltaNet layer, known by its class name (each family defines its own class)."""
    return type(m).__name__.endswith("GatedDeltaNet")


def _impl_name(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def kernel_report(net: transformers.PreTrainedModel) -> dict:
    """Which implementation each layer type of `net` runs, read from the loaded modules (what they
    will call), with the reasons transformers did not pick the fast linear-attention kernels.
    Qwen3.5's Gated DeltaNet layers take fla (flash-linear-attention kernels: chunked and
    recurrent delta rule, fused gated norm) and causal-conv1d only when transformers finds them
    at import *and* torch has CUDA; each missing piece falls back to its torch implementation."""
    full = [m for m in net.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "q_proj")]
    cfg = text_config(net.config)
    out: dict = {"full_attention": {"layers": len(full), "implementation": str(cfg._attn_implementation)}}
    linear = [m for m in net.modules() if is_gated_delta_net(m)]
    if not linear:
        out["linear_attention"] = None
        return out
    m = linear[0]
    parts = {
        "conv1d_prefill": m.causal_conv1d_fn if m.causal_conv1d_fn is not None else m.conv1d,
        "conv1d_decode": m.causal_conv1d_update,
        "delta_rule_chunked": m.chunk_gated_delta_rule,  # prefill and training
        "delta_rule_recurrent": m.recurrent_gated_delta_rule,  # decode steps
        "gated_norm": m.norm,
    }
    impls = {
        k: (_impl_name(v) if callable(v) and not isinstance(v, torch.nn.Module) else _impl_name(type(v)))
        for k, v in parts.items()
    }
    fast = {k: v.startswith(FAST_MODULE_PREFIXES) for k, v in impls.items()}
    reasons = []
    if not torch.cuda.is_available():
        reasons.append(
            f"torch {torch.__version__} sees no CUDA device (transformers uses fla and causal-conv1d only with CUDA)"
        )
    if importlib.util.find_spec("fla") is None:
        reasons.append("fla is not installed (pip install '.[gpu]' brings fla-core)")
    if importlib.util.find_spec("causal_conv1d") is None:
        reasons.append(
            "causal-conv1d is not installed (not in the gpu extra: its only release on the index is a "
            "source build that needs nvcc or a GitHub download)"
        )
    module = importlib.import_module(type(m).__module__)
    out["linear_attention"] = {
        "layers": len(linear),
        "path": "fast kernels" if all(fast.values()) else "torch fallback" if not any(fast.values()) else "mixed",
        "implementations": impls,
        "fast": fast,
        "transformers": {
            "is_fast_path_available": bool(getattr(module, "is_fast_path_available", False)),
            "is_flash_linear_attention_available": bool(import_utils.is_flash_linear_attention_available()),
            "is_causal_conv1d_available": bool(import_utils.is_causal_conv1d_available()),
        },
        "reasons": reasons,
    }
    return out


def use_torch_linear_attention(net: torch.nn.Module) -> int:
    """Point every Gated DeltaNet layer of `net` at transformers' torch implementations (conv1d,
    chunked and recurrent delta rule, gated RMSNorm with the same weight), whatever kernels it
    was loaded with: the "without fast kernels" arm of a comparison. Returns the layers changed."""
    n = 0
    for m in net.modules():
        if not is_gated_delta_net(m):
            continue
        mod = importlib.import_module(type(m).__module__)
        m.causal_conv1d_fn = None
        m.causal_conv1d_update = mod.torch_causal_conv1d_update
        m.chunk_gated_delta_rule = mod.torch_chunk_gated_delta_rule
        m.recurrent_gated_delta_rule = mod.torch_recurrent_gated_delta_rule
        norm_cls = getattr(mod, type(m).__name__.replace("GatedDeltaNet", "RMSNormGated"))  # Qwen3_5RMSNormGated
        if not isinstance(m.norm, norm_cls):
            w = m.norm.weight
            norm = norm_cls(w.shape[0], eps=m.layer_norm_epsilon).to(device=w.device, dtype=w.dtype)
            with torch.no_grad():
                norm.weight.copy_(w)
            norm.weight.requires_grad_(w.requires_grad)
            m.norm = norm
        n += 1
    return n


def kernel_summary(report: dict) -> str:
    """One log line of `kernel_report`."""
    fa = report["full_attention"]
    line = f"full_attention: {fa['layers']} layers, {fa['implementation']}"
    la = report.get("linear_attention")
    if la is None:
        return line + "; no linear_attention layers"
    slow = [k for k, f in la["fast"].items() if not f]
    line += f"; linear_attention: {la['layers']} layers, {la['path']}"
    if slow:
        line += f" (torch: {', '.join(slow)}; {'; '.join(la['reasons']) or 'transformers did not pick the kernels'})"
    return line


class FullVocab:
    """The identity map between interface ids and model rows (the `Vocab` interface the engine
    uses): every id in [0, size) is a model row; anything else is refused with ValueError."""

    def __init__(self, size: int):
        self.size = int(size)
        self.num_embeddings = self.size
        self.unk_index = None

    def to_local(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1) if not isinstance(ids, torch.Tensor) else ids.long()
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.size):
            bad = int(t[(t < 0) | (t >= self.size)][0])
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {self.size})")
        return t

    def to_real(self, local: torch.Tensor | Sequence[int]) -> list[int]:
        return torch.as_tensor(local, dtype=torch.int64).tolist()

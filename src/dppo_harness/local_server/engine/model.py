"""Tiny Qwen3-architecture causal LM over the restricted vocabulary, plus LoRA wrapping.

The model is a stock ``transformers.Qwen3ForCausalLM``; its embedding and output head have
``vocab.num_embeddings`` rows (in-vocabulary ids + one input-only unk row, see ``vocab.py``).
``token_logprobs`` drops the unk column before the log-softmax, so the model's distribution is
over in-vocabulary tokens only, for trainer and sampler alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import transformers

from dppo_harness.local_server.engine import attention

if TYPE_CHECKING:
    import peft

# Floor reported as the logprob of an out-of-vocabulary target id: the model cannot emit it.
# Constant (zero gradient); only ever hit on prompt positions of non-GSM8K text.
OOV_TARGET_LOGPROB = -30.0
# LoRA scale alpha / rank with a fixed alpha, like common Tinker/peft setups.
LORA_ALPHA = 32
# LoRA target modules by Tinker's train_attn / train_mlp / train_unembed switches.
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)
LORA_TARGETS = [*ATTN_TARGETS, *MLP_TARGETS, *UNEMBED_TARGETS]


@dataclass(frozen=True)
class TinyConfig:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02

    def to_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)


def qwen3_config(cfg: TinyConfig, num_embeddings: int) -> transformers.Qwen3Config:
    # Qwen3Config is a @strict dataclass whose fields mypy does not see: it checks the call
    # against PreTrainedConfig.__init__, which lacks the model keywords.
    return transformers.Qwen3Config(  # type: ignore[call-arg]
        vocab_size=num_embeddings,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        use_cache=True,
        attention_dropout=0.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def build_base_model(cfg: TinyConfig, num_embeddings: int, seed: int) -> transformers.Qwen3ForCausalLM:
    """Deterministic init from ``seed``: every parameter is drawn, in sorted-name order, from
    one private generator (normal(0, init_std) for matrices, ones for norms)."""
    hf_cfg = qwen3_config(cfg, num_embeddings)
    hf_cfg._attn_implementation = attention.register()  # sdpa; no K/V repeat in CPU inference (bitwise)
    model = transformers.Qwen3ForCausalLM(hf_cfg)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for _name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * cfg.init_std)
    model.eval()
    return model


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """Hash of a state dict: names, dtypes, shapes and raw bytes in sorted-name order."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().contiguous().cpu()
        h.update(json.dumps([k, str(t.dtype), list(t.shape)]).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def add_lora(
    model: transformers.PreTrainedModel, rank: int, seed: int, targets: Sequence[str] | None = None
) -> peft.PeftModel:
    """Wrap with peft LoRA on ``targets`` (default: every linear layer: attention, MLP and
    unembedding).

    A matrices get kaiming-uniform init (bound 1/sqrt(fan_in), peft's default distribution)
    from a private generator seeded with ``seed`` in sorted-name order; B matrices start at zero,
    so a fresh adapter leaves the base model's outputs unchanged.
    """
    import peft  # loads transformers' model modules (seconds): deferred to the first LoRA model

    lcfg = peft.LoraConfig(
        r=int(rank), lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(targets or LORA_TARGETS), bias="none"
    )
    pm = peft.get_peft_model(model, lcfg)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in sorted(pm.named_parameters(), key=lambda kv: kv[0]):
            if "lora_A" in name:
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
            elif "lora_B" in name:
                p.zero_()
    return pm


def lora_targets(train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> list[str]:
    """The linear-module names the three switches select (sorted)."""
    chosen = (ATTN_TARGETS if train_attn else ()) + (MLP_TARGETS if train_mlp else ())
    return sorted(chosen + (UNEMBED_TARGETS if train_unembed else ()))


def lora_named_parameters(pm: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Trainable LoRA parameters in a fixed (sorted-name) order."""
    return iter(sorted(((n, p) for n, p in pm.named_parameters() if p.requires_grad), key=lambda kv: kv[0]))


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, in_vocab: int) -> torch.Tensor:
    """Log-probabilities of local target indices under the in-vocabulary softmax.

    Targets equal to the unk index (``in_vocab``) get ``OOV_TARGET_LOGPROB`` with no gradient.
    """
    logits = logits_BTV[..., :in_vocab].float()
    lse_BT = torch.logsumexp(logits, dim=-1)
    oov_BT = targets_BT >= in_vocab
    safe_BT = torch.where(oov_BT, torch.zeros_like(targets_BT), targets_BT)
    tgt_BT = logits.gather(-1, safe_BT.unsqueeze(-1)).squeeze(-1)
    lp_BT = tgt_BT - lse_BT
    return torch.where(oov_BT, torch.full_like(lp_BT, OOV_TARGET_LOGPROB), lp_BT)


def tensor_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()

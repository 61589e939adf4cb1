"""Target-token log-softmax over a full vocabulary without materialising a batch of logits.

A 32 x 600 x 248k float32 logits tensor is 19 GB. `chunked_target_logprobs` runs the output head
on `chunk_tokens` rows at a time and keeps only each row's target logprob; under autograd each
chunk is checkpointed, so backward recomputes that chunk's logits instead of keeping them. Peak
extra memory is one chunk of logits (chunk_tokens x V, float32 plus the head's dtype).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 1024


def _chunk_logprobs(hidden_CH: torch.Tensor, targets_C: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    logits_CV = head(hidden_CH).float()
    tgt_C = logits_CV.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1)
    return tgt_C - torch.logsumexp(logits_CV, dim=-1)


def chunked_target_logprobs(hidden_NH: torch.Tensor, targets_N: torch.Tensor, head: torch.nn.Module,
                            chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """float32 log p(target) per row of `hidden_NH` under softmax(head(hidden)); same values and
    gradients (w.r.t. hidden and the head's trainable parameters) as the naive full computation."""
    if hidden_NH.shape[0] != targets_N.shape[0]:
        raise ValueError(f"{hidden_NH.shape[0]} hidden rows but {targets_N.shape[0]} targets")
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    needs_graph = torch.is_grad_enabled() and (
        hidden_NH.requires_grad or any(p.requires_grad for p in head.parameters()))
    out = []
    for s in range(0, hidden_NH.shape[0], chunk_tokens):
        h_CH, t_C = hidden_NH[s : s + chunk_tokens], targets_N[s : s + chunk_tokens]
        if needs_graph:
            out.append(checkpoint(_chunk_logprobs, h_CH, t_C, head, use_reentrant=False,
                                  preserve_rng_state=False))  # no randomness in the head
        else:
            out.append(_chunk_logprobs(h_CH, t_C, head))
    if not out:
        return hidden_NH.new_zeros((0,), dtype=torch.float32)
    return torch.cat(out)


def naive_target_logprobs(hidden_NH: torch.Tensor, targets_N: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    """Reference: full logits, then log-softmax (tests only)."""
    logp_NV = torch.log_softmax(head(hidden_NH).float(), dim=-1)
    return logp_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1)

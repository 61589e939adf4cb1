"""The trainer's target logprobs through the tiny presets' output head, fused and in row chunks.

`head_target_logprobs` runs the output head (a plain `nn.Linear` or a peft LoRA one) on chunks of
hidden rows and keeps only each row's target logprob; its backward turns each chunk's kept logits
into the softmax gradient in place, so no [B, T, V] logits tensor is allocated per micro-batch.
"""

from __future__ import annotations

from typing import Protocol

import torch

# Rows of hidden states per output-head chunk: 128 x 15,253 float32 logits (7.8 MB) stay in cache for
# the softmax and are reused from the allocator between chunks; one [B, T, V] logits tensor per
# micro-batch would be fresh memory (page faults) at every pass.
HEAD_CHUNK_ROWS = 128


def lora_head_parts(
    head: torch.nn.Module,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, float] | None:
    """(W, A, B, scaling) of a float32 output head the fused path can run: a bias-free
    `nn.Linear` (A = B = None) or a peft LoRA `Linear` with one plain adapter (no dropout, bias or
    variant, not merged) over a frozen bias-free base. None for anything else."""
    if type(head) is torch.nn.Linear:
        ok = head.bias is None and head.weight.dtype == torch.float32 and not head.weight.requires_grad
        return (head.weight, None, None, 0.0) if ok else None
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear  # peft loads on the first LoRA model (model.add_lora)
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    if not isinstance(head, LoraLinear) or head.merged or head.disable_adapters:
        return None
    active = [a for a in head.active_adapters if a in head.lora_A]
    if len(active) != 1 or active[0] in head.lora_variant:
        return None
    name = active[0]
    base, lora_a, lora_b = head.base_layer, head.lora_A[name], head.lora_B[name]
    if (
        type(base) is not torch.nn.Linear
        or base.bias is not None
        or base.weight.requires_grad
        or lora_a.bias is not None
        or lora_b.bias is not None
        or not isinstance(head.lora_dropout[name], torch.nn.Identity)
    ):
        return None
    if any(t.dtype != torch.float32 for t in (base.weight, lora_a.weight, lora_b.weight)):
        return None
    return base.weight, lora_a.weight, lora_b.weight, float(head.scaling[name])


# The fused head's frozen layout, kept for backward: W, A, B, scaling, in_vocab, chunk_rows.
_HeadLayout = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, float, int, int]


class _HeadCtx(Protocol):
    """The autograd context as `_HeadTargetLogprobs` uses it (torch's context plus the two
    attributes forward sets for backward)."""

    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]
    head: _HeadLayout
    chunks: tuple[list[torch.Tensor], list[torch.Tensor]] | None

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


class _HeadTargetLogprobs(torch.autograd.Function):
    """log p(target) under softmax over the first `in_vocab` columns of h W^T + s (h A^T) B^T, in
    row chunks; the chunks' logits are kept for backward when one can run (keep)."""

    @staticmethod
    def forward(
        ctx: _HeadCtx,
        hidden_NH: torch.Tensor,
        targets_N: torch.Tensor,
        W_VH: torch.Tensor,
        A_RH: torch.Tensor | None,
        B_VR: torch.Tensor | None,
        scaling: float,
        in_vocab: int,
        chunk_rows: int,
        keep: bool,
        oov_logprob: float,
    ) -> torch.Tensor:
        W_vH = W_VH[:in_vocab]
        B_vR = B_VR[:in_vocab] if B_VR is not None else None
        oov_N = targets_N >= in_vocab
        safe_N = torch.where(oov_N, torch.zeros_like(targets_N), targets_N)
        lp_N = hidden_NH.new_empty(hidden_NH.shape[0], dtype=torch.float32)
        lse_N = torch.empty_like(lp_N)
        logits: list[torch.Tensor] = []
        xas: list[torch.Tensor] = []
        for s in range(0, hidden_NH.shape[0], chunk_rows):
            h_CH = hidden_NH[s : s + chunk_rows]
            z_Cv = torch.mm(h_CH, W_vH.t())
            if A_RH is not None and B_vR is not None:  # a LoRA head has both
                xa_CR = torch.mm(h_CH, A_RH.t()).mul_(scaling)
                z_Cv.addmm_(xa_CR, B_vR.t())
                xas.append(xa_CR)
            lse_C = torch.logsumexp(z_Cv, dim=-1)
            lp_N[s : s + chunk_rows] = z_Cv.gather(1, safe_N[s : s + chunk_rows, None])[:, 0] - lse_C
            lse_N[s : s + chunk_rows] = lse_C
            if keep:
                logits.append(z_Cv)
        lp_N = torch.where(oov_N, torch.full_like(lp_N, oov_logprob), lp_N)  # constant: no gradient
        ctx.save_for_backward(hidden_NH, safe_N, oov_N, lse_N)
        ctx.head = (W_VH, A_RH, B_VR, scaling, in_vocab, chunk_rows)
        ctx.chunks = (logits, xas)
        return lp_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: _HeadCtx, g_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_NH, safe_N, oov_N, lse_N = ctx.saved_tensors
        W_VH, A_RH, B_VR, scaling, in_vocab, chunk_rows = ctx.head
        if ctx.chunks is None:
            raise RuntimeError("the fused output head's backward ran twice; its logits were consumed")
        logits, xas = ctx.chunks
        ctx.chunks = None  # the kept logits become gradients in place below
        W_vH = W_VH[:in_vocab]
        B_vR = B_VR[:in_vocab] if B_VR is not None else None
        g_N = torch.where(oov_N, torch.zeros_like(g_N), g_N).float()
        want_h, want_a, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dh_NH = torch.empty_like(hidden_NH) if want_h else None
        dA_RH = torch.zeros_like(A_RH) if A_RH is not None and want_a else None
        dB_VR = torch.zeros_like(B_VR) if B_VR is not None and want_b else None
        for i, s in enumerate(range(0, hidden_NH.shape[0], chunk_rows)):
            h_CH, z_Cv = hidden_NH[s : s + chunk_rows], logits[i]
            xa_CR = xas[i] if A_RH is not None else None
            g_C = g_N[s : s + chunk_rows]
            # d lp / d z = onehot(target) - softmax(z), times the upstream gradient (in place on z)
            z_Cv.sub_(lse_N[s : s + chunk_rows, None]).exp_().mul_(g_C.neg()[:, None])
            z_Cv.scatter_add_(1, safe_N[s : s + chunk_rows, None], g_C[:, None])
            if dh_NH is not None:
                torch.mm(z_Cv, W_vH, out=dh_NH[s : s + chunk_rows])
            if A_RH is not None and B_vR is not None:
                u_CR = torch.mm(z_Cv, B_vR)
                if dh_NH is not None:
                    dh_NH[s : s + chunk_rows].addmm_(u_CR, A_RH, alpha=scaling)
                if dA_RH is not None:
                    dA_RH.addmm_(u_CR.t(), h_CH, alpha=scaling)
                if dB_VR is not None and xa_CR is not None:
                    dB_VR[:in_vocab].addmm_(z_Cv.t(), xa_CR)
        return dh_NH, None, None, dA_RH, dB_VR, None, None, None, None, None


def head_target_logprobs(
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    head: torch.nn.Module,
    in_vocab: int,
    *,
    oov_logprob: float,
    chunk_rows: int = HEAD_CHUNK_ROWS,
) -> torch.Tensor:
    """float32 log p(target) per row of `hidden_NH` under the softmax over the head's first
    `in_vocab` output columns (the restricted vocabulary drops its input-only unk row); a target
    >= `in_vocab` gets the constant `oov_logprob` with zero gradient.

    Same values as `model.token_logprobs(head(hidden))`; gradients (hidden rows, LoRA A/B) equal
    autograd's to float rounding. The head must pass `lora_head_parts` (ValueError otherwise)."""
    parts = lora_head_parts(head)
    if parts is None:
        raise ValueError(f"the fused output head does not support {type(head).__name__} heads with this layout")
    if hidden_NH.shape[0] != targets_N.shape[0]:
        raise ValueError(f"{hidden_NH.shape[0]} hidden rows but {targets_N.shape[0]} targets")
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be >= 1")
    W_VH, A_RH, B_VR, scaling = parts
    if not 0 < in_vocab <= W_VH.shape[0]:
        raise ValueError(f"in_vocab {in_vocab} outside the head's {W_VH.shape[0]} rows")
    keep = torch.is_grad_enabled() and (
        hidden_NH.requires_grad
        or (A_RH is not None and B_VR is not None and (A_RH.requires_grad or B_VR.requires_grad))
    )
    return _HeadTargetLogprobs.apply(
        hidden_NH, targets_N, W_VH, A_RH, B_VR, scaling, int(in_vocab), int(chunk_rows), keep, float(oov_logprob)
    )

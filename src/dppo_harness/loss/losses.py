"""Packed loss path for ``TrainingClient.forward_backward_custom``.

The spec's loss name is the one switch (``LossConfig.loss``, a registered ``LossEntry``). Every
rule sees the same per-token terms (``terms.TokenTerms``), so the family's diagnostics are counted
for every loss call, once, by ``terms.stats``. Rules: ``/work/shared/reference/dppo-binary-tv.md``.
The datums' inputs are concatenated into packed ``_N`` tensors (``unpack_datums``, the one
unpacker: the recorder keeps what it returns); decisions and weights are computed in float64
whatever the caller's dtype, so a float32 boundary token is decided on the exact values the service
returned (bf16/float32 probabilities flip boundary tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import tinker
import torch

from dppo_harness.constants import DPPO_RATIO_CAP, PPO_EPS
from dppo_harness.loss.loss_registry import DPPO_DELTA, DPPO_LOSS, Normalization, get_loss
from dppo_harness.loss.terms import LossStats, TokenTerms, stats

_NORMALIZATIONS = ("sum", "token_mean")
_INPUT_KEYS = ("target_tokens", "logprobs", "advantages", "mask")
_CONFIG_PARAMS = ("ppo_eps", "dppo_delta", "ratio_cap")  # LossConfig fields an entry's params may pin


@dataclass(frozen=True)
class LossConfig:
    """The loss one arm trains with: a registered name, the normalization, and the thresholds of
    the family's per-token terms (the DPPO mask, the PPO clip, the ratio cap), which every loss
    call also counts as diagnostics. `for_loss` takes the thresholds from the registry entry."""

    loss: str
    normalization: Normalization
    ppo_eps: float = PPO_EPS
    dppo_delta: float = DPPO_DELTA
    ratio_cap: float = DPPO_RATIO_CAP

    @classmethod
    def for_loss(cls, name: str, normalization: Normalization) -> LossConfig:
        entry = get_loss(name)
        return cls(name, normalization, **{k: v for k, v in entry.params.items() if k in _CONFIG_PARAMS})

    def __post_init__(self) -> None:
        get_loss(self.loss)  # UnknownLossError (a ValueError) naming the registered losses
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(f"LossConfig.normalization must be one of {_NORMALIZATIONS}, got {self.normalization!r}")
        for name in _CONFIG_PARAMS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise ValueError(f"LossConfig.{name} must be a positive finite number, got {value!r}")
        if self.ppo_eps >= 1:
            raise ValueError(f"LossConfig.ppo_eps must be < 1, got {self.ppo_eps!r}")


@dataclass(frozen=True)
class PackedInputs:
    """The datums' loss inputs packed over N target positions (S sequences), in the dtypes the
    datums hold them: what the loss decides on and what the recorder keeps."""

    sampler_logprobs_N: np.ndarray
    advantages_N: np.ndarray
    mask_N: np.ndarray  # 0/1
    target_tokens_N: np.ndarray  # int64
    first_token_S: np.ndarray  # model_input[0] (-1 for an empty input): with target_tokens it rebuilds every sequence
    lengths_S: np.ndarray  # int64, T of each datum


def unpack_datums(data: Sequence[tinker.Datum]) -> PackedInputs:
    """Concatenate target tokens, sampler logprobs, advantages and mask of all datums (each 1-D,
    all of one datum's the same length; the mask 0/1)."""
    columns: dict[str, list[np.ndarray]] = {k: [] for k in _INPUT_KEYS}
    first: list[int] = []
    for i, datum in enumerate(data):
        inputs = datum.loss_fn_inputs
        missing = [k for k in _INPUT_KEYS if k not in inputs]
        if missing:
            raise ValueError(f"datum {i}: loss_fn_inputs lacks {missing} (needs {list(_INPUT_KEYS)})")
        # tinker.Datum holds every loss input as TensorData (its __post_init__ converts them).
        arrays = {k: np.asarray(inputs[k].to_numpy()) for k in _INPUT_KEYS}
        bad_dims = [k for k, arr in arrays.items() if arr.ndim != 1]
        if bad_dims:
            raise ValueError(f"datum {i}: loss_fn_inputs {bad_dims} must be 1-D")
        length = arrays["target_tokens"].shape[0]
        for k, arr in arrays.items():
            if arr.shape[0] != length:
                raise ValueError(
                    f"datum {i}: loss_fn_inputs[{k!r}] has length {arr.shape[0]}, target_tokens has {length}"
                )
            columns[k].append(arr)
        tokens = datum.model_input.to_ints()
        first.append(tokens[0] if tokens else -1)
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in columns.items()}
    mask_N = cat["mask"]
    bad = ~((mask_N == 0) | (mask_N == 1))
    if bad.any():
        raise ValueError(f"loss mask must be 0/1, found {mask_N[bad][:5].tolist()}")
    return PackedInputs(
        sampler_logprobs_N=cat["logprobs"],
        advantages_N=cat["advantages"],
        mask_N=mask_N,
        target_tokens_N=cat["target_tokens"].astype(np.int64),
        first_token_S=np.asarray(first, dtype=np.int64),
        lengths_S=np.asarray([len(c) for c in columns["target_tokens"]], dtype=np.int64),
    )


def _check_finite(name: str, values_N: torch.Tensor, loss_N: torch.Tensor) -> None:
    bad = loss_N & ~torch.isfinite(values_N)
    if bool(bad.any()):
        idx = int(bad.nonzero()[0, 0])
        raise ValueError(f"non-finite {name} on a loss token (packed index {idx}): {float(values_N[idx])}")


def token_terms(
    logprobs_N: torch.Tensor,
    sampler_logprobs_N: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_N: torch.Tensor,
    cfg: LossConfig,
) -> TokenTerms:
    """Per-token decisions of both rules, detached, in float64."""
    n = logprobs_N.shape[0]
    for name, t in (("sampler_logprobs_N", sampler_logprobs_N), ("advantages_N", advantages_N), ("mask_N", mask_N)):
        if t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs_N has ({n},)")
    lp_N = logprobs_N.detach().to(torch.float64)
    mu_N = sampler_logprobs_N.detach().to(torch.float64)
    adv_N = advantages_N.detach().to(torch.float64)
    loss_N = mask_N.detach() != 0
    _check_finite("current logprob", lp_N, loss_N)
    _check_finite("sampler logprob", mu_N, loss_N)
    _check_finite("advantage", adv_N, loss_N)
    zero = torch.zeros((), dtype=torch.float64)
    # Junk on non-loss positions never reaches exp(): no inf/NaN leaks into any term.
    lp_safe = torch.where(loss_N, lp_N, zero)
    mu_safe = torch.where(loss_N, mu_N, zero)
    diff_N = torch.where(loss_N, lp_safe.exp() - mu_safe.exp(), zero)
    ratio_N = torch.where(loss_N, (lp_safe - mu_safe).exp(), torch.ones((), dtype=torch.float64))
    pos_N = adv_N > 0
    neg_N = adv_N < 0
    nonzero_N = loss_N & (pos_N | neg_N)
    # Directional strict mask; A == 0 takes the negative branch (changes the record, not the grad).
    drop_N = torch.where(pos_N, diff_N > cfg.dppo_delta, diff_N < -cfg.dppo_delta)
    keep_N = loss_N & ~drop_N
    clipped_N = loss_N & ((pos_N & (ratio_N > 1 + cfg.ppo_eps)) | (neg_N & (ratio_N < 1 - cfg.ppo_eps)))
    # Only a KEPT token is shaped by the cap; a dropped one gets no gradient at all, so the cap
    # never counts a token the mask already removed.
    cap_hit_N = nonzero_N & keep_N & (ratio_N > cfg.ratio_cap)
    return TokenTerms(
        prob_diff_N=diff_N,
        ratio_N=ratio_N,
        dppo_keep_N=keep_N,
        ppo_clipped_N=clipped_N,
        ratio_cap_hit_N=cap_hit_N,
        loss_token_N=loss_N,
        nonzero_adv_N=nonzero_N,
        advantages_N=adv_N,
        dppo_delta=cfg.dppo_delta,
        ppo_eps=cfg.ppo_eps,
        ratio_cap=cfg.ratio_cap,
    )


def packed_loss(
    logprobs_N: torch.Tensor,
    sampler_logprobs_N: torch.Tensor,
    terms: TokenTerms,
    cfg: LossConfig,
) -> torch.Tensor:
    """Scalar loss with gradient into ``logprobs_N`` (float64 arithmetic, zero grad off the loss):
    the registered rule's per-token loss, summed, then normalized."""
    zero = torch.zeros((), dtype=torch.float64)
    # Only gradient-bearing tokens enter the graph; the rest get an exact 0 gradient.
    active_N = terms.nonzero_adv_N
    lp_N = torch.where(active_N, logprobs_N.to(torch.float64), zero)
    mu_N = torch.where(active_N, sampler_logprobs_N.detach().to(torch.float64), zero)
    adv_N = torch.where(active_N, terms.advantages_N, zero)
    token_loss_N = get_loss(cfg.loss).token_loss(lp_N, mu_N, adv_N, terms)
    total = token_loss_N.sum()
    if cfg.normalization == "token_mean":
        n_loss = int(terms.loss_token_N.sum())
        total = total / max(n_loss, 1)
    return total


def normalization_declaration(mode: Normalization) -> dict[str, str]:
    """What `effective-config.json` and the reports declare about the loss normalization (a plan's:
    validated at load)."""
    ours = (
        "the summed token losses of one forward_backward_custom call (one minibatch) divided by the number "
        "of loss tokens (mask 1) in that call, zero-advantage tokens included"
        if mode == "token_mean"
        else "the token losses of one forward_backward_custom call (one minibatch) summed over its loss tokens"
    )
    return {
        "mode": mode,
        "definition": ours,
        "applies_to": "both arms' trained loss, the activation-gate pilot, the bounded diagnostic and the feasibility pilot",
        "cookbook_ppo": (
            "tinker-cookbook rl/train.py trains with the service's built-in loss_fn ('ppo' or "
            "'importance_sampling'), whose per-token losses are summed over every loss token of the "
            "forward_backward call: no division by the token count"
        ),
        "difference": (
            "token_mean gradient = sum gradient / loss tokens of the minibatch; under AdamW a constant "
            "rescale changes updates only through eps, but minibatches with different token counts "
            "are weighted differently than under the sum"
            if mode == "token_mean"
            else "the same convention as the cookbook's ppo"
        ),
    }


@dataclass(frozen=True)
class LossCall:
    """One evaluated loss call: the scalar loss, the per-token terms it decided on, their statistics."""

    loss: torch.Tensor
    terms: TokenTerms
    stats: LossStats


def packed_loss_call(
    logprobs_N: torch.Tensor,
    sampler_logprobs_N: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_N: torch.Tensor,
    cfg: LossConfig,
) -> LossCall:
    terms = token_terms(logprobs_N, sampler_logprobs_N, advantages_N, mask_N, cfg)
    return LossCall(packed_loss(logprobs_N, sampler_logprobs_N, terms, cfg), terms, stats(terms))


def _concat_logprobs(logprobs_list: Sequence[torch.Tensor], lengths_S: np.ndarray) -> torch.Tensor:
    if len(logprobs_list) != len(lengths_S):
        raise ValueError(f"got {len(logprobs_list)} logprob tensors for {len(lengths_S)} datums")
    for i, (lp, length) in enumerate(zip(logprobs_list, lengths_S)):
        if lp.ndim != 1 or lp.shape[0] != length:
            raise ValueError(
                f"datum {i}: logprobs tensor has shape {tuple(lp.shape)}, loss inputs have length {length}"
            )
    return torch.cat([lp.to(torch.float64) for lp in logprobs_list]) if logprobs_list else torch.zeros(0)


# What `forward_backward_custom` calls: (datums, their current logprobs) -> (scalar loss, metrics).
CustomLossFn = Callable[[list[tinker.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class PackedLoss:
    """``loss_fn(data, logprobs_list) -> (scalar loss, metrics)`` for ``forward_backward_custom``:
    the packed path at `loss_config`, whatever registered loss it names. `evaluate` is the same
    call with its packed inputs, terms and statistics (what the recorder keeps)."""

    loss_config: LossConfig

    def evaluate(
        self, data: Sequence[tinker.Datum], logprobs_list: Sequence[torch.Tensor]
    ) -> tuple[PackedInputs, LossCall]:
        inputs = unpack_datums(data)
        logprobs_N = _concat_logprobs(logprobs_list, inputs.lengths_S)
        columns = (inputs.sampler_logprobs_N, inputs.advantages_N, inputs.mask_N)
        mu_N, adv_N, mask_N = (torch.from_numpy(x.astype(np.float64)) for x in columns)  # copies, never views
        call = packed_loss_call(logprobs_N, mu_N, adv_N, mask_N, self.loss_config)
        if not call.loss.requires_grad:
            # No gradient-bearing token (or no logprob requires grad): still give every tensor a grad.
            call = replace(call, loss=call.loss + sum((lp * 0.0).sum() for lp in logprobs_list if lp.requires_grad))
        return inputs, call

    def metrics(self, loss_stats: LossStats) -> dict[str, float]:
        """The metrics returned to the SDK: the returned statistics and the arm's loss settings."""
        cfg = self.loss_config
        return loss_stats.metrics() | {
            "loss/arm_dppo": 1.0 if cfg.loss == DPPO_LOSS else 0.0,
            "loss/normalization_sum": 1.0 if cfg.normalization == "sum" else 0.0,
        }

    def __call__(
        self, data: Sequence[tinker.Datum], logprobs_list: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        _, call = self.evaluate(data, logprobs_list)
        return call.loss, self.metrics(call.stats)


def make_loss_fn(cfg: LossConfig) -> PackedLoss:
    """The `forward_backward_custom` loss of one arm (`PackedLoss`)."""
    return PackedLoss(cfg)

"""The embedded server's built-in losses, in one table (SERVER_LOSSES).

Each loss maps per-token target logprobs `lp_T` plus the datum's `loss_fn_inputs` to the
per-token loss (summed by the engine), with one signature:

    fn(lp_T, inputs: dict[str, Tensor], config: dict[str, float]) -> elementwise_loss_T

Each entry records the inputs the loss needs and its `loss_fn_config` keys with defaults; the
engine validates against them and refuses unknown names with the table's list. Semantics are the SDK's documented server losses (0.25's LossFnType).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from dppo_harness.local_server.errors import UserError

ElementwiseLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


@dataclass(frozen=True)
class ServerLoss:
    name: str
    fn: ElementwiseLoss
    inputs: tuple[str, ...]  # required loss_fn_inputs keys, each one value per token
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    check_config: Callable[[dict[str, float]], str | None] | None = None  # message when invalid

    def config(self, loss_fn_config: Mapping[str, float | str] | None) -> dict[str, float]:
        """`loss_fn_config` with defaults filled in; unknown keys and bad values are a UserError."""
        given = dict(loss_fn_config or {})
        if not self.config_defaults and given:
            raise UserError(f"loss_fn {self.name!r} takes no loss_fn_config, got keys {sorted(given)}")
        unknown = set(given) - set(self.config_defaults)
        if unknown:
            raise UserError(f"unknown {self.name} loss_fn_config keys {sorted(unknown)}")
        try:
            cfg = {k: float(given.get(k, default)) for k, default in self.config_defaults.items()}
        except (TypeError, ValueError) as exc:
            raise UserError(f"{self.name} loss_fn_config values must be numbers: {exc}") from None
        problem = self.check_config(cfg) if self.check_config else None
        if problem:
            raise UserError(f"{self.name} loss_fn_config: {problem}, got {cfg}")
        return cfg


def server_loss(name: str) -> ServerLoss:
    spec = SERVER_LOSSES.get(name)
    if spec is None:
        raise UserError(f"unsupported loss_fn {name!r}; supported: {list(SERVER_LOSSES)}")
    return spec


def cross_entropy(lp_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    return -lp_T * inputs["weights"]


def importance_sampling(
    lp_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    ratio_T = torch.exp(lp_T - inputs["logprobs"])
    return -(ratio_T * inputs["advantages"])


def _ppo_bounds(cfg: dict[str, float]) -> str | None:
    if 0 < cfg["clip_low_threshold"] <= 1.0 <= cfg["clip_high_threshold"]:
        return None
    return "thresholds must satisfy 0 < clip_low_threshold <= 1 <= clip_high_threshold"


def ppo(lp_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    ratio_T = torch.exp(lp_T - inputs["logprobs"])
    adv_T = inputs["advantages"]
    clipped_T = torch.clamp(ratio_T, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio_T * adv_T, clipped_T * adv_T)


_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
SERVER_LOSSES = {
    spec.name: spec
    for spec in (
        ServerLoss("cross_entropy", cross_entropy, ("target_tokens", "weights")),
        ServerLoss("importance_sampling", importance_sampling, _POLICY_INPUTS),
        ServerLoss("ppo", ppo, _POLICY_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, _ppo_bounds),
    )
}

"""The comparison's configuration: the paired schedule of a plan's typed run config, its arms,
the order the arms take each step (`ArmOrder`, `comparison_schedule`), the sampling seed of each
rollout step (the same for both arms), and the errors that name a field the comparison cannot be
configured or resumed with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import JsonValue

from dppo_harness import constants

if TYPE_CHECKING:
    from dppo_harness.plans import CriterionConfig, RunConfig


# A JSON object the comparison passes on as written (scores, the decision, provenance blocks).
MAX_SAVE_EVERY = constants.MAX_SAVE_EVERY  # each arm's state is saved at least every 10 steps
# How the arms take each step: one after the other on one thread, or at once on their own clients.
ArmOrder = Literal["interleaved", "concurrent"]


class ComparisonError(RuntimeError):
    """The comparison cannot be configured or resumed as asked (the message names the field)."""


class OptimizerMismatch(ComparisonError):
    """A restore's optimizer check found the server's optimizer differs from the request: the run
    stops. Carries the arm's provenance entry with that check and the run-state file the check's
    get_info reference names (to be registered before the provenance is posted), for the evidence."""

    def __init__(
        self,
        message: str,
        arm: str = "",
        provenance: Mapping[str, JsonValue] | None = None,
        state_file: str | None = None,
    ):
        super().__init__(message)
        self.arm, self.provenance, self.state_file = arm, dict(provenance or {}), state_file


def default_schedule(embedded: bool) -> ArmOrder:
    """How the arms advance unless asked: arm after arm, on any service. It is the schedule the
    feasibility pilot times (its projection adds the arms' steps), and on Spindle two arms'
    concurrent forward_backward requests on the one shared trainer are packed into one batch
    (a failed batch fails both; numerics vary with packing: docs/multi-lora.md), which would tie
    one arm's step to the other's. `--comparison-schedule concurrent` overlaps them on request
    (benchmarks/comparison_schedule.py measures the overlap)."""
    del embedded  # the same default on the embedded server (2 CPU cores gain nothing from overlap)
    return "interleaved"


def comparison_schedule(option: str | None, backend_kind: str | None) -> tuple[ArmOrder, str]:
    """(arm order, why): --comparison-schedule when given, else arm after arm (`default_schedule`),
    the source saying which service it defaulted on."""
    if option:
        if option not in ("interleaved", "concurrent"):
            raise ComparisonError(f"--comparison-schedule: {option!r} is not interleaved or concurrent")
        if option == "concurrent":
            return "concurrent", "--comparison-schedule (the feasibility projection timed the arms one after the other)"
        return "interleaved", "--comparison-schedule"
    embedded = backend_kind == "local"
    return default_schedule(embedded), (
        "default on the embedded server (arm after arm, as the feasibility pilot timed)"
        if embedded
        else "default on a real service (arm after arm, as the feasibility pilot timed; concurrent arms' "
        "forward_backward requests are packed into one batch on a shared trainer)"
    )


@dataclass(frozen=True)
class ArmSpec:
    name: str
    loss: str  # a registered loss name (loss_registry.LOSSES)
    role: str  # "baseline" or "treatment"
    seed: int
    lr: float
    updates_per_batch: int
    adam: dict[str, float] = field(default_factory=dict)  # this arm's AdamParams
    adam_requested: dict[str, float] = field(default_factory=dict)  # the spec's optimizer_config keys


@dataclass(frozen=True)
class ComparisonConfig:
    arms: tuple[ArmSpec, ...]  # the baseline first, then the treatments
    steps: int  # rollout steps per arm
    groups_per_batch: int
    group_size: int
    temperature: float
    max_tokens: int
    eval_items: int
    base_model: str
    lora_rank: int
    dataset: str
    max_seq_len: int
    criteria: tuple[CriterionConfig, ...]
    alpha: float
    save_every: int = 1
    normalization: str = "token_mean"

    def arm(self, name: str) -> ArmSpec:
        return next(a for a in self.arms if a.name == name)

    def role(self, role: str) -> ArmSpec:
        """The first arm with this role (the baseline is unique; see `treatments` for all)."""
        return next(a for a in self.arms if a.role == role)

    @property
    def treatments(self) -> tuple[ArmSpec, ...]:
        return tuple(a for a in self.arms if a.role == "treatment")


def comparison_config(run: RunConfig, *, save_every: int = 1) -> ComparisonConfig:
    """The paired schedule of a plan's typed run config (`Plan.run`)."""
    if not 1 <= save_every <= MAX_SAVE_EVERY:
        raise ComparisonError(f"save_every: {save_every} not in [1, {MAX_SAVE_EVERY}]")
    arms = tuple(
        ArmSpec(a.name, a.loss, a.role, a.seed, a.lr, a.updates_per_batch, a.adam, a.adam_config_requested())
        for a in run.arms
    )
    return ComparisonConfig(
        arms=arms,
        steps=run.rollout_steps,
        groups_per_batch=int(run.groups_per_batch.value),
        group_size=int(run.group_size.value),
        temperature=float(run.temperature.value),
        max_tokens=int(run.max_tokens.value),
        eval_items=run.eval_items,
        base_model=run.base_model,
        lora_rank=run.lora_rank,
        dataset=run.dataset,
        max_seq_len=run.max_seq_len,
        criteria=run.criteria,
        alpha=run.alpha,
        save_every=save_every,
        normalization=run.normalization,
    )


def step_seed(cfg: ComparisonConfig, step: int) -> int:
    """Sampling seed base of a rollout step: the same for both arms, distinct across steps."""
    return cfg.arms[0].seed + step * cfg.groups_per_batch

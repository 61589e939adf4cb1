"""The initialization group as one session runs it: the spec's arms, the trained ones among them,
their one seed and the checkpoint tag.

The contract: `restoration_arms` reads the (single) group from the validated spec; `resolve_group`
narrows it to the arms this session trains and refuses a group whose trained arms do not share one
seed, since they must all load one initial state.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dppo_harness.train.clients import RestorationError

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle
    from dppo_harness.plans import ExperimentSpec, Plan
    from dppo_harness.plans.models import RestorationArm

EXCLUDED_REASON = (
    "never trains in this session: no client created for it, excluded from the optimizer-restoration groups"
)


def restoration_arms(spec: ExperimentSpec) -> list[RestorationArm]:
    """The (single) initialization group's arms with optimizer and config, from the validated spec."""
    rp = spec.restoration_preflight
    if not rp.applicable:
        raise RestorationError("plan has no applicable restoration_preflight")
    if len(rp.groups) != 1:
        raise RestorationError(f"restoration_preflight needs exactly one group, got {len(rp.groups)}")
    arms = rp.groups[0].arms
    if len(arms) < 2:
        raise RestorationError("restoration_preflight group needs at least two arms")
    return list(arms)


@dataclass(frozen=True)
class RestorationGroup:
    """The initialization group as this session runs it: the arms, which of them train, one seed."""

    arms: list[RestorationArm]  # every arm of the group with optimizer and config, from the spec
    all_arm_names: list[str]
    arm_names: list[str]  # the trained arms, in the group's order
    rank: int
    seed: int
    tag: str  # names the checkpoints this run saves
    dataset: str

    def optimizer_config(self, arm: str) -> dict[str, float]:
        """The arm's optimizer_config as the spec gives it (unset keys left out)."""
        return next(a for a in self.arms if a.name == arm).optimizer_config.model_dump(exclude_none=True)

    def excluded_arms(self) -> dict[str, str]:
        """Each arm that does not train, with the reason it has no client and no restore to check."""
        return {a: EXCLUDED_REASON for a in self.all_arm_names if a not in self.arm_names}


def resolve_group(
    plan: Plan, bundle: EvidenceBundle, trained_arms: Sequence[str] | None, run_tag: str | None
) -> RestorationGroup:
    """The group's arms, the trained ones among them, their one seed, and the run's checkpoint tag."""
    spec_plan = plan.spec_plan
    run = spec_plan.run
    assert run is not None  # every experiment spec has its RunConfig from load
    arms = restoration_arms(spec_plan.experiment)
    all_arm_names = [a.name for a in arms]
    if trained_arms is not None:
        unknown = sorted(set(trained_arms) - set(all_arm_names))
        if unknown or not trained_arms:
            raise RestorationError(
                f"trained_arms {list(trained_arms)}: not arms of the initialization group {all_arm_names}"
            )
    arm_names = [a for a in all_arm_names if trained_arms is None or a in set(trained_arms)]
    seeds = {a.name: a.seed for a in run.arms}
    if len({seeds.get(a) for a in arm_names}) > 1:
        raise RestorationError(f"arms in one initialization group have different seeds: {seeds}")
    tag = run_tag or bundle.run_id or uuid.uuid4().hex[:12]
    tag = re.sub(r"[^A-Za-z0-9._-]", "-", str(tag))[:64]
    return RestorationGroup(arms, all_arm_names, arm_names, run.lora_rank, seeds.get(arm_names[0], 0), tag, run.dataset)

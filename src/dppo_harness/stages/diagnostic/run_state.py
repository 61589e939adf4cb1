"""What a diagnostic run measured so far: kept when it stops early, read once into the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import tinker

from dppo_harness.instrument import instrumentation as ins
from dppo_harness.json_types import JsonObject
from dppo_harness.rollout.frozen_batch import FrozenBatch
from dppo_harness.stages.diagnostic.sentinels import SentinelTracker

if TYPE_CHECKING:
    from dppo_harness.stages.diagnostic.update_archive import UpdateArchive


@dataclass
class RunState:
    """What the run measured so far; kept when it stops early, read once into the result."""

    files: list[str] = field(default_factory=list)
    records: list[ins.LossCallRecord] = field(default_factory=list)
    frozen_by_call: list[np.ndarray] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    restore: JsonObject = field(default_factory=dict)
    frozen: FrozenBatch | None = None
    minibatches: list[JsonObject] = field(default_factory=list)
    sentinels: SentinelTracker | None = None
    updates_done: int = 0
    stop_reason: str = "update cap reached"
    setup_seconds: float = 0.0
    restore_seconds: float = 0.0
    sampling_seconds: float = 0.0
    sampled_sequences: int = 0
    update_seconds: list[float] = field(default_factory=list)
    update_phases: list[dict[str, float]] = field(default_factory=list)  # where each update's seconds went
    final_checkpoint: str | None = None
    snapshots: list[str] = field(default_factory=list)
    info: tinker.types.GetInfoResponse | None = None  # the trained client's get_info response
    first_optim: tinker.OptimStepResponse | None = None  # the trained client's own first optim_step response
    initial_output: JsonObject | None = None
    preloaded: bool = False  # trains the restoration preflight's loaded client (no restore of its own)
    archive: UpdateArchive | None = None  # the update records' archive files
    rollout_yield: dict[str, Any] | None = None  # the frozen batch's truncation and answer yield

    def update_archive(self) -> UpdateArchive:
        """The run's update archive (the run opens it before its first update)."""
        if self.archive is None:
            raise RuntimeError("the diagnostic run has no update archive open")
        return self.archive

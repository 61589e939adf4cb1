"""The budget ledger: the run's wall/GPU budget and each stage's time (sidecar `ledger.json`).

The ledger only keeps and judges times; it returns the metrics it wants posted, and the bundle
posts them to result.json and writes the sidecar.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dppo_harness.evidence.errors import EvidenceError


class BudgetLedger:
    def __init__(self, path: Path, clock: Callable[[], float]):
        self.path = path
        self._clock = clock
        self._t0 = clock()
        self.data: dict[str, Any] = {"budget": None, "stages": []}
        if path.exists():
            self.data = json.loads(path.read_text())

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)

    def has_entries(self) -> bool:
        return bool(self.data["stages"] or self.data["budget"])

    def elapsed_seconds(self) -> float:
        return self._clock() - self._t0

    def set_budget(self, max_wall_seconds: float, gpu_hours: float | None) -> dict[str, float]:
        self.data["budget"] = {
            "max_wall_seconds": float(max_wall_seconds),
            "gpu_hours": None if gpu_hours is None else float(gpu_hours),
        }
        return {"budget/max_wall_seconds": float(max_wall_seconds)}

    def remaining_seconds(self) -> float | None:
        b = self.data["budget"]
        return None if b is None else b["max_wall_seconds"] - self.elapsed_seconds()

    def block_if_over(
        self, stage: str, projected_seconds: float, projected_gpu_hours: float | None
    ) -> dict[str, float] | None:
        """None if the projection fits what remains; else records the stage as blocked_by_budget
        and returns the metrics to post."""
        b = self.data["budget"]
        if b is None:
            raise EvidenceError("budget_allows: no budget set (call set_budget first)")
        remaining = b["max_wall_seconds"] - self.elapsed_seconds()
        reasons = []
        if projected_seconds > remaining:
            reasons.append(f"projected {projected_seconds:.1f}s > remaining {remaining:.1f}s of wall budget")
        if projected_gpu_hours is not None and b["gpu_hours"] is not None and projected_gpu_hours > b["gpu_hours"]:
            reasons.append(f"projected {projected_gpu_hours:.3f} GPU-h > cap {b['gpu_hours']:.3f}")
        if not reasons:
            return None
        self.data["stages"].append(
            {
                "stage": stage,
                "seconds": 0.0,
                "status": "blocked_by_budget",
                "projected_seconds": float(projected_seconds),
                "remaining_seconds": float(remaining),
                "reason": "; ".join(reasons),
            }
        )
        return {
            f"budget/blocked/{stage}": 1.0,
            f"budget/projected_seconds/{stage}": float(projected_seconds),
            f"budget/remaining_seconds/{stage}": float(remaining),
        }

    def record_stage(self, stage: str, seconds: float, status: str) -> dict[str, float]:
        """Append one stage timing; returns the stage's and the run's total wall-seconds metrics."""
        self.data["stages"].append(
            {"stage": stage, "seconds": float(seconds), "status": status, "elapsed_at_end": self.elapsed_seconds()}
        )
        stages = self.data["stages"]
        return {
            f"budget/wall_seconds/{stage}": sum(s["seconds"] for s in stages if s["stage"] == stage),
            "budget/wall_seconds_total": sum(s["seconds"] for s in stages),
        }

    def note(self, **items: Any) -> None:
        """Session facts kept with the ledger (stages_selected, budget_source, stage_failures)."""
        self.data.update(copy.deepcopy(items))

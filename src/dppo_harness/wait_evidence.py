"""The wait policy's evidence (service_wait): while a call waits, result.json's `service_wait` block
and rate-limited result snapshots; when the policy stops the stage, the released clients and the
stopped run's result (status failed, verdict inconclusive, incomplete_execution, and the
capacity_block or the hang)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dppo_harness.evidence.result import REHEARSAL_PLAN_PREFIX, REHEARSAL_PREFIX
from dppo_harness.evidence.snapshots import post_snapshot
from dppo_harness.service_wait import CapacityExhausted, ServiceStopped, ServiceWaiter, WaitStatus

# Wait snapshots share the bundle's 64 files with the stages' own evidence: on the embedded server
# (windows scaled 100x down) a wait is "long" after about a second, so every few seconds of a
# loaded run would otherwise take a file the stage needs at its end.
MAX_WAIT_SNAPSHOTS = 8


class BundlePoster:
    """The waiter's evidence hooks for one bundle: `post` writes the `service_wait` block (what is
    waited on, since when, queue state and reason) into result.json and, at most every
    `snapshot_every_s` and at most `max_snapshots` times, a result snapshot (later ones are counted
    in the block as `snapshots_skipped`); `stop` releases every registered client and writes the
    stopped run's result (status failed, verdict inconclusive, incomplete_execution, and the
    capacity_block or the hang), then a snapshot."""

    def __init__(self, bundle: Any, registry: Any = None, clock: Callable[[], float] = time.monotonic,
                 max_snapshots: int = MAX_WAIT_SNAPSHOTS):
        self.bundle, self.registry, self.clock = bundle, registry, clock
        self.max_snapshots = max_snapshots
        self._last_snapshot: float | None = None
        self.posts = 0
        self.snapshots = 0
        self.snapshots_skipped = 0

    def post(self, waiter: ServiceWaiter, status: WaitStatus) -> None:
        self.posts += 1
        now = self.clock()
        due = self._last_snapshot is None or now - self._last_snapshot >= waiter.policy.snapshot_every_s
        if due:
            self._last_snapshot = now
            if self.snapshots >= self.max_snapshots:
                self.snapshots_skipped += 1
        skipped = {"snapshots_skipped": self.snapshots_skipped} if self.snapshots_skipped else {}
        self.bundle.update_result(service_wait={**waiter.evidence(), "waiting": status.as_dict(), **skipped})
        if due and self.snapshots < self.max_snapshots:
            self.snapshots += 1
            post_snapshot(self.bundle, f"waiting: {status.call} on {status.client}")

    def stop(self, waiter: ServiceWaiter, stop: ServiceStopped) -> None:
        released = bool(self.registry.release_all("errored")) if self.registry is not None else False
        if isinstance(stop, CapacityExhausted):
            stop.block = replace(stop.block, released_clients=released)
        fields: dict[str, Any] = {**stop.result_fields(),
                                  "service_wait": {**waiter.evidence(), "released_clients": released,
                                                  **({"snapshots_skipped": self.snapshots_skipped}
                                                     if self.snapshots_skipped else {})}}
        result = self.bundle.result
        if result.get("original_hypothesis_tested") is None:
            fields.update(original_hypothesis_tested=False,
                          tested_instead=f"nothing to completion: the run stopped waiting on the service ({stop.kind})")
        if not str(result.get("summary") or "").removeprefix(REHEARSAL_PREFIX).removeprefix(
                REHEARSAL_PLAN_PREFIX).strip():
            fields["summary"] = f"Stopped waiting on the service: {stop.line}."
        self.bundle.update_result(**fields)
        post_snapshot(self.bundle, f"service stop ({stop.kind})", reserve=4)

"""The wait policy's evidence: while a call waits, result.json's `service_wait` block
and rate-limited result snapshots; when the policy stops the stage, the released clients and the
stopped run's result (status failed, verdict inconclusive, incomplete_execution, and the
capacity_block or the hang)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dppo_harness.evidence import budget
from dppo_harness.evidence.files import MAX_FILES
from dppo_harness.evidence.result import REHEARSAL_PLAN_PREFIX, REHEARSAL_PREFIX
from dppo_harness.evidence.snapshots import post_snapshot
from dppo_harness.service.wait.policy import CapacityExhausted, ServiceDied, ServiceStopped
from dppo_harness.service.wait.waiter import ServiceWaiter, WaitStatus

if TYPE_CHECKING:
    from dppo_harness.evidence.bundle import EvidenceBundle
    from dppo_harness.service.observed import ClientRegistry

# Waiting snapshots per bundle: at most MAX_WAIT_SNAPSHOTS (the evidence budget's share,
# evidence.budget.WAIT_SNAPSHOTS), and only while the run uses under half its file slots, so that
# snapshots never crowd out the stages' own evidence (on the embedded server, whose windows are
# scaled down, nearly every call counts as a wait). result.json itself is still updated at every post.
MAX_WAIT_SNAPSHOTS = budget.WAIT_SNAPSHOTS
WAIT_SNAPSHOT_RESERVE = MAX_FILES // 2


class BundlePoster:
    """The waiter's evidence hooks for one bundle: `post` writes the `service_wait` block into
    result.json and, at most every `snapshot_every_s`, a snapshot; `stop` releases every registered
    client and writes the stopped run's result, then a snapshot."""

    def __init__(
        self,
        bundle: EvidenceBundle,
        registry: ClientRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.bundle, self.registry, self.clock = bundle, registry, clock
        self._lock = threading.Lock()  # concurrent waits (the arms') post at once
        self._last_snapshot: float | None = None
        self.posts = 0
        self.snapshots = 0

    def post(self, waiter: ServiceWaiter, status: WaitStatus | None) -> None:
        """The block as it stands; `status` None or settled (the wait ended): no snapshot."""
        with self._lock:
            self.posts += 1
            self.bundle.update_result(service_wait=waiter.evidence())
            if status is None or status.outcome != "waiting":
                return
            now = self.clock()
            due = self._last_snapshot is None or now - self._last_snapshot >= waiter.policy.snapshot_every_s
            if due and self.snapshots < MAX_WAIT_SNAPSHOTS:
                self._last_snapshot = now
                self.snapshots += (
                    post_snapshot(
                        self.bundle, f"waiting: {status.call} on {status.client}", reserve=WAIT_SNAPSHOT_RESERVE
                    )
                    is not None
                )

    def stop(self, waiter: ServiceWaiter, stop: ServiceStopped) -> None:
        # A dead server holds no session to finish, and each close would wait out its timeout.
        dead = isinstance(stop, ServiceDied)
        released = bool(self.registry.release_all("errored")) if self.registry is not None and not dead else False
        if isinstance(stop, CapacityExhausted):
            stop.block = replace(stop.block, released_clients=released)
        fields: dict[str, Any] = {
            **stop.result_fields(),
            "service_wait": {**waiter.evidence(), "released_clients": released},
        }
        result = self.bundle.result
        if result.get("original_hypothesis_tested") is None:
            fields.update(
                original_hypothesis_tested=False,
                tested_instead=f"nothing to completion: the run stopped waiting on the service ({stop.kind})",
            )
        body = str(result.get("summary") or "").removeprefix(REHEARSAL_PREFIX).removeprefix(REHEARSAL_PLAN_PREFIX)
        if not body.strip():
            fields["summary"] = f"Stopped waiting on the service: {stop.line}."
        self.bundle.update_result(**fields)
        post_snapshot(self.bundle, f"service stop ({stop.kind})", reserve=4)

"""Client release: every model the harness's sessions created, unloaded per stage and always on exit,
each release kept as an event (client-releases.json).

tinker 0.25 has no session close: a model holds its trainer slot until the service's idle sweep
unless unloaded. So a session's release is the `unload_model` of each model it created, released
only when the service answered every one.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
from dataclasses import asdict, dataclass

from dppo_harness.json_types import JsonObject
from dppo_harness.service.observed import CreatedClient, ObservedServiceClient
from dppo_harness.service.wait.waiter import now_iso

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    client: ObservedServiceClient
    stage: str
    label: str
    released: bool = False
    error: str | None = None
    released_at: str | None = None


def _created_record(c: CreatedClient) -> JsonObject:
    r, done = c.release, None
    if r is not None:
        done = {"how": "unload_model", "answered": r.answered, "service_said": r.text, "seconds": r.seconds}
    return {**asdict(c), "release": done}


def training_clients_of(service_client: object) -> list[CreatedClient]:
    """The training clients an ObservedServiceClient created (none for any other client)."""
    return list(getattr(service_client, "created", None) or [])


class ClientRegistry:
    """The harness's ServiceClients, their models unloaded per stage and always on exit; each release
    is an event naming the sessions it released and those still holding a model."""

    def __init__(self, release_timeout_s: float = 60.0):
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self.release_timeout_s = release_timeout_s
        self._atexit = False
        self.current_stage: str | None = None  # set by the plugin as stages begin
        self.events: list[JsonObject] = []  # client-releases.json's events
        self.releases: list[JsonObject] = []  # the plugin's releases, each session's record with when
        self._gone: str | None = None  # why the service can release nothing any more

    def service_gone(self, why: str) -> None:
        """The service process exited: no model is left to unload, and each unload would only
        wait out `release_timeout_s`; every later release records `why` instead."""
        self._gone = why

    def register(
        self, client: ObservedServiceClient, *, stage: str, label: str = "service-client"
    ) -> ObservedServiceClient:
        with self._lock:
            self._entries.append(_Entry(client, stage, label))
        return client

    def install_atexit(self) -> None:
        if not self._atexit:
            atexit.register(self.release_all, "interrupted")
            self._atexit = True

    def _release(self, entry: _Entry) -> None:
        """Unload what the session created; released only when every unload was answered."""
        if entry.released:
            return
        if self._gone is not None:
            entry.error = f"not released: {self._gone}; nothing is left to unload"
            return
        try:
            outcomes = entry.client.release(self.release_timeout_s)
        except Exception as exc:  # record and carry on: releasing the rest matters more
            entry.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            logger.warning("releasing %s failed: %s", entry.label, entry.error)
            return
        failed = [o for o in outcomes if not o.answered]
        if failed:
            entry.error = "; ".join(f"{o.model_id}: {o.text}" for o in failed)
            logger.warning("releasing %s failed: %s", entry.label, entry.error)
            return
        entry.released, entry.error, entry.released_at = True, None, now_iso()

    def release_stage(self, stage: str) -> list[JsonObject]:
        """Release the sessions registered under `stage`; their records, kept in `releases`."""
        with self._lock:
            entries = [e for e in self._entries if e.stage == stage]
        self._release_and_note(entries, f"release of stage {stage!r}")
        return self._noted(entries)

    def release_remaining(self) -> None:
        """Release every session not yet released, kept in `releases` (the session fixture's teardown
        may run before pytest_sessionfinish, so both call this; the second finds nothing pending)."""
        with self._lock:
            pending = [e for e in self._entries if not e.released]
        if pending:
            self.release_all()
            self._noted(pending)

    def _noted(self, entries: list[_Entry]) -> list[JsonObject]:
        at = now_iso()
        records = [self._record(e) for e in entries]
        self.releases += [{**r, "released_at": at} for r in records]
        return records

    def release_all(self, status: str = "success") -> bool:
        """Release every registered client; True iff all of them are released (vacuously with none).
        `status` (success, errored, interrupted) names why, in the event."""
        with self._lock:
            entries = list(self._entries)
        self._release_and_note(entries, f"release of every session ({status})")
        return all(e.released for e in entries)

    def _release_and_note(self, entries: list[_Entry], trigger: str) -> None:
        pending = [e for e in entries if not e.released]
        for e in pending:
            self._release(e)
        if not pending:
            return
        # httpcore leaves the connection of a request a stop cancelled in a reference cycle: its
        # socket to the service stays open until the cycle is collected, so collect it now.
        gc.collect()
        with self._lock:
            still_open = [e for e in self._entries if not e.released]
            self.events.append(
                {
                    "at": now_iso(),
                    "stage": self.current_stage,
                    "trigger": trigger,
                    "closed": [e.label for e in pending if e.released],
                    "close_failed": [{"label": e.label, "error": e.error} for e in pending if not e.released],
                    "unloaded": [
                        c.model_id
                        for e in pending
                        for c in training_clients_of(e.client)
                        if c.release is not None and c.release.answered
                    ],
                    "still_open": [
                        {"label": e.label, "training_clients": len(training_clients_of(e.client))} for e in still_open
                    ],
                }
            )

    @staticmethod
    def _record(e: _Entry) -> JsonObject:
        return {
            "label": e.label,
            "stage": e.stage,
            "released": e.released,
            "error": e.error,
            "released_at": e.released_at,
            "training_clients": [_created_record(c) for c in training_clients_of(e.client)],
        }

    def training_clients_by_stage(self) -> dict[str, int]:
        """How many training clients every registered session created, per stage they were created in."""
        counts: dict[str, int] = {}
        with self._lock:
            for e in self._entries:
                for c in training_clients_of(e.client):
                    key = c.stage or "outside any stage"
                    counts[key] = counts.get(key, 0) + 1
        return counts

    def records(self) -> list[JsonObject]:
        with self._lock:
            return [self._record(e) for e in self._entries]

    @property
    def all_released(self) -> bool:
        with self._lock:
            return all(e.released for e in self._entries)

    def evidence(self) -> JsonObject:
        """client-releases.json: every session (ServiceClient) with its training clients, when each
        was released, what stayed open at each release, and training clients created per stage."""
        by_stage = self.training_clients_by_stage()
        return {
            "kind": "client_releases",
            "all_released": all(r["released"] for r in self.releases),
            "sessions": list(self.records()),
            "events": list(self.events),
            "training_clients_by_stage": dict(by_stage),
            "training_clients_total": sum(by_stage.values()),
            "releases": list(self.releases),
            "note": CLIENT_RELEASE_NOTE,
        }


CLIENT_RELEASE_NOTE = (
    "tinker 0.25.0 has no session finish and no close: a model stays loaded until it is unloaded or the "
    "service's idle sweep reclaims it. Each session below lists the training clients it created (stage, SDK "
    "method, role) and, per model, how it was released: `unload_model` (POST /api/v1/unload_model, the "
    "SDK's UnloadModelRequest), whether the service answered it and what it said. A session counts as "
    "released only when every unload was answered; `events` says, at each release, which sessions it "
    "released and which stayed open."
)

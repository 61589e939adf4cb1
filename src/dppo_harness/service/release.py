"""Client release: the ServiceClients this harness created, released per stage and always on exit,
each release kept as an event (client-releases.json)."""

from __future__ import annotations

import atexit
import gc
import logging
import threading
from dataclasses import asdict, dataclass

import tinker
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from dppo_harness.json_types import JsonObject
from dppo_harness.service.observed import CloseStatus, CreatedClient, now_iso

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    client: tinker.ServiceClient
    stage: str
    label: str
    released: bool = False
    error: str | None = None
    released_at: str | None = None
    closing: AwaitableConcurrentFuture[None] | None = (
        None  # the future of the one close() this entry sent (the SDK answers a second at once)
    )


def training_clients_of(service_client: object) -> list[CreatedClient]:
    """The training clients an ObservedServiceClient created (none for any other client)."""
    return list(getattr(service_client, "created", None) or [])


class ClientRegistry:
    """ServiceClients this harness created, released per stage and always on exit.

    The SDK's only release is `ServiceClient.close(status)`: it finishes the session on the server
    (POST sessions/{id}/finish, which ends the session's training and sampling clients) and stops
    heartbeats. A client counts as released only when that future completed without error. Each
    release is kept as an event naming the sessions it closed and the ones still open.
    """

    def __init__(self, release_timeout_s: float = 60.0):
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self.release_timeout_s = release_timeout_s
        self._atexit = False
        self.current_stage: str | None = None  # set by the plugin as stages begin
        self.events: list[JsonObject] = []  # client-releases.json's events
        self._gone: str | None = None  # why the service can close nothing any more

    def service_gone(self, why: str) -> None:
        """The service process exited: no session is left to finish, and each close would only
        wait out `release_timeout_s`; every later release records `why` instead of closing."""
        self._gone = why

    def stage_now(self) -> str | None:
        return self.current_stage

    def register(
        self, client: tinker.ServiceClient, *, stage: str, label: str = "service-client"
    ) -> tinker.ServiceClient:
        with self._lock:
            self._entries.append(_Entry(client, stage, label))
        return client

    def install_atexit(self) -> None:
        if not self._atexit:
            atexit.register(self.release_all, "interrupted")
            self._atexit = True

    def _release(self, entry: _Entry, status: CloseStatus) -> None:
        """Close once and judge by that close's own future: the SDK's second close() returns a
        completed future whatever became of the first, so it proves nothing."""
        if entry.released:
            return
        if self._gone is not None and entry.closing is None:
            entry.error = f"not closed: {self._gone}; nothing is left to close"
            return
        try:
            if entry.closing is None:
                entry.closing = entry.client.close(status)
            elif hasattr(entry.closing, "done") and not entry.closing.done():
                entry.error = f"{entry.error or 'the close is still running'} (not retried: the first close decides)"
            if hasattr(entry.closing, "result"):
                entry.closing.result(timeout=self.release_timeout_s)
            entry.released, entry.error, entry.released_at = True, None, now_iso()
        except TimeoutError:
            # The SDK retries the session finish for minutes with its heartbeat still running:
            # cancelling its close ends the retries and still closes the holders (its `finally`).
            # The SDK's AwaitableConcurrentFuture has no cancel(); the concurrent future it wraps has.
            inner: object = getattr(entry.closing, "_future", entry.closing)
            cancelled = hasattr(inner, "cancel") and inner.cancel()
            entry.error = (
                f"TimeoutError: the session finish (POST sessions/<id>/finish) got no answer in "
                f"{self.release_timeout_s:g} s; the SDK's close was "
                f"{'cancelled' if cancelled else 'not cancellable'}, so the service may still hold "
                f"the session until it expires"
            )
            logger.warning("releasing %s failed: %s", entry.label, entry.error)
        except Exception as exc:  # record and carry on: releasing the rest matters more
            entry.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            logger.warning("releasing %s failed: %s", entry.label, entry.error)

    def release_stage(self, stage: str, status: CloseStatus = "success") -> list[JsonObject]:
        with self._lock:
            entries = [e for e in self._entries if e.stage == stage]
        self._release_and_note(entries, status, f"release of stage {stage!r}")
        return [self._record(e) for e in entries]

    def release_all(self, status: CloseStatus = "success") -> bool:
        """Release every registered client; True iff all of them are released (vacuously with none)."""
        with self._lock:
            entries = list(self._entries)
        self._release_and_note(entries, status, f"release of every session ({status})")
        return all(e.released for e in entries)

    def _release_and_note(self, entries: list[_Entry], status: CloseStatus, trigger: str) -> None:
        pending = [e for e in entries if not e.released]
        for e in pending:
            self._release(e, status)
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
                    "still_open": [
                        {"label": e.label, "training_clients": len(training_clients_of(e.client))} for e in still_open
                    ],
                }
            )
            cancels = {e.label: sent for e in pending if (sent := getattr(e.client, "cancels", None))}
            if cancels:  # cancel_future sent for samples a stop abandoned: {"asked", "unsent"} per session
                self.events[-1]["cancels_of_abandoned_samples"] = cancels

    @staticmethod
    def _record(e: _Entry) -> JsonObject:
        return {
            "label": e.label,
            "stage": e.stage,
            "released": e.released,
            "error": e.error,
            "released_at": e.released_at,
            "training_clients": [asdict(c) for c in training_clients_of(e.client)],
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

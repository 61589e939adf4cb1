"""Queue-state watches: what the service says about a client's queue, as the SDK's observers see it.

A capacity shortage reaches the SDK as 408 `try_again` polls whose `queue_state` only a
`QueueStateObserver` sees, and a refused sample submit (429 or a billing pause) is swallowed and
retried inside the SDK. `QueueWatch` is installed as a client's observer (the SDK's own logger
still gets every report) and keeps the latest report and every pause (`Episode`), with the
service's own words exactly as sent; `install_creation_watch` / `CreationWatch` do the same for
client-creating calls, and `watch_sampling_client` for a sampling client and its refused submits.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import tinker
from tinker._client import AsyncTinker
from tinker.lib.api_future_impl import QueueState, QueueStateObserver, _APIFuture
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.internal_client_holder import InternalClientHolder
from tinker.lib.public_interfaces import service_client as sc_module
from tinker.lib.queue_state_logger import QueueStateLogger
from tinker.resources.futures import AsyncFuturesResource

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F")
E = TypeVar("E")

# States the harness adds to the SDK's own (active, paused_capacity, paused_rate_limit, unknown), from
# what the SDK retries without telling its observer: a refused sample submit, and refused polls.
PAYMENT_REQUIRED = "payment_required"  # HTTP 402 on a poll: the SDK sleeps and re-polls for up to an hour
POLL_REFUSED = "poll_refused"  # HTTP 429 on a poll: the SDK backs off and re-polls without limit
TRANSPORT_ERROR = "transport_error"  # 5xx or no answer (connection reset) on a poll: re-polled without limit
# A sample's session poll (retrieve_futures) answered without its result: that path sends no queue state.
SESSION_POLLED = "session_polled"
SESSION_POLLED_REASON = "retrieve_futures answered without this sample's result (no queue state on that path)"
PAUSED_STATES = frozenset({"paused_capacity", "paused_rate_limit", "submit_refused", PAYMENT_REQUIRED, POLL_REFUSED})
MAX_TEXT = 500  # of an error text kept from a refused poll
# What the harness records for a refused sample submit whose answer it did not see (the SDK swallows
# the 429 or billing pause inside SamplingClient._send_asample_request and retries it).
SUBMIT_REFUSED_REASON = "sample submit refused (HTTP 429 or a billing pause); the SDK retries it without limit"


@dataclass(frozen=True)
class QueueReport:
    state: str  # as the SDK passed it: active, paused_capacity, paused_rate_limit, unknown; or submit_refused
    reason: str | None  # queue_state_reason (or a refused submit's error text) exactly as sent; None: none sent
    since: float  # time.monotonic() when this state began (a new reason text does not restart it)
    at: float  # time.monotonic() of the latest report
    http_status: int | None = None  # a refused submit's HTTP status

    @property
    def paused(self) -> bool:
        return self.state in PAUSED_STATES


@dataclass
class Episode:
    """One pause of a client's queue, as the watch saw it: from the first paused report to the
    first report that is not paused (None: still paused)."""

    id: int
    state: str
    reason: str | None
    began: float  # time.monotonic()
    ended: float | None = None
    http_status: int | None = None
    seen: float = 0.0  # time.monotonic() of the latest paused report
    reason_changes: int = 0  # how often the service reworded the pause (a queue position, say)


class QueueSource(Protocol):
    """What a wait reads of a call's queue: the latest report, and the pauses seen since a time
    (QueueWatch, CreationWatch, the creation-time loggers)."""

    def latest(self) -> QueueReport | None: ...

    def episodes_since(self, t0: float) -> list[Episode]: ...


class CreationLogger(QueueSource, Protocol):
    """A creation call's queue-state logger that is also a watch, with when it was made."""

    created: float


_episode_ids = iter(range(1, 1 << 62))
_episode_lock = threading.Lock()


def _next_episode_id() -> int:
    with _episode_lock:
        return next(_episode_ids)


class QueueWatch(QueueStateObserver):
    """The SDK's queue-state observer of one client: keeps the latest report and every pause
    (episodes, so a pause shorter than a waiter's poll is still seen), and passes every report on
    to the observer it replaced (the SDK's own logger)."""

    MAX_EPISODES = 100

    def __init__(
        self,
        forward: Callable[[QueueState, str | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._forward, self._clock = forward, clock
        self._lock = threading.Lock()
        self._latest: QueueReport | None = None
        self._episodes: list[Episode] = []
        self.reports = 0
        self.session_polls = 0  # retrieve_futures polls answered (a sampling client on the session poller)

    def _set(self, state: str, reason: str | None, http_status: int | None = None) -> None:
        now = self._clock()
        with self._lock:
            self.reports += 1
            last = self._latest
            # One state is one pause whatever its text: a reason that changes every poll (a queue
            # position) or a refused submit's latest error continues the pause it reports.
            same = last is not None and last.state == state
            since = last.since if last is not None and same else now
            self._latest = QueueReport(state, reason, since, now, http_status)
            current = self._episodes[-1] if self._episodes and self._episodes[-1].ended is None else None
            if current is not None and not (same and state in PAUSED_STATES):
                current.ended = now
                current = None
            if state in PAUSED_STATES:
                if current is None:
                    self._episodes.append(
                        Episode(_next_episode_id(), state, reason, now, http_status=http_status, seen=now)
                    )
                    del self._episodes[: -self.MAX_EPISODES]
                else:  # the same pause: the service's latest words
                    current.reason_changes += current.reason != reason
                    current.reason, current.http_status, current.seen = reason, http_status, now

    def on_queue_state_change(self, queue_state: QueueState, queue_state_reason: str | None) -> None:
        self._set(getattr(queue_state, "value", str(queue_state)), queue_state_reason)
        if self._forward is not None:
            try:
                self._forward(queue_state, queue_state_reason)
            except Exception as exc:  # the SDK's logger must not break the harness's watch
                logger.debug("queue-state observer failed: %s", exc)

    def on_transport_error(self, http_status: int, text: str) -> None:
        """A poll the SDK will retry without telling the observer (402, 429, 5xx, no answer):
        kept as a state with the service's own text and status."""
        state = PAYMENT_REQUIRED if http_status == 402 else POLL_REFUSED if http_status == 429 else TRANSPORT_ERROR
        self._set(state, text[:MAX_TEXT], http_status or None)

    def on_session_poll(self) -> None:
        """A session poll (retrieve_futures) answered: the service is there, and says nothing of the queue."""
        with self._lock:
            self.session_polls += 1
        self._set(SESSION_POLLED, SESSION_POLLED_REASON)

    def on_submit_refused(self, http_status: int | None = None, text: str | None = None) -> None:
        self._set("submit_refused", text if text is not None else SUBMIT_REFUSED_REASON, http_status)

    def on_submitted(self) -> None:
        last = self.latest()
        if last is not None and last.state == "submit_refused":
            self._set("active", None)

    def latest(self) -> QueueReport | None:
        with self._lock:
            return self._latest

    def episodes_since(self, t0: float) -> list[Episode]:
        """Pauses reported at or after `t0` (copies): a pause last reported before `t0` (by a
        future that has since failed, say) is not this wait's."""
        with self._lock:
            return [replace(e) for e in self._episodes if e.seen >= t0]


class _CreationWatches:
    """Creation calls' observers. The SDK builds a fresh QueueStateLogger(…, "Model creation") inside
    each client-creating call; `install_creation_watch` makes those loggers QueueWatches too, and a
    creation's wait reads the latest report of the loggers created since it began."""

    def __init__(self, keep: int = 64) -> None:
        self._lock = threading.Lock()
        self._made: collections.deque[CreationLogger] = collections.deque(maxlen=keep)  # the latest creations'

    def add(self, watch: CreationLogger) -> None:
        with self._lock:
            self._made.append(watch)

    def since(self, t0: float) -> list[CreationLogger]:
        with self._lock:
            return [w for w in self._made if w.created >= t0]


CREATION_WATCHES = _CreationWatches()
_installed: set[str] = set()  # the SDK patches in place in this process
_install_lock = threading.Lock()


def _once(name: str, install: Callable[[], bool]) -> bool:
    """Run `install` (a patch of the SDK) once per process; True if it is in place."""
    with _install_lock:
        if name not in _installed:
            if not install():
                return False
            _installed.add(name)
        return True


def install_creation_watch() -> bool:
    """Make the SDK's creation-time QueueStateLogger also a watch (module attribute of
    tinker.lib.public_interfaces.service_client, looked up at each call). True if installed."""
    return _once("creation", _install_creation_watch)


def _install_creation_watch() -> bool:
    if getattr(sc_module, "QueueStateLogger", None) is not QueueStateLogger:
        logger.warning(
            "tinker.lib.public_interfaces.service_client.QueueStateLogger is not the SDK's "
            "QueueStateLogger: creation pauses are not observed"
        )
        return False

    class WatchedQueueStateLogger(QueueStateLogger):
        """The SDK's logger, plus a QueueWatch of the creation call it observes."""

        def __init__(self, identifier: str, message_prefix: str = "Operation"):
            super().__init__(identifier, message_prefix)
            self.watch = QueueWatch()
            self.created = time.monotonic()
            CREATION_WATCHES.add(self)

        def on_queue_state_change(self, queue_state: QueueState, queue_state_reason: str | None) -> None:
            self.watch.on_queue_state_change(queue_state, queue_state_reason)
            super().on_queue_state_change(queue_state, queue_state_reason)

        def on_transport_error(self, http_status: int, text: str) -> None:
            self.watch.on_transport_error(http_status, text)

        def latest(self) -> QueueReport | None:
            return self.watch.latest()

        def episodes_since(self, t0: float) -> list[Episode]:
            return self.watch.episodes_since(t0)

    sc_module.QueueStateLogger = WatchedQueueStateLogger  # type: ignore[misc]  # the patch: looked up at each call
    return True


def install_transport_watch() -> bool:
    """Let each future's observer see the poll errors the SDK retries silently (402 for up to an
    hour, 429 and 5xx and connection resets without limit): `_APIFuture._handle_transport_error`
    first tells an observer that has `on_transport_error` (the harness's watches), then does what
    the SDK does. True if installed."""
    return _once("transport", _install_transport_watch)


def _install_transport_watch() -> bool:
    original = getattr(_APIFuture, "_handle_transport_error", None)
    if original is None:  # pragma: no cover - another SDK layout
        logger.warning("the SDK's futures have no _handle_transport_error: refused polls are not observed")
        return False

    _APIFuture._handle_transport_error = _observer_told_first(original)  # type: ignore[method-assign,assignment]  # the patch
    return True


def _observer_told_first(
    original: Callable[Concatenate[F, E, P], Awaitable[R]],
) -> Callable[Concatenate[F, E, P], Awaitable[R]]:
    """The SDK's `_handle_transport_error`, after telling the future's observer (if it listens)."""

    async def observed(self: F, err: E, *args: P.args, **kwargs: P.kwargs) -> R:
        note = getattr(getattr(self, "_queue_state_observer", None), "on_transport_error", None)
        status = getattr(err, "status_code", None)
        if callable(note) and status != 408:  # a 408 is try_again: its queue state reaches the observer
            with contextlib.suppress(Exception):
                note(int(status or 0), str(getattr(err, "detail", "")))
        return await original(self, err, *args, **kwargs)

    return observed


class CreationWatch:
    """The queue state of client creations started at or after `t0` (the latest report wins)."""

    def __init__(self, t0: float):
        self.t0 = t0

    def latest(self) -> QueueReport | None:
        reports = [r for w in CREATION_WATCHES.since(self.t0) if (r := w.latest()) is not None]
        return max(reports, key=lambda r: r.at) if reports else None

    def episodes_since(self, t0: float) -> list[Episode]:
        return [e for w in CREATION_WATCHES.since(self.t0) for e in w.episodes_since(t0)]


class _SubmitTap:
    """A sampling client's view of its SDK holder that notes the HTTP error of each sample submit
    (status and the service's own text) before the SDK swallows it, and what each session poll
    (retrieve_futures, the path `sample_use_retrieve_futures` selects) answered or refused: the SDK's
    session poller retries 402, 5xx and resets silently and never tells a queue-state observer.
    Everything else is the holder's."""

    _holder: InternalClientHolder
    _watch: QueueWatch
    last_refusal: tuple[int, str] | None  # a refused submit's status and text

    def __init__(self, holder: InternalClientHolder, watch: QueueWatch):
        object.__setattr__(self, "_holder", holder)
        object.__setattr__(self, "_watch", watch)
        object.__setattr__(self, "last_refusal", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._holder, name)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "last_refusal":
            object.__setattr__(self, name, value)
        else:
            setattr(self._holder, name, value)

    @contextlib.contextmanager
    def aclient(self, pool_type: ClientConnectionPoolType) -> Iterator[AsyncTinker | _SessionPollTap]:
        session_poll = pool_type == ClientConnectionPoolType.RETRIEVE_FUTURES
        with self._holder.aclient(pool_type) as client:
            try:
                yield _SessionPollTap(client, self._watch) if session_poll else client
            except tinker.APIStatusError as exc:
                if pool_type == ClientConnectionPoolType.SAMPLE:
                    self.last_refusal = (exc.status_code, _service_text(exc))
                elif session_poll:
                    self._watch.on_transport_error(exc.status_code, _service_text(exc))
                raise
            except tinker.APIConnectionError as exc:
                if session_poll:
                    self._watch.on_transport_error(0, f"no response: {exc}")
                raise


class _SessionPollTap:
    """The SDK client a session poller uses, whose `futures.retrieve_multi` answers tell the watch."""

    def __init__(self, client: AsyncTinker, watch: QueueWatch):
        self._client, self.futures = client, _FuturesTap(client.futures, watch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _FuturesTap:
    """The SDK's futures resource, whose `retrieve_multi` answers tell the watch."""

    def __init__(self, futures: AsyncFuturesResource, watch: QueueWatch):
        self._futures, self._watch = futures, watch
        self.retrieve_multi = _then(futures.retrieve_multi, lambda _: watch.on_session_poll())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._futures, name)


def _then(call: Callable[P, Awaitable[R]], after: Callable[[R], None]) -> Callable[P, Awaitable[R]]:
    """`call`, then `after` with what it answered (an answer passed on as it is)."""

    async def observed(*args: P.args, **kwargs: P.kwargs) -> R:
        out = await call(*args, **kwargs)
        after(out)
        return out

    return observed


def _service_text(exc: tinker.APIStatusError) -> str:
    """The service's own error text of an HTTP error: its body's `error`, else the body, as sent."""
    body = getattr(exc, "body", None)
    if isinstance(body, Mapping) and isinstance(body.get("error"), str):
        return body["error"]
    return body if isinstance(body, str) else str(getattr(exc, "message", exc))


def watch_sampling_client(sampling_client: tinker.SamplingClient) -> QueueWatch:
    """A sampling client is its own queue-state observer (the SDK passes `self`): the instance's
    method is replaced by a watch that forwards to it. A refused submit (429 / billing pause) is
    swallowed by `_send_asample_request` and retried; the watch sees each refusal, with the status
    and text the holder tap noted."""
    client: Any = sampling_client  # patched in place, beside the attributes SamplingClient declares
    existing = client.__dict__.get("_dppo_watch")
    if existing is not None:
        return existing
    watch = QueueWatch(client.on_queue_state_change)
    client.on_queue_state_change = watch.on_queue_state_change
    client.on_transport_error = watch.on_transport_error
    tap = _SubmitTap(client.holder, watch)
    client.holder = tap

    def noted(out: object) -> None:  # None: refused (concurrent submits share the latest refusal noted)
        if out is None:
            status, text = tap.last_refusal or (None, None)
            watch.on_submit_refused(status, text)
        else:
            watch.on_submitted()

    client._send_asample_request = _then(sampling_client._send_asample_request, noted)
    client._dppo_watch = watch
    return watch

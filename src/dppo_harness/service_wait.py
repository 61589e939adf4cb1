"""One wait policy for every service call: bounded waits, queue pauses seen, capacity give-up, hang stop.

The stock SDK retries underneath the harness (docs/service.md): a 429 at sample submit loops without
limit, `retrieve_future` re-polls 408 and 5xx without limit, and a capacity shortage arrives as 408
`try_again` polls whose `queue_state` only a `QueueStateObserver` sees. What reaches the caller is a
future that does not resolve. So every client the harness's ServiceClient hands out is a
`WaitedClient`: each future it returns is a `WaitedFuture`, whose `result()` is
`ServiceWaiter.wait`:

- the client's queue state is watched (`QueueWatch`, installed as the SDK's observer of that client;
  the SDK's own logger still gets every report), and every pause is recorded with its elapsed time
  and the service's own words (`queue_state`, `queue_state_reason`) exactly as sent;
- a pause (`paused_capacity`, `paused_rate_limit`, or a sample submit the SDK keeps retrying) that
  lasts `--capacity-patience-s` (no comparison step completed) or `--capacity-patience-after-steps-s`
  (one did) ends the stage with `CapacityExhausted` and a `capacity_block`;
- a request whose queue is active (or says nothing) but gives no answer for `--service-timeout-s`
  ends the stage with `ServiceHang` ("forward_backward on dppo_seed0: no answer for 900 s");
- a long wait is posted (`on_post`: result.json and a snapshot) with what is waited on, since when,
  the queue state and the reason.

Both stops derive from `ServiceStopped`, a BaseException like KeyboardInterrupt: a stage's own
`except Exception` bookkeeping must not turn a stopped service into a finished stage.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from tinker.lib.api_future_impl import QueueState, QueueStateObserver
from tinker.lib.public_interfaces.api_future import APIFuture

logger = logging.getLogger(__name__)

CAPACITY_SCALE_VAR = "DPPO_HARNESS_CAPACITY_SCALE"
PAUSED_STATES = frozenset({"paused_capacity", "paused_rate_limit", "submit_refused"})
# What the harness records for a refused sample submit whose answer it did not see (the SDK swallows
# the 429 or billing pause inside SamplingClient._send_asample_request and retries it).
SUBMIT_REFUSED_REASON = "sample submit refused (HTTP 429 or a billing pause); the SDK retries it without limit"


class ServiceConfigError(RuntimeError):
    """The service cannot be configured; the message names the variable or option, never a value."""


def _utc(ts: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if ts is None else ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class CapacityPolicy:
    """Backoff for retrying a *refused* call (1, 2, 4 minutes, then 4 again) inside the capacity
    window: ~10 min with no comparison step completed, 30 min once steps ran. `scale` shrinks
    every duration (tests, rehearsals)."""

    backoff_s: tuple[float, ...] = (60.0, 120.0, 240.0)
    give_up_no_steps_s: float = 600.0
    give_up_after_steps_s: float = 1800.0
    scale: float = 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CapacityPolicy:
        """The default policy, shrunk by DPPO_HARNESS_CAPACITY_SCALE (0 < scale <= 1) when set:
        rehearsals and CI use it to exercise backoff and give-up in seconds, not minutes."""
        return cls(scale=capacity_scale(env))

    def backoff(self, attempt: int) -> float:
        return self.backoff_s[min(attempt, len(self.backoff_s) - 1)] * self.scale

    def window(self, steps_completed: int) -> float:
        return (self.give_up_after_steps_s if steps_completed > 0 else self.give_up_no_steps_s) * self.scale


def capacity_scale(env: Mapping[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    raw = env.get(CAPACITY_SCALE_VAR)
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        raise ServiceConfigError(f"{CAPACITY_SCALE_VAR} must be a number in (0, 1], got {raw!r}") from None
    if not 0.0 < scale <= 1.0:
        raise ServiceConfigError(f"{CAPACITY_SCALE_VAR} must be a number in (0, 1], got {raw!r}")
    return scale


@dataclass(frozen=True)
class WaitPolicy:
    """How long the harness waits on the service, for every call of every stage.

    `capacity_patience_s` / `capacity_patience_after_steps_s`: how long a pause may last before
    the run gives up (before / after the first completed comparison step); `service_timeout_s`:
    how long a request whose queue is active may give no answer. `poll_s` is how often a waiting
    call looks at its queue state; a wait longer than `post_after_s` is posted every
    `post_every_s` (result.json) and at most every `snapshot_every_s` as a snapshot file.
    """

    capacity_patience_s: float = 600.0
    capacity_patience_after_steps_s: float = 1800.0
    service_timeout_s: float = 900.0
    backoff_s: tuple[float, ...] = (60.0, 120.0, 240.0)
    poll_s: float = 1.0
    post_after_s: float = 60.0
    post_every_s: float = 30.0
    snapshot_every_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("capacity_patience_s", "capacity_patience_after_steps_s", "service_timeout_s", "poll_s",
                     "post_after_s", "post_every_s", "snapshot_every_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ServiceConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}")

    @classmethod
    def from_options(cls, *, capacity_patience_s: float | None = None,
                     capacity_patience_after_steps_s: float | None = None, service_timeout_s: float | None = None,
                     scale: float | None = None, env: Mapping[str, str] | None = None) -> WaitPolicy:
        """Options given explicitly are used as they are; the capacity defaults (and the refusal
        backoff) are shrunk by `scale` (default: DPPO_HARNESS_CAPACITY_SCALE, else 1)."""
        s = capacity_scale(env) if scale is None else scale
        base = cls()
        policy = cls(
            capacity_patience_s=base.capacity_patience_s * s if capacity_patience_s is None else capacity_patience_s,
            capacity_patience_after_steps_s=(base.capacity_patience_after_steps_s * s
                                             if capacity_patience_after_steps_s is None
                                             else capacity_patience_after_steps_s),
            service_timeout_s=base.service_timeout_s if service_timeout_s is None else service_timeout_s,
            backoff_s=tuple(b * s for b in base.backoff_s),
        )
        # Waits are watched (and posted) at a grain that fits the shortest window.
        shortest = min(policy.capacity_patience_s, policy.service_timeout_s)
        return replace(policy, poll_s=min(1.0, max(0.05, shortest / 20)),
                       post_after_s=min(60.0, max(0.2, shortest / 5)), post_every_s=min(30.0, max(0.2, shortest / 5)),
                       snapshot_every_s=min(300.0, max(1.0, shortest)))

    def capacity_window(self, steps_completed: int) -> float:
        return self.capacity_patience_after_steps_s if steps_completed > 0 else self.capacity_patience_s

    def capacity(self) -> CapacityPolicy:
        """The same windows for `service.call_with_capacity_retry` (retrying refused calls)."""
        return CapacityPolicy(backoff_s=self.backoff_s, give_up_no_steps_s=self.capacity_patience_s,
                              give_up_after_steps_s=self.capacity_patience_after_steps_s, scale=1.0)

    def as_evidence(self) -> dict[str, float]:
        return {"capacity_patience_s": self.capacity_patience_s,
                "capacity_patience_after_steps_s": self.capacity_patience_after_steps_s,
                "service_timeout_s": self.service_timeout_s}


# ----------------------------------------------------------------------------- stops


class ServiceStopped(BaseException):
    """The wait policy stopped the stage. `line` is the one line shown; `result_fields()` the
    result.json fields of the stopped run (status failed, verdict inconclusive,
    outcome_reason incomplete_execution, plus what stopped it)."""

    kind = "stopped"

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line

    def result_fields(self) -> dict[str, Any]:
        return {"status": "failed", "verdict": "inconclusive", "outcome_reason": "incomplete_execution"}


@dataclass(frozen=True)
class CapacityBlock:
    error: str  # the exact error text or queue_state_reason the service sent
    comparison_steps_completed: int
    released_clients: bool

    def as_dict(self) -> dict[str, Any]:
        return {"error": self.error, "comparison_steps_completed": self.comparison_steps_completed,
                "released_clients": self.released_clients}

    def result_fields(self) -> dict[str, Any]:
        """The result.json fields for a run stopped by capacity."""
        return {"status": "failed", "verdict": "inconclusive", "outcome_reason": "incomplete_execution",
                "capacity_block": self.as_dict()}


class CapacityExhausted(ServiceStopped):
    """The service kept refusing or pausing work for the whole capacity window."""

    kind = "capacity"

    def __init__(self, block: CapacityBlock, waited_s: float, attempts: int, line: str | None = None):
        super().__init__(line or (
            f"service capacity refused for {waited_s:.0f}s over {attempts} attempts; giving up "
            f"(comparison steps completed: {block.comparison_steps_completed}, "
            f"clients released: {block.released_clients}): {block.error}"))
        self.block, self.waited_s, self.attempts = block, waited_s, attempts

    def result_fields(self) -> dict[str, Any]:
        return self.block.result_fields()


class ServiceHang(ServiceStopped):
    """A request whose queue was active gave no answer for the whole service timeout."""

    kind = "no_answer"

    def __init__(self, call: str, client: str, waited_s: float, queue_state: str | None):
        super().__init__(f"{call} on {client}: no answer for {int(waited_s)} s"
                         f" (queue state {queue_state or 'never reported'}; --service-timeout-s)")
        self.call, self.client, self.waited_s, self.queue_state = call, client, waited_s, queue_state


# ----------------------------------------------------------------------------- queue state


@dataclass(frozen=True)
class QueueReport:
    state: str  # as the SDK passed it: active, paused_capacity, paused_rate_limit, unknown; or submit_refused
    reason: str | None  # queue_state_reason (or a refused submit's error text) exactly as sent; None: none sent
    since: float  # time.monotonic() when this state (with this reason) began
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

    def __init__(self, forward: Callable[[QueueState, str | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._forward, self._clock = forward, clock
        self._lock = threading.Lock()
        self._latest: QueueReport | None = None
        self._episodes: list[Episode] = []
        self.reports = 0

    def _set(self, state: str, reason: str | None, http_status: int | None = None) -> None:
        now = self._clock()
        with self._lock:
            self.reports += 1
            last = self._latest
            # A refused submit stays one pause while the SDK keeps resubmitting, whatever the text.
            same = last is not None and last.state == state and (state == "submit_refused" or last.reason == reason)
            self._latest = QueueReport(state, reason, last.since if same else now, now, http_status)
            current = self._episodes[-1] if self._episodes and self._episodes[-1].ended is None else None
            if current is not None and not (same and state in PAUSED_STATES):
                current.ended = now
                current = None
            if state in PAUSED_STATES:
                if current is None:
                    self._episodes.append(Episode(_next_episode_id(), state, reason, now, http_status=http_status))
                    del self._episodes[:-self.MAX_EPISODES]
                else:  # the same pause: a refused submit's latest text
                    current.reason, current.http_status = reason, http_status

    def on_queue_state_change(self, queue_state: QueueState, queue_state_reason: str | None) -> None:
        self._set(getattr(queue_state, "value", str(queue_state)), queue_state_reason)
        if self._forward is not None:
            try:
                self._forward(queue_state, queue_state_reason)
            except Exception as exc:  # the SDK's logger must not break the harness's watch
                logger.debug("queue-state observer failed: %s", exc)

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
        """Pauses still open or ended at or after `t0` (copies)."""
        with self._lock:
            return [replace(e) for e in self._episodes if e.ended is None or e.ended >= t0]


class _CreationWatches:
    """Creation calls' observers. The SDK builds a fresh QueueStateLogger(…, "Model creation") inside
    each client-creating call; `install_creation_watch` makes those loggers QueueWatches too, and a
    creation's wait reads the latest report of the loggers created since it began."""

    def __init__(self, keep: int = 64) -> None:
        self._lock = threading.Lock()
        self._made: collections.deque[Any] = collections.deque(maxlen=keep)  # the latest creations' loggers

    def add(self, watch: Any) -> None:
        with self._lock:
            self._made.append(watch)

    def since(self, t0: float) -> list[Any]:
        with self._lock:
            return [w for w in self._made if w.created >= t0]


CREATION_WATCHES = _CreationWatches()
_installed = False
_install_lock = threading.Lock()


def install_creation_watch() -> bool:
    """Make the SDK's creation-time QueueStateLogger also a watch (module attribute of
    tinker.lib.public_interfaces.service_client, looked up at each call). True if installed."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        try:
            from tinker.lib.public_interfaces import service_client as sc_module
            from tinker.lib.queue_state_logger import QueueStateLogger
        except ImportError:  # pragma: no cover - another SDK layout
            return False
        if getattr(sc_module, "QueueStateLogger", None) is not QueueStateLogger:
            logger.warning("tinker.lib.public_interfaces.service_client.QueueStateLogger is not the SDK's "
                           "QueueStateLogger: creation pauses are not observed")
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

            def latest(self) -> QueueReport | None:
                return self.watch.latest()

            def episodes_since(self, t0: float) -> list[Episode]:
                return self.watch.episodes_since(t0)

        sc_module.QueueStateLogger = WatchedQueueStateLogger
        _installed = True
        return True


class CreationWatch:
    """The queue state of client creations started at or after `t0` (the latest report wins)."""

    def __init__(self, t0: float):
        self.t0 = t0

    def latest(self) -> QueueReport | None:
        reports = [r for w in CREATION_WATCHES.since(self.t0) if (r := w.latest()) is not None]
        return max(reports, key=lambda r: r.at) if reports else None

    def episodes_since(self, t0: float) -> list[Episode]:
        return [e for w in CREATION_WATCHES.since(self.t0) for e in w.episodes_since(t0)]


# ----------------------------------------------------------------------------- the waiter


@dataclass
class Pause:
    """One pause a waiting call saw, as the service worded it."""

    call: str
    client: str
    queue_state: str
    queue_state_reason: str | None
    began_at: str  # UTC
    seconds: float = 0.0
    outcome: str = "waiting"  # waiting | resumed | gave_up
    http_status: int | None = None  # a refused submit's status

    def as_dict(self) -> dict[str, Any]:
        out = {"call": self.call, "client": self.client, "queue_state": self.queue_state,
               "queue_state_reason": self.queue_state_reason, "began_at": self.began_at,
               "seconds": round(self.seconds, 3), "outcome": self.outcome}
        if self.http_status is not None:
            out["http_status"] = self.http_status
        return out


@dataclass(frozen=True)
class WaitStatus:
    """What is being waited on, posted while the wait lasts."""

    call: str
    client: str
    since: str  # UTC
    waited_s: float
    queue_state: str | None  # None: the service has not reported one for this client
    queue_state_reason: str | None
    paused_s: float

    def as_dict(self) -> dict[str, Any]:
        return {"call": self.call, "client": self.client, "since": self.since, "waited_s": round(self.waited_s, 3),
                "queue_state": self.queue_state, "queue_state_reason": self.queue_state_reason,
                "paused_s": round(self.paused_s, 3), "updated_at": _utc()}


def _done(future: Any) -> bool:
    inner = getattr(future, "future", None)
    if callable(inner):
        with contextlib.suppress(Exception):
            return bool(inner().done())
    return False


@dataclass
class CapacityTracker:
    """Completed comparison steps (the capacity window switches from 10 to 30 minutes after the
    first) and the refusals retried on the way."""

    comparison_steps_completed: int = 0
    events: list[Any] = field(default_factory=list)

    def step_done(self) -> None:
        self.comparison_steps_completed += 1

    def __call__(self) -> int:
        return self.comparison_steps_completed


def _is_client(value: Any) -> bool:
    from tinker import RestClient, SamplingClient, TrainingClient

    return isinstance(value, (TrainingClient, SamplingClient, RestClient))


class ServiceWaiter:
    """Waits on service futures under one WaitPolicy; see the module docstring.

    `on_post(waiter, status)` is called while a long wait lasts; `on_stop(waiter, stop)` once when
    the policy stops the stage, before the stop is raised (it releases clients and writes the
    evidence; its errors are logged, never raised). `say` prints progress lines.
    """

    MAX_PAUSES_LISTED = 200

    def __init__(self, policy: WaitPolicy | None = None, *, tracker: CapacityTracker | None = None,
                 on_post: Callable[[ServiceWaiter, WaitStatus], None] | None = None,
                 on_stop: Callable[[ServiceWaiter, ServiceStopped], None] | None = None,
                 say: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.policy = policy or WaitPolicy.from_options()
        self.tracker = tracker or CapacityTracker()
        self.on_post, self.on_stop, self.say, self.clock = on_post, on_stop, say, clock
        self._lock = threading.Lock()
        self.pauses: list[Pause] = []
        self.pauses_not_listed = 0
        self.stopped: ServiceStopped | None = None
        self.waits = 0
        self.longest_wait_s = 0.0

    # -- adopting clients

    def adopt(self, client: Any, label: str | None = None) -> Any:
        """The client wrapped so that its futures wait under this policy (idempotent)."""
        if isinstance(client, WaitedClient):
            if label:
                client.label = label
            return client
        from tinker import RestClient, SamplingClient, TrainingClient

        if isinstance(client, TrainingClient):
            current = getattr(client, "_queue_state_logger", None)
            watch = current if isinstance(current, QueueWatch) else QueueWatch(
                current.on_queue_state_change if current is not None else None)
            client._queue_state_logger = watch  # the SDK passes it to every future of this client
            return WaitedClient(client, self, label or f"training client {client.model_id}", watch)
        if isinstance(client, SamplingClient):
            return WaitedClient(client, self, label or "sampling client", _watch_sampling_client(client))
        if isinstance(client, RestClient):
            return WaitedClient(client, self, label or "rest client", None)
        return client

    def wrap(self, value: Any, *, call: str, parent: WaitedClient) -> Any:
        """What a waited client's method returned, with its futures and clients waited."""
        if isinstance(value, APIFuture):
            sub_label = f"sampler of {parent.label}" if call.endswith("sampling_client") else None
            return WaitedFuture(value, self, call, parent.label, parent.queue_watch,
                                then=lambda v: self.adopt(v, sub_label) if _is_client(v) else v)
        if _is_client(value):
            return self.adopt(value)
        return value

    # -- waiting

    def wait(self, future: Any, *, call: str, client: str, watch: Any = None, timeout: float | None = None) -> Any:
        """future.result(), bounded by the policy (and by `timeout` when the caller gives one)."""
        p = self.policy
        t0 = self.clock()
        since = _utc()
        deadline = None if timeout is None else t0 + timeout
        next_post = t0 + p.post_after_s
        seen: dict[int, Pause] = {}  # this wait's pauses, by the watch's episode id
        self.waits += 1
        try:
            while True:
                step = p.poll_s if deadline is None else max(0.0, min(p.poll_s, deadline - self.clock()))
                try:
                    return future.result(timeout=step)
                except TimeoutError:
                    if _done(future):
                        raise  # the call itself failed with a timeout
                now = self.clock()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"{call} on {client}: no result within {timeout} s")
                rep = watch.latest() if watch is not None else None
                self._note_pauses(watch, t0, now, call, client, seen)
                paused = rep is not None and rep.paused
                if paused:
                    window = p.capacity_window(self.tracker())
                    if now - rep.since >= window:
                        for pause in seen.values():
                            if pause.outcome == "waiting":
                                pause.outcome = "gave_up"
                        self._stop(self._capacity_stop(call, client, rep, now - rep.since, window))
                else:
                    quiet_since = max(t0, rep.since) if rep is not None else t0
                    if now - quiet_since >= p.service_timeout_s:
                        self._stop(ServiceHang(call, client, now - quiet_since, rep.state if rep else None))
                if now >= next_post:
                    next_post = now + p.post_every_s
                    self._post(WaitStatus(call, client, since, now - t0, rep.state if rep else None,
                                          rep.reason if rep else None, (now - rep.since) if paused else 0.0))
        finally:
            now = self.clock()
            self.longest_wait_s = max(self.longest_wait_s, now - t0)
            self._note_pauses(watch, t0, now, call, client, seen, final=True)
            for pause in seen.values():  # the wait is over: a pause the watch no longer lists ended with it
                if pause.outcome == "waiting":
                    pause.outcome = "resumed"
                    self._say(f"service: {call} on {client}: pause ended after {pause.seconds:.0f} s")

    def _note_pauses(self, watch: Any, t0: float, now: float, call: str, client: str, seen: dict[int, Pause],
                     final: bool = False) -> None:
        """Record the watch's pauses during this wait (each once), with their elapsed time."""
        episodes = watch.episodes_since(t0) if watch is not None and hasattr(watch, "episodes_since") else []
        for ep in episodes:
            pause = seen.get(ep.id)
            if pause is None:
                pause = seen[ep.id] = Pause(call, client, ep.state, ep.reason, _utc(time.time() - (now - ep.began)),
                                            http_status=ep.http_status)
                with self._lock:
                    if len(self.pauses) < self.MAX_PAUSES_LISTED:
                        self.pauses.append(pause)
                    else:
                        self.pauses_not_listed += 1
                self._say(f"service: {call} on {client} paused by the service ({ep.state}: "
                          f"{ep.reason if ep.reason is not None else 'no reason sent'})")
            pause.queue_state_reason, pause.http_status = ep.reason, ep.http_status
            pause.seconds = (ep.ended if ep.ended is not None else now) - ep.began
            ended = ep.ended is not None or final
            if ended and pause.outcome == "waiting":
                pause.outcome = "resumed"
                self._say(f"service: {call} on {client}: pause ended after {pause.seconds:.0f} s")

    def _capacity_stop(self, call: str, client: str, rep: QueueReport, paused_s: float, window: float) -> CapacityExhausted:
        steps = int(self.tracker())
        error = rep.reason if rep.reason is not None else f"queue_state {rep.state} (the service sent no reason)"
        block = CapacityBlock(error, steps, False)
        option = "--capacity-patience-after-steps-s" if steps > 0 else "--capacity-patience-s"
        line = (f"{call} on {client}: paused by the service for {int(paused_s)} s ({rep.state}: {error}); "
                f"giving up after {option}={window:g}")
        return CapacityExhausted(block, paused_s, 1, line=line)

    def _post(self, status: WaitStatus) -> None:
        if self.on_post is None:
            return
        try:
            self.on_post(self, status)
        except Exception as exc:
            logger.warning("posting the wait on %s failed: %s: %s", status.call, type(exc).__name__, exc)

    def _say(self, line: str) -> None:
        logger.warning(line)
        if self.say is not None:
            with contextlib.suppress(Exception):
                self.say(line)

    def _stop(self, stop: ServiceStopped) -> None:
        """Record the stop, let on_stop release clients and write evidence, then raise it."""
        with self._lock:
            first = self.stopped is None
            if first:
                self.stopped = stop
        if first:
            self._say(f"service: stopping: {stop.line}")
            if self.on_stop is not None:
                try:
                    self.on_stop(self, stop)
                except Exception as exc:
                    logger.warning("recording the service stop failed: %s: %s", type(exc).__name__, exc)
        raise stop

    def evidence(self) -> dict[str, Any]:
        """The `service_wait` block of result.json."""
        with self._lock:
            out: dict[str, Any] = {"policy": self.policy.as_evidence(), "pauses": [p.as_dict() for p in self.pauses]}
            if self.pauses_not_listed:
                out["pauses_not_listed"] = self.pauses_not_listed
            if self.stopped is not None:
                out["stopped"] = {"kind": self.stopped.kind, "line": self.stopped.line}
        return out


# ----------------------------------------------------------------------------- waited clients


class _SubmitTap:
    """A sampling client's view of its SDK holder that notes the HTTP error of each sample submit
    (status and the service's own text) before the SDK swallows it; everything else is the holder's."""

    def __init__(self, holder: Any):
        object.__setattr__(self, "_holder", holder)
        object.__setattr__(self, "last_refusal", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._holder, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "last_refusal":
            object.__setattr__(self, name, value)
        else:
            setattr(self._holder, name, value)

    @contextlib.contextmanager
    def aclient(self, pool_type: Any) -> Any:
        import tinker
        from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

        with self._holder.aclient(pool_type) as client:
            try:
                yield client
            except tinker.APIStatusError as exc:
                if pool_type == ClientConnectionPoolType.SAMPLE:
                    self.last_refusal = (exc.status_code, _service_text(exc))
                raise


def _service_text(exc: Any) -> str:
    """The service's own error text of an HTTP error: its body's `error`, else the body, as sent."""
    body = getattr(exc, "body", None)
    if isinstance(body, Mapping) and isinstance(body.get("error"), str):
        return body["error"]
    return body if isinstance(body, str) else str(getattr(exc, "message", exc))


def _watch_sampling_client(client: Any) -> QueueWatch:
    """A sampling client is its own queue-state observer (the SDK passes `self`): the instance's
    method is replaced by a watch that forwards to it. A refused submit (429 / billing pause) is
    swallowed by `_send_asample_request` and retried; the watch sees each refusal, with the status
    and text the holder tap noted."""
    existing = client.__dict__.get("_dppo_watch")
    if existing is not None:
        return existing
    watch = QueueWatch(client.on_queue_state_change)
    client.on_queue_state_change = watch.on_queue_state_change
    tap = _SubmitTap(client.holder)
    client.holder = tap
    send = client._send_asample_request

    async def observed_send(*args: Any, **kwargs: Any) -> Any:
        out = await send(*args, **kwargs)  # None: refused (concurrent submits share the latest refusal noted)
        if out is None:
            status, text = tap.last_refusal or (None, None)
            watch.on_submit_refused(status, text)
        else:
            watch.on_submitted()
        return out

    client._send_asample_request = observed_send
    client._dppo_watch = watch
    return watch


class WaitedFuture:
    """An SDK future whose result() waits under the policy; `then` turns the value into what the
    caller gets (e.g. a new client, observed and wrapped)."""

    def __init__(self, inner: Any, waiter: ServiceWaiter, call: str, client: str, watch: Any = None,
                 then: Callable[[Any], Any] | None = None):
        self._inner, self._waiter, self._call, self._client, self._watch = inner, waiter, call, client, watch
        self._then, self._value, self._has_value = then, None, False
        self._lock = threading.Lock()

    def result(self, timeout: float | None = None) -> Any:
        value = self._waiter.wait(self._inner, call=self._call, client=self._client, watch=self._watch,
                                  timeout=timeout)
        if self._then is None:
            return value
        with self._lock:
            if not self._has_value:
                self._value, self._has_value = self._then(value), True
            return self._value

    async def result_async(self, timeout: float | None = None) -> Any:
        return await asyncio.to_thread(self.result, timeout)

    def __await__(self):
        return self.result_async().__await__()

    def future(self) -> Any:
        return self._inner.future()

    def __repr__(self) -> str:
        return f"WaitedFuture({self._call} on {self._client})"


class WaitedClient:
    """A training, sampling or REST client whose every returned future is a WaitedFuture (and
    whose every returned client is waited too). Everything else is the wrapped client's."""

    def __init__(self, inner: Any, waiter: ServiceWaiter, label: str, watch: QueueWatch | None):
        object.__setattr__(self, "_w_inner", inner)
        object.__setattr__(self, "_w_waiter", waiter)
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "_w_watch", watch)

    @property
    def sdk_client(self) -> Any:
        return self._w_inner

    @property
    def queue_watch(self) -> QueueWatch | None:
        return self._w_watch

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._w_inner, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._w_waiter.wrap(attr(*args, **kwargs), call=name, parent=self)

        call.__name__ = name
        call.__doc__ = getattr(attr, "__doc__", None)
        return call

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "label":
            object.__setattr__(self, name, value)
        else:
            setattr(self._w_inner, name, value)

    def __repr__(self) -> str:
        return f"WaitedClient({self.label}: {self._w_inner!r})"


def name_client(client: Any, name: str) -> Any:
    """Give a waited client the name its stop lines and pauses use (e.g. the arm, `dppo_seed0`)."""
    if isinstance(client, WaitedClient):
        client.label = name
    return client


def sdk_client(client: Any) -> Any:
    """The SDK's own client inside a waited one (for SDK code that needs the real instance)."""
    return client.sdk_client if isinstance(client, WaitedClient) else client

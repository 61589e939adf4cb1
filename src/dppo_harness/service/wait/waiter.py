"""ServiceWaiter: one wait policy for every service call.

The stock SDK retries underneath the harness (docs/service.md): a 429 at sample submit loops without
limit, `retrieve_future` re-polls 408, 5xx and 429 without limit, and a capacity shortage arrives as
408 `try_again` polls whose queue state only the SDK's own observers see. What reaches the caller
is a future that does not resolve, so each wait polls it under the policy: a pause that lasts the
capacity window stops the stage (`CapacityExhausted`), a call with no pause seen and no answer for
`--service-timeout-s` too (`ServiceHang`), and a long wait is posted (`on_post`, written by
`BundlePoster`). Every client the harness hands out is a `WaitedClient`, every future a `WaitedFuture`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tinker import APIFuture, SamplingClient, TrainingClient
from tinker.lib.public_interfaces.rest_client import RestClient

from dppo_harness.evidence.result import REHEARSAL_PLAN_PREFIX, REHEARSAL_PREFIX
from dppo_harness.json_types import JsonObject
from dppo_harness.service.wait.policy import (
    CapacityBlock,
    CapacityExhausted,
    CapacityTracker,
    ModelLost,
    ServiceDied,
    ServiceHang,
    ServiceStopped,
    WaitPolicy,
    WallBudgetSpent,
    model_lost_error,
)
from dppo_harness.service.wait.watch import (
    PAUSED,
    PLACING,
    PLACING_REASON,
    Episode,
    LogWatch,
    QueueSource,
    sampling_watch,
)

if TYPE_CHECKING:
    from dppo_harness.evidence.bundle import EvidenceBundle
    from dppo_harness.service.observed import ClientRegistry

logger = logging.getLogger(__name__)
V = TypeVar("V")  # what the caller gets
U = TypeVar("U")  # what the SDK's future resolves to
C = TypeVar("C")


def now_iso(ts: float | None = None) -> str:
    """UTC, to the second, of `ts` (time.time(); default now)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


@dataclass
class Pause:
    """One pause a waiting call saw, as the service worded it (its latest words)."""

    call: str
    client: str
    queue_state: str
    queue_state_reason: str | None
    began_at: str  # UTC
    seconds: float = 0.0
    outcome: str = "waiting"  # waiting | resumed | gave_up | call_ended (the call failed or another stop came)
    reason_changes: int = 0
    began: float = field(default=0.0, repr=False)  # time.monotonic() of its first sign (not evidence)

    def as_dict(self) -> JsonObject:
        out: JsonObject = {**asdict(self), "seconds": round(self.seconds, 3)}
        del out["began"]
        if not self.reason_changes:
            del out["reason_changes"]
        return out


@dataclass(frozen=True)
class WaitStatus:
    """What is being waited on, posted while the wait lasts and settled when it ends."""

    call: str
    client: str
    since: str  # UTC
    waited_s: float
    queue_state: str | None  # None: the service has not reported one for this client during this call
    queue_state_reason: str | None
    paused_s: float  # of waited_s, the time the call's queue was reported paused
    id: int = 0  # the waiter's number for this wait
    outcome: str = "waiting"  # waiting | answered | failed | stopped

    def as_dict(self) -> JsonObject:
        out: JsonObject = {**asdict(self), "waited_s": round(self.waited_s, 3), "paused_s": round(self.paused_s, 3)}
        del out["id"]
        return {**out, "updated_at": now_iso()}


@dataclass
class _CallClock:
    """One call's clocks: time without a result, split by what the service said meanwhile. Only
    the result ends them: no reason text, alternation of states or stale report restarts either,
    so no sequence of reports keeps a call waiting past the capacity window plus the timeout."""

    t0: float
    last: float
    paused_s: float = 0.0  # reported paused (capacity, rate limit, refused submit)
    quiet_s: float = 0.0  # anything else: active, unknown, or no report during this call

    def advance(self, now: float, paused_since: float | None) -> None:
        """Count the time since the last look; `paused_since`: when the pause reported now began
        (None: not paused)."""
        split = now if paused_since is None else min(now, max(self.last, paused_since))
        self.quiet_s += split - self.last
        self.paused_s += now - split
        self.last = now


class ServiceWaiter:
    """Waits on service futures under one WaitPolicy. `on_post(waiter, status)` is called while a long
    wait lasts; `on_stop(waiter, stop)` once before a stop is raised (its errors are logged, never raised)."""

    MAX_PAUSES_LISTED = 200
    MAX_WAITS_LISTED = 20  # posted waits kept in the block (each stays once posted: numbers are never dropped)

    def __init__(
        self,
        policy: WaitPolicy | None = None,
        *,
        on_post: Callable[[ServiceWaiter, WaitStatus | None], None] | None = None,
        on_stop: Callable[[ServiceWaiter, ServiceStopped], None] | None = None,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.policy = policy or WaitPolicy.from_options()
        self.tracker = CapacityTracker()
        self.on_post, self.on_stop, self.say, self.clock = on_post, on_stop, say, clock
        self._lock = threading.Lock()
        self.pauses: list[Pause] = []
        self.pauses_not_listed = 0
        self.posted: dict[int, WaitStatus] = {}  # waits long enough to be posted, by id: the latest status
        self._not_listed: set[int] = set()  # posted waits beyond MAX_WAITS_LISTED
        self.stopped: ServiceStopped | None = None
        self.waits = 0
        self.longest_wait_s = 0.0
        # Seconds left of the wall budget the current stage's waits may use (None: not bounded by one).
        self.budget_left: Callable[[], float | None] | None = None
        # Whether a lost model is the stage's to replace (the comparison replaces a lost arm once): such
        # a ModelLost is raised to the stage as it is, neither recorded as the stop nor releasing clients.
        self.replaces_lost: Callable[[ModelLost], bool] | None = None
        self._dead: ServiceStopped | None = None  # the service itself is gone: every wait stops at its next look
        self._issued: weakref.WeakSet[WaitedFuture[Any, Any]] = weakref.WeakSet()  # every WaitedFuture handed out
        self.abandoned = 0  # futures still pending at the stop, cancelled

    def service_died(self, stop: ServiceStopped) -> None:
        """The service process exited (its watcher says so): every wait, now or later, ends with `stop`
        at its next look (within `poll_s`), instead of the SDK re-polling a vanished server."""
        with self._lock:
            self._dead = self._dead or stop
        self._say(f"service: {stop.line}")

    def abandon_pending(self) -> None:
        """Cancel every handed-out future still pending (after a stop), counting them."""
        with self._lock:
            issued = list(self._issued)
        cancelled = sum(1 for f in issued if f.abandon())
        with self._lock:
            self.abandoned += cancelled

    def adopt(self, client: C, label: str | None = None) -> C:
        """The SDK client wrapped so that its futures wait under this policy (idempotent; anything
        else as it is). The WaitedClient stands in for the client: every attribute is the wrapped one's."""
        if isinstance(client, WaitedClient):
            return name_client(client, label) if label else client
        if isinstance(client, TrainingClient):
            model_id = str(client.model_id)
            waited = WaitedClient(
                client, self, label or f"training client {model_id}", LogWatch("training", model_id, 0.0)
            )
        elif isinstance(client, SamplingClient):
            waited = WaitedClient(client, self, label or "sampling client", sampling_watch(client))
        elif isinstance(client, RestClient):
            waited = WaitedClient(client, self, label or "rest client", None)
        else:
            return client
        return waited  # type: ignore[return-value]  # the stand-in of `client`

    def wrap(self, value: object, *, call: str, parent: WaitedClient) -> object:
        """What a waited client's method returned, with its futures and clients waited."""
        sub_label = f"sampler of {parent.label}" if call.endswith("sampling_client") else None
        if isinstance(value, APIFuture | concurrent.futures.Future):
            return WaitedFuture(
                value,
                self,
                call,
                parent.label,
                parent.queue_watch,
                then=lambda v: self.adopt(v, sub_label),
            )
        return self.adopt(value, sub_label)

    def wait(
        self,
        future: concurrent.futures.Future[V],
        *,
        call: str,
        client: str,
        watch: QueueSource | None = None,
        timeout: float | None = None,
    ) -> V:
        """future.result(), bounded by the policy (and by `timeout` when the caller gives one). Every
        future waited on is a concurrent one (`WaitedFuture` runs an SDK future's own result() beside)."""
        p = self.policy
        t0 = self.clock()
        clock = _CallClock(t0, t0)
        since = now_iso()
        deadline = None if timeout is None else t0 + timeout
        next_post = t0 + p.post_after_s
        seen: dict[int, Pause] = {}  # this wait's pauses, by the watch's episode id
        with self._lock:
            self.waits += 1
            wait_id = self.waits
        rep: Episode | None = None
        outcome = "failed"

        def status(outcome: str) -> WaitStatus:
            state, reason = (rep.state, rep.reason) if rep else (None, None)
            return WaitStatus(call, client, since, clock.last - t0, state, reason, clock.paused_s, wait_id, outcome)

        try:
            while True:
                step = p.poll_s if deadline is None else max(0.0, min(p.poll_s, deadline - self.clock()))
                try:
                    value = future.result(timeout=step)
                    outcome = "answered"
                    return value
                except TimeoutError:
                    if future.done():
                        raise  # the call itself failed with a timeout
                except Exception as exc:
                    self._stop_if_lost(exc, call, client, watch)
                    raise
                now = self.clock()
                if self._dead is not None:
                    self.stop(self._dead)
                left = self.budget_left() if self.budget_left is not None else None
                if left is not None and left <= 0:
                    self.stop(WallBudgetSpent(call, client, now - t0))
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"{call} on {client}: no result within {timeout} s")
                rep = watch.latest() if watch is not None else None  # a pause, or a creation's placement
                rep = rep if rep is not None and rep.seen >= t0 else None  # this call's
                clock.advance(now, rep.began if rep is not None else None)
                self._note_pauses(watch, t0, now, call, client, seen)
                window = p.capacity_window(self.tracker())
                if clock.paused_s >= window:
                    self._end_pauses(seen, now, "gave_up")
                    # the latest pause of the wait (the state may alternate)
                    eps = watch.episodes_since(t0) if watch is not None else []
                    last_pause = rep or max(eps, key=lambda e: e.seen, default=Episode(0, PAUSED, None, t0, seen=t0))
                    self.stop(self._capacity_stop(call, client, last_pause, clock.paused_s, window))
                if clock.quiet_s >= p.service_timeout_s:
                    self.stop(ServiceHang(call, client, clock.quiet_s, rep.state if rep else None))
                if now >= next_post:
                    next_post = now + p.post_every_s
                    self._post(status("waiting"))
        except ServiceStopped:
            outcome = "stopped"
            raise
        finally:
            now = self.clock()
            with self._lock:
                self.longest_wait_s = max(self.longest_wait_s, now - t0)
            self._note_pauses(watch, t0, now, call, client, seen)
            # the wait is over: a pause the watch still lists ended with it
            self._end_pauses(seen, now, "resumed" if outcome == "answered" else "call_ended")
            with self._lock:
                was_posted = wait_id in self.posted
            if was_posted or seen:  # settle what was posted: every pause reaches the block, no wait stays "waiting"
                clock.advance(now, rep.began if rep is not None else None)
                self._post(status(outcome) if was_posted else None)

    def _stop_if_lost(self, exc: Exception, call: str, client: str, watch: QueueSource | None) -> None:
        """Stop when the call failed because the service lost the model (a training watch names it)."""
        lost = model_lost_error(exc)
        if lost is None:
            return
        stop = ModelLost(call, client, getattr(watch, "ident", None), lost)
        if self.replaces_lost is not None and self.replaces_lost(stop):
            self._say(f"service: {stop.line} (the stage replaces it)")
            raise stop
        self.stop(stop)

    def _note_pauses(
        self, watch: QueueSource | None, t0: float, now: float, call: str, client: str, seen: dict[int, Pause]
    ) -> None:
        """Record the watch's pauses during this wait (each once), with their elapsed time."""
        episodes = watch.episodes_since(t0) if watch is not None else []
        for ep in episodes:
            pause = seen.get(ep.id)
            if pause is None:
                began_at = now_iso(time.time() - (now - ep.began))
                pause = seen[ep.id] = Pause(call, client, ep.state, ep.reason, began_at, began=ep.began)
                with self._lock:
                    if len(self.pauses) < self.MAX_PAUSES_LISTED:
                        self.pauses.append(pause)
                    else:
                        self.pauses_not_listed += 1
                said = ep.reason if ep.reason is not None else "no reason sent"
                self._say(f"service: {call} on {client} paused by the service ({ep.state}: {said})")
            pause.queue_state_reason, pause.reason_changes = ep.reason, ep.reason_changes
            # what the signs show: from the first to the latest (never more, so a posted number only grows)
            pause.seconds = max(pause.seconds, (ep.ended if ep.ended is not None else ep.seen) - ep.began)
            if ep.ended is not None:
                self._end_pauses({ep.id: pause}, ep.ended, "resumed")

    def _end_pauses(self, pauses: dict[int, Pause], now: float, outcome: str) -> None:
        """End the pauses still waiting with `outcome`; each lasted at least until `now`."""
        for pause in pauses.values():
            if pause.outcome == "waiting":
                pause.outcome = outcome
                pause.seconds = max(pause.seconds, now - pause.began)
                if outcome != "gave_up":  # a give-up says so in the stop line
                    self._say(f"service: {pause.call} on {pause.client}: pause ended after {pause.seconds:.0f} s")

    def _capacity_stop(self, call: str, client: str, rep: Episode, paused_s: float, window: float) -> ServiceStopped:
        steps = int(self.tracker())
        option = "--capacity-patience-after-steps-s" if steps > 0 else "--capacity-patience-s"
        if rep.state == PLACING:
            error = f"{call} on {client}: pending for {int(paused_s)} s, {PLACING_REASON}"
            line = f"{error}; giving up after {option}={window:g}"
        else:
            error = rep.reason if rep.reason is not None else f"queue_state {rep.state} (the service sent no reason)"
            line = (
                f"{call} on {client}: paused by the service for {int(paused_s)} s ({rep.state}: {error}); "
                f"giving up after {option}={window:g}"
            )
        block = CapacityBlock(error, steps, False)
        return CapacityExhausted(block, paused_s, 1, line=line)

    def _post(self, status: WaitStatus | None) -> None:
        """Keep `status` (None: only the pauses changed) and hand the block to on_post."""
        with self._lock:
            if status is not None:
                if status.id in self.posted or len(self.posted) < self.MAX_WAITS_LISTED:
                    self.posted[status.id] = status
                else:
                    self._not_listed.add(status.id)
        if self.on_post is None:
            return
        try:
            self.on_post(self, status)
        except Exception as exc:
            logger.warning(
                "posting the wait on %s failed: %s: %s",
                status.call if status else "the service",
                type(exc).__name__,
                exc,
            )

    def _say(self, line: str) -> None:
        logger.warning(line)
        if self.say is not None:
            with contextlib.suppress(Exception):
                self.say(line)

    def stop(self, stop: ServiceStopped) -> None:
        """Record the stop, let on_stop release clients and write evidence (as a wait does), then raise it."""
        with self._lock:
            first = self.stopped is None
            if first:
                self.stopped = stop
        if first:
            self._say(f"service: stopping: {stop.line}")
            self.abandon_pending()  # before on_stop releases the sessions: nothing polls on for a stopped run
            if self.on_stop is not None:
                try:
                    self.on_stop(self, stop)
                except Exception as exc:
                    logger.warning("recording the service stop failed: %s: %s", type(exc).__name__, exc)
        raise stop

    def evidence(self) -> JsonObject:
        """The `service_wait` block of result.json: policy, pauses, the posted waits (by id, each
        with its outcome), the stop."""
        with self._lock:
            out: JsonObject = {
                "policy": self.policy.as_evidence(),
                "pauses": [p.as_dict() for p in self.pauses],
                "waits": self.waits,
                "longest_wait_s": round(self.longest_wait_s, 3),
            }
            if self.pauses_not_listed:
                out["pauses_not_listed"] = self.pauses_not_listed
            if self.posted:
                out["waiting"] = {str(i): st.as_dict() for i, st in sorted(self.posted.items())}
            if self._not_listed:
                out["waits_not_listed"] = len(self._not_listed)
            if self.stopped is not None:
                out["stopped"] = {
                    "kind": self.stopped.kind,
                    "line": self.stopped.line,
                    **self.stopped.details,
                    "futures_cancelled": self.abandoned,
                }
        return out


class WaitedFuture(Generic[U, V]):
    """An SDK future whose result() waits under the policy; `then` turns the value into what the
    caller gets (e.g. a new client, observed and wrapped)."""

    def __init__(
        self,
        inner: APIFuture[U] | concurrent.futures.Future[U],
        waiter: ServiceWaiter,
        call: str,
        client: str,
        watch: QueueSource | None = None,
        then: Callable[[U], V] | None = None,
    ):
        self._inner, self._waiter, self._call, self._client, self._watch = inner, waiter, call, client, watch
        self._then = then
        self._value: list[V] = []  # what `then` made, once
        self._lock = threading.Lock()
        self._box: concurrent.futures.Future[U] | None = None
        with waiter._lock:  # kept, so that a stop can cancel it if it is still pending
            waiter._issued.add(self)

    def _settled(self) -> concurrent.futures.Future[U]:
        """The SDK future's outcome as a concurrent future a wait can poll without harm. tinker 0.25's
        `result(timeout=...)` cancels the request when the timeout passes on a future it combines
        from several (`lib/api_future_impl.py`, `_CombinedAPIFuture.result_async`: forward_backward
        in chunks, forward_backward_custom), so an SDK future is waited once, without a timeout, on
        its own thread, and the wait polls that thread's future."""
        with self._lock:
            if self._box is None:
                inner = self._inner
                if isinstance(inner, concurrent.futures.Future):
                    self._box = inner
                else:
                    self._box = run_beside(inner.result, f"{self._call} on {self._client}")
            return self._box

    def result(self, timeout: float | None = None) -> V:
        value = self._waiter.wait(
            self._settled(), call=self._call, client=self._client, watch=self._watch, timeout=timeout
        )
        if self._then is None:
            return value  # type: ignore[return-value]  # without `then` the caller gets the SDK's value
        with self._lock:
            if not self._value:
                self._value.append(self._then(value))
            return self._value[0]

    def future(self) -> concurrent.futures.Future[U]:
        """A concurrent future that completes with the SDK's (a sample's is one already)."""
        return self._settled()

    def abandon(self) -> bool:
        """Stop the SDK's polling for this result (a stop ended the run). The service is not told
        (tinker 0.25 has no cancel; Spindle no cancel_future route), so work it began runs on
        there. True if it was still pending."""
        inner: Any = self._inner
        try:
            if isinstance(inner, concurrent.futures.Future):
                return not inner.done() and inner.cancel()
            own = getattr(inner, "future", None)
            if callable(own):  # an AwaitableConcurrentFuture: its concurrent future cancels its task
                pending = own()
                return bool(not pending.done() and pending.cancel())
            if self._box is not None and self._box.done():
                return False
            # Any other SDK future is cancelled by the SDK itself when its result_async times out.
            timed_out = inner.holder.run_coroutine_threadsafe(inner.result_async(0))
            with contextlib.suppress(Exception):
                timed_out.result(5)
            return True
        except Exception:  # cancelling is best effort: the stop is what matters
            return False

    def __repr__(self) -> str:
        return f"WaitedFuture({self._call} on {self._client})"


# The SDK's public methods that block their caller on the service (no future handed back): each
# runs on its own thread, waited under the policy like a future (tinker 0.25, public_interfaces/).
# forward_backward_custom blocks until its first (forward) pass is answered, then hands out the second's future.
BLOCKING_METHODS = frozenset(
    {
        "get_info",
        "save_weights_and_get_sampling_client",
        "create_sampling_client",
        "get_tokenizer",
        "forward_backward_custom",
    }
)


def run_beside(fn: Callable[[], U], what: str) -> concurrent.futures.Future[U]:
    """fn() on a daemon thread, as a future a wait can bound. A stopped wait leaves the thread to
    the SDK (its public API has no way to cancel a blocking call); it holds no harness lock."""
    box: concurrent.futures.Future[U] = concurrent.futures.Future()

    def run() -> None:
        # A stopped wait may have cancelled `box` already: nobody reads the outcome then.
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            try:
                result = fn()
            except BaseException as exc:  # the waiting caller gets it
                box.set_exception(exc)
            else:
                box.set_result(result)

    threading.Thread(target=run, name=f"sdk call: {what}", daemon=True).start()
    return box


class WaitedClient:
    """A training, sampling or REST client whose every returned future is a WaitedFuture (and
    whose every returned client is waited too). Everything else is the wrapped client's."""

    queue_watch: QueueSource | None

    def __init__(self, inner: object, waiter: ServiceWaiter, label: str, watch: QueueSource | None):
        object.__setattr__(self, "_w_inner", inner)
        object.__setattr__(self, "_w_waiter", waiter)
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "queue_watch", watch)

    @property
    def sdk_client(self) -> object:
        return self._w_inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._w_inner, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            if name in BLOCKING_METHODS:
                made = run_beside(lambda: attr(*args, **kwargs), f"{name} on {self.label}")
                value = self._w_waiter.wait(made, call=name, client=self.label, watch=self.queue_watch)
            else:
                value = attr(*args, **kwargs)
            return self._w_waiter.wrap(value, call=name, parent=self)

        call.__name__ = name
        call.__doc__ = getattr(attr, "__doc__", None)
        return call

    def __setattr__(self, name: str, value: object) -> None:
        if name == "label":
            object.__setattr__(self, name, value)
        else:
            setattr(self._w_inner, name, value)

    def __repr__(self) -> str:
        return f"WaitedClient({self.label}: {self._w_inner!r})"


def name_client(client: C, name: str) -> C:
    """Give a waited client the name its stop lines and pauses use (e.g. the arm, `dppo_seed0`)."""
    if isinstance(client, WaitedClient):
        client.label = name
    return client


class BundlePoster:
    """The waiter's evidence hooks for one bundle: `post` writes the `service_wait` block into
    result.json and, at most every `snapshot_every_s`, a snapshot into the journal (a full result
    each: the throttle bounds the journal's size, on the embedded server nearly every call counts as
    a wait); `stop` releases every registered client and writes the stopped run's result, then a snapshot."""

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

    def post(self, waiter: ServiceWaiter, status: WaitStatus | None) -> None:
        """The block as it stands; `status` None or settled (the wait ended): no snapshot."""
        with self._lock:
            self.posts += 1
            self.bundle.update_result(service_wait=waiter.evidence())
            if status is None or status.outcome != "waiting":
                return
            now = self.clock()
            if self._last_snapshot is None or now - self._last_snapshot >= waiter.policy.snapshot_every_s:
                self._last_snapshot = now
                self.bundle.journal.snapshot(self._stage(), f"waiting: {status.call} on {status.client}")

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
        self.bundle.journal.snapshot(self._stage(), f"service stop ({stop.kind})")

    def _stage(self) -> str:
        return (self.registry.current_stage if self.registry is not None else None) or "session"

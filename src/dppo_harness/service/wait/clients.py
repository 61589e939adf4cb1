"""Waited clients and futures: every client the harness hands out (`WaitedClient`), and every future
it returns (`WaitedFuture`, whose `result()` is `ServiceWaiter.wait` under the session's policy).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from dppo_harness.service.wait.watch import QueueSource

C = TypeVar("C")
U = TypeVar("U")  # what the SDK's future resolves to
V = TypeVar("V")  # what the caller gets

if TYPE_CHECKING:
    from dppo_harness.service.wait.waiter import Pending, ServiceWaiter  # the waiter hands out these clients


class WaitedFuture(Generic[U, V]):
    """An SDK future whose result() waits under the policy; `then` turns the value into what the
    caller gets (e.g. a new client, observed and wrapped)."""

    def __init__(
        self,
        inner: Pending[U],
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
        waiter.track(self)

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

    async def result_async(self, timeout: float | None = None) -> V:
        return await asyncio.to_thread(self.result, timeout)

    def __await__(self) -> Generator[object, None, V]:
        return self.result_async().__await__()

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

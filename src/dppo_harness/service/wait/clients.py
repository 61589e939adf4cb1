"""Waited clients and futures: every client the harness hands out, and every future it returns.

A `WaitedClient` wraps a training, sampling or REST client so that each future a method returns
is a `WaitedFuture`, whose `result()` is `ServiceWaiter.wait` under the session's policy, and
each client a method returns is waited too. Everything else is the wrapped client's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from dppo_harness.service.wait.watch import QueueSource, QueueWatch

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
        waiter.track(self)

    def result(self, timeout: float | None = None) -> V:
        value = self._waiter.wait(self._inner, call=self._call, client=self._client, watch=self._watch, timeout=timeout)
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

    def future(self) -> Any:
        return self._inner.future()  # type: ignore[attr-defined]  # an SDK APIFuture's own future

    def abandon(self) -> bool:
        """Cancel the SDK's wait for this result (a stop ended the run): its polls stop, and for a
        sample the SDK sends the service's cancel_future. True if it was still pending."""
        inner = getattr(self._inner, "future", None)
        try:
            pending = inner() if callable(inner) else None
            return bool(pending is not None and not pending.done() and pending.cancel())
        except Exception:  # cancelling is best effort: the stop is what matters
            return False

    def __repr__(self) -> str:
        return f"WaitedFuture({self._call} on {self._client})"


class WaitedClient:
    """A training, sampling or REST client whose every returned future is a WaitedFuture (and
    whose every returned client is waited too). Everything else is the wrapped client's."""

    def __init__(self, inner: object, waiter: ServiceWaiter, label: str, watch: QueueWatch | None):
        object.__setattr__(self, "_w_inner", inner)
        object.__setattr__(self, "_w_waiter", waiter)
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "_w_watch", watch)

    @property
    def sdk_client(self) -> object:
        return self._w_inner

    @property
    def queue_watch(self) -> QueueWatch | None:
        return self._w_watch

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._w_inner, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            return self._w_waiter.wrap(attr(*args, **kwargs), call=name, parent=self)

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


def sdk_client(client: object) -> object:
    """The SDK's own client inside a waited one (for SDK code that needs the real instance)."""
    return client.sdk_client if isinstance(client, WaitedClient) else client

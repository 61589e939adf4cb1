"""Cancels of abandoned samples that reach the service before its session closes.

When a sample's wait is abandoned (a stop cancelled it), the SDK queues a `cancel_future` for the
service if its dynamic config allows it, and a background task sends the queue; closing the holder
right after a stop cancels that task, so the cancel may never be sent. With `install_cancel_tracking`
each cancel is its own task, kept on the holder, and `flush_cancels` waits for them (bounded) before
the session is finished. A session setup that a stop abandons is cancelled too (`SetupScope`), so
its thread does not wait on in the SDK's retries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from tinker.lib.internal_client_holder import InternalClientHolder

from dppo_harness.service.wait.watch import _once

if TYPE_CHECKING:
    from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

T = TypeVar("T")

logger = logging.getLogger(__name__)

_TASKS = "_dppo_cancel_tasks"  # holder attribute: the cancel sends still running
_SENT = "_dppo_cancels_sent"  # holder attribute: how many were asked for


def install_cancel_tracking() -> bool:
    """Make `InternalClientHolder.enqueue_cancel` send each cancel as a task kept on the holder. True
    if in place."""
    return _once("cancels", _install)


def _install() -> bool:
    if not hasattr(InternalClientHolder, "enqueue_cancel") or not hasattr(InternalClientHolder, "_process_one_cancel"):
        logger.warning(
            "the SDK's holder has no enqueue_cancel/_process_one_cancel: abandoned samples are not "
            "cancelled before the session closes"
        )
        return False

    def enqueue_cancel(self: InternalClientHolder, request_id: str) -> None:  # on the holder's loop, as the SDK's is
        if not self._client_dynamic_config.sample_cancel_enabled:
            return
        tasks: set[asyncio.Task[None]] = self.__dict__.setdefault(_TASKS, set())
        task = asyncio.get_running_loop().create_task(self._process_one_cancel(request_id))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        self.__dict__[_SENT] = self.__dict__.get(_SENT, 0) + 1

    InternalClientHolder.enqueue_cancel = enqueue_cancel  # type: ignore[method-assign]  # the patch: each cancel its own task
    return True


def flush_cancels(holder: InternalClientHolder | None, timeout_s: float) -> tuple[int, int]:
    """Wait up to `timeout_s` for `holder`'s cancel sends: (asked for, still unsent at the end)."""
    if holder is None:
        return 0, 0

    async def settle() -> int:
        for _ in range(10):  # a stop's cancellation reaches the SDK's sample coroutine a few loop turns later
            await asyncio.sleep(0.02)
        pending = set(holder.__dict__.get(_TASKS, ()))
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout_s)
        return len(pending)

    try:
        unsent = holder.run_coroutine_threadsafe(settle()).result(timeout_s + 5)
    except (concurrent.futures.TimeoutError, RuntimeError) as exc:
        logger.warning("waiting for cancels of abandoned samples failed: %s", exc)
        unsent = len(holder.__dict__.get(_TASKS, ()))
    return holder.__dict__.get(_SENT, 0), unsent


class SetupScope:
    """The SDK calls a session-setup thread is waiting on, so that a stop can cancel them.

    The SDK builds its holder synchronously (client/config, dynamic_config, create_session), each a
    coroutine on its loop whose `.result()` the building thread waits on, holding the ServiceClient's
    lifecycle lock, for as long as the SDK's retries last. With `install_setup_abort` each such
    coroutine started while the scope is entered on this thread is kept; `abort` cancels them (and
    any started afterwards), so the constructor raises and the thread ends and lets the lock go.
    """

    _current = threading.local()

    def __init__(self) -> None:
        self._futures: list[concurrent.futures.Future[object]] = []
        self._lock = threading.Lock()
        self.aborted = False

    def __enter__(self) -> SetupScope:
        SetupScope._current.scope = self
        return self

    def __exit__(self, *exc: object) -> None:
        SetupScope._current.scope = None

    @classmethod
    def current(cls) -> SetupScope | None:
        return getattr(cls._current, "scope", None)

    def keep(self, future: concurrent.futures.Future[object]) -> None:
        with self._lock:
            self._futures.append(future)
            aborted = self.aborted
        if aborted:
            future.cancel()

    def abort(self) -> int:
        """Cancel every setup call still waiting: how many were."""
        with self._lock:
            self.aborted = True
            futures = list(self._futures)
        return sum(f.cancel() for f in futures)


def install_setup_abort() -> bool:
    """Make `InternalClientHolder.run_coroutine_threadsafe` keep, in the thread's SetupScope, the
    future of each coroutine it starts (its cleanup excepted). True if in place."""
    return _once("setup-abort", _install_setup_abort)


def _install_setup_abort() -> bool:
    sdk_run = getattr(InternalClientHolder, "run_coroutine_threadsafe", None)
    if sdk_run is None:
        logger.warning("the SDK's holder has no run_coroutine_threadsafe: a stopped session setup runs on")
        return False

    def run_coroutine_threadsafe(
        self: InternalClientHolder, coro: Coroutine[Any, Any, T]
    ) -> AwaitableConcurrentFuture[T]:
        made = sdk_run(self, coro)
        scope = SetupScope.current()
        inner = getattr(made, "_future", None)
        if (
            scope is not None
            and isinstance(inner, concurrent.futures.Future)
            and getattr(coro, "__name__", "") != "_async_cleanup"
        ):
            scope.keep(inner)
        return made

    InternalClientHolder.run_coroutine_threadsafe = run_coroutine_threadsafe  # type: ignore[method-assign]  # the patch: keep setup futures
    return True

"""Progress lines for long phases: `Ticker` for a loop of many small steps (a line at most every
`every_s` seconds), `Watchdog` for one step that blocks long (its line repeated while it blocks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

Say = Callable[[str], None]


def quiet(_msg: str) -> None:
    """A `say` that prints nothing."""


@dataclass
class Ticker:
    say: Say
    label: str  # e.g. "[preflight] correctness: golden parity"
    total: int | None = None
    every_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _t0: float = field(default=0.0, init=False)
    _last: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._t0 = self.clock()

    def _emit(self, text: str) -> None:
        self._last = self.clock()
        self.say(f"{self.label}: {text} ({self._last - self._t0:.0f}s)")

    def start(self, detail: str = "") -> None:
        self._emit(f"started{f' ({self.total} steps)' if self.total else ''}{f', {detail}' if detail else ''}")

    def tick(self, done: int, detail: str = "") -> None:
        """After item `done` (1-based): a line when `every_s` passed since the last one, or at the end."""
        now = self.clock()
        last = self.total is not None and done >= self.total
        if last or self._last is None or now - self._last >= self.every_s:
            of = f"{done}/{self.total} ({100 * done / self.total:.0f}%)" if self.total else f"{done}"
            self._emit(f"{of}{f', {detail}' if detail else ''}")


class Watchdog:
    """`say` through this object (`with Watchdog(say) as w: w.say(step)`): while a step blocks, a line
    `<step>: still working (Ns in this step)` comes every `every_s` seconds of silence."""

    def __init__(self, say: Say, every_s: float = 10.0, poll_s: float = 0.5) -> None:
        self._say, self.every_s, self.poll_s = say, every_s, poll_s
        self._lock = threading.Lock()
        self._step = ""
        self._step_t0 = self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def say(self, msg: str) -> None:
        with self._lock:
            self._step, self._step_t0 = msg, time.monotonic()
            self._last = self._step_t0
        self._say(msg)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                now = time.monotonic()
                due = bool(self._step) and now - self._last >= self.every_s
                if due:
                    self._last = now
                    line = f"{self._step}: still working ({now - self._step_t0:.0f}s in this step)"
            if due:
                self._say(line)

    def __enter__(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name="progress-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

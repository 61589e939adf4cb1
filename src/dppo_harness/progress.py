"""Progress lines for long phases: which step, how far along, never a long silence.

`Ticker` turns a loop's per-item calls into terminal lines at most every `every_s` seconds (and
always at the first and the last item), so a phase of many small steps says where it is without
flooding the terminal. The `say` callable is whatever writes a line (the pytest terminal writer
of `fixtures_stages.harness_progress`, `print`, or a logger).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

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

    def finish(self, detail: str = "done") -> None:
        self._emit(detail)

"""Queue watches: what the service said about a call's queue, as far as tinker 0.25 lets anyone see it.

The service's 408 `try_again` polls carry `queue_state` and its reason to a `QueueStateObserver` the
public API cannot attach. What shows is the SDK's log: each pause is a warning on the `tinker` logger,
at once and at most every 60 s while it lasts, never an active state (`lib/queue_state_logger.py`:
"Model creation for <base model or id> is paused. Reason: <reason>.", "Training for <model id> ...";
`lib/public_interfaces/sampling_client.py`, `on_queue_state_change`: "Sampling is paused for sampler
<id>. Reason: <reason>"); with no reason sent the SDK writes its own default, and never the state.

`SdkPauseLog` keeps those lines; a `LogWatch` reads one call's: a pause is a run of lines at most
`PAUSE_LOG_FRESH_S` apart, ended once none came for that long. A refused sample submit, retried
without a word, is seen through `sdk_internals` (`SubmitRefusedWatch`). Services that only send
`active` (Spindle) leave no line: the waiter tells their waits apart by time alone.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import tinker

PAUSED = "paused"  # the SDK logged a pause (it does not log which paused state)
SUBMIT_REFUSED = "submit_refused"  # the SDK is holding a refused sample submit back
# A creation with no answer and no pause logged: the service is placing the model. Spindle keeps a
# creation pending while a trainer starts cold or has no free LoRA slot, and every poll says only
# `queue_state: active`, with no reason (control_plane/http.py, tests/control_plane/test_models.py);
# tinker 0.25 logs only paused states, so this is all a client sees. It counts as a capacity wait.
PLACING = "placing"
PLACING_REASON = (
    "no answer and no pause reported after the session was set up (Spindle keeps a creation pending this way, "
    "its polls saying only queue_state active, no reason, while it places the model on a trainer that starts "
    "cold or has no free LoRA slot)"
)
# The SDK logs a continuing pause at most every 60 s; a pause with no line for longer has ended.
PAUSE_LOG_FRESH_S = 90.0
# A refusal sets a backoff of 1 s (5 s for large prompts); none seen for longer than this, the refusals are over.
REFUSAL_FRESH_S = 10.0
SUBMIT_REFUSED_REASON = (
    "sample submit refused (HTTP 429 or a billing pause): the SDK backs off and resubmits without limit, "
    "and tinker 0.25 keeps the service's text of the refusal to itself"
)
CallKind = Literal["creation", "training", "sampling", "other"]

_CALL_RE = re.compile(r"^(?P<prefix>.+?) for (?P<ident>.+) is paused\. Reason: (?P<reason>.*?)\.?$", re.S)
_SAMPLING_RE = re.compile(r"^Sampling is paused for sampler (?P<ident>.+?)\. Reason: (?P<reason>.*)$", re.S)
_PREFIX_KIND: dict[str, CallKind] = {"Model creation": "creation", "Training": "training"}
_refusal_ids = itertools.count(1 << 40)  # apart from the log lines' numbers, which name their pauses


@dataclass
class Episode:
    """One pause, from its first sign to its last (ended: None while it lasts)."""

    id: int
    state: str  # paused | submit_refused | placing
    reason: str | None  # as the SDK logged it (the service's words, or the SDK's default when none was sent)
    began: float  # time.monotonic()
    ended: float | None = None
    seen: float = 0.0  # time.monotonic() of the latest sign
    reason_changes: int = 0  # how often the reason's text changed (a queue position, say)


class QueueSource(Protocol):
    def latest(self) -> Episode | None: ...

    def episodes_since(self, t0: float) -> list[Episode]: ...


@dataclass(frozen=True)
class PauseLine:
    seq: int
    at: float  # time.monotonic()
    kind: CallKind
    ident: str
    reason: str


def parse_pause_line(message: str) -> tuple[CallKind, str, str] | None:
    """(kind, identifier, reason) of an SDK pause warning; None for any other line."""
    m = _SAMPLING_RE.match(message)
    if m:
        return "sampling", m["ident"], m["reason"]
    m = _CALL_RE.match(message)
    if m:
        return _PREFIX_KIND.get(m["prefix"], "other"), m["ident"], m["reason"]
    return None


class SdkPauseLog(logging.Handler):
    """The SDK's pause warnings, kept with when they came (the latest MAX_LINES)."""

    MAX_LINES = 2000

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__(level=logging.WARNING)
        self._clock = clock
        self._lines: collections.deque[PauseLine] = collections.deque(maxlen=self.MAX_LINES)
        self._seq = 0
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            parsed = parse_pause_line(record.getMessage())
        except Exception:  # a record the SDK formats badly is not a pause
            return
        if parsed is None:
            return
        with self._guard:
            self._seq += 1
            self._lines.append(PauseLine(self._seq, self._clock(), *parsed))

    def lines(self, kind: CallKind, ident: str | None, since: float) -> list[PauseLine]:
        with self._guard:
            return [
                ln for ln in self._lines if ln.kind == kind and ln.at >= since and (ident is None or ln.ident == ident)
            ]


SDK_LOGGER = "tinker"
_install_lock = threading.Lock()
_pause_log: SdkPauseLog | None = None


def pause_log() -> SdkPauseLog:
    """The process's SdkPauseLog, added to the SDK's logger on first use."""
    global _pause_log
    with _install_lock:
        if _pause_log is None:
            _pause_log = SdkPauseLog()
            sdk = logging.getLogger(SDK_LOGGER)
            sdk.addHandler(_pause_log)
            if sdk.getEffectiveLevel() > logging.WARNING:  # a quieter root would drop the pause lines unread
                sdk.setLevel(logging.WARNING)
        return _pause_log


def _episodes(lines: list[PauseLine], now: float, fresh_s: float, state: str = PAUSED) -> list[Episode]:
    """Signs no more than `fresh_s` apart are one pause; the last has ended once `fresh_s` passed."""
    out: list[Episode] = []
    for ln in lines:
        cur = out[-1] if out else None
        if cur is not None and ln.at - cur.seen <= fresh_s:
            cur.reason_changes += cur.reason != ln.reason
            cur.reason, cur.seen = ln.reason, ln.at
            continue
        if cur is not None:
            cur.ended = cur.seen
        out.append(Episode(ln.seq, state, ln.reason, ln.at, seen=ln.at))
    if out and now - out[-1].seen > fresh_s:
        out[-1].ended = out[-1].seen
    return out


class LogWatch:
    """The pauses the SDK logged for one kind of call (one client, when `ident` is given) from `t0` on."""

    def __init__(
        self,
        kind: CallKind,
        ident: str | None = None,
        t0: float | None = None,
        *,
        log: SdkPauseLog | None = None,
        clock: Callable[[], float] = time.monotonic,
        placing: Callable[[], bool] | None = None,
    ):
        self.kind, self.ident, self._clock = kind, ident, clock
        self.t0 = clock() if t0 is None else t0
        self._log = log or pause_log()
        self._placing = placing  # a creation: whether its session is set up (then it waits on its model)
        self._placing_since: float | None = None

    def episodes_since(self, t0: float) -> list[Episode]:
        lines = self._log.lines(self.kind, self.ident, max(t0, self.t0))
        return _episodes(lines, self._clock(), PAUSE_LOG_FRESH_S)

    def latest(self) -> Episode | None:
        """The pause still lasting, if any; for a creation with none, its placement from when its
        session was first seen set up (the time before is the session's, under the hang window)."""
        eps = self.episodes_since(self.t0)
        if eps and eps[-1].ended is None:
            return eps[-1]
        now = self._clock()
        if self._placing_since is None and self._placing is not None and self._placing():
            self._placing_since = now
        return None if self._placing_since is None else Episode(0, PLACING, None, self._placing_since, seen=now)


class SubmitRefusedWatch:
    """A sampling client's session holding refused sample submits back (`sdk_internals`): each new
    backoff is a sign, and signs make pauses as the SDK's log lines do."""

    def __init__(self, backoff_until: Callable[[], float | None], clock: Callable[[], float] = time.monotonic):
        self._backoff_until, self._clock = backoff_until, clock
        self._lock = threading.Lock()
        self._signs: list[PauseLine] = []
        self._last_until: float | None = backoff_until()  # a backoff before this watch is not its

    def latest(self) -> Episode | None:
        eps = self.episodes_since(-math.inf)
        return eps[-1] if eps and eps[-1].ended is None else None

    def episodes_since(self, t0: float) -> list[Episode]:
        now, until = self._clock(), self._backoff_until()
        with self._lock:
            if until is not None and until != self._last_until:
                self._last_until = until
                self._signs.append(PauseLine(next(_refusal_ids), now, "sampling", "", SUBMIT_REFUSED_REASON))
            signs = list(self._signs)
        return [e for e in _episodes(signs, now, REFUSAL_FRESH_S, SUBMIT_REFUSED) if e.seen >= t0]


class Watches:
    """Several sources read as one: the latest pause of any, and all their pauses."""

    def __init__(self, *sources: QueueSource):
        self.sources = sources

    def latest(self) -> Episode | None:
        reports = [r for s in self.sources if (r := s.latest()) is not None]
        return max(reports, key=lambda r: r.seen) if reports else None

    def episodes_since(self, t0: float) -> list[Episode]:
        return [e for s in self.sources for e in s.episodes_since(t0)]


def sampling_watch(sampling_client: tinker.SamplingClient) -> Watches:
    from dppo_harness.service import sdk_internals  # the one reach into the SDK's internals

    refused = SubmitRefusedWatch(lambda: sdk_internals.sample_backoff_until(sampling_client))
    return Watches(LogWatch("sampling", None, 0.0), refused)

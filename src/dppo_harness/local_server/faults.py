"""Counted fault injection for the embedded server's reliability tests.

A request's *kind* is its endpoint name (`create_model`, `forward_backward`, `asample`,
`retrieve_future`, ...); `*` matches every kind. Every fault is deterministic (the N-th request of
a kind, or a time window) and every injected fault is counted, so a test can assert exactly what
the client went through.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import JsonValue

CAPACITY_EXHAUSTED_TEXT = "trainer capacity exhausted"
# Spindle's only capacity refusal of a creation: EngineSaturated("trainer capacity exhausted") when
# every trainer is full at its autoscaling maximum (control_plane/service.py `_place_claimed`, errors.py).
CAPACITY_REFUSED = f"engine refused work: {CAPACITY_EXHAUSTED_TEXT}"
# 401: a credential the service stops accepting mid-run; 402: payment or credits (the SDK pauses up to an hour)
REJECT_STATUSES = (401, 402, 429, 500, 502, 503)
QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]  # the SDK's TryAgainResponse.queue_state
# STATE values `--fault-queue-pause` takes: the paused ones (with a reason), or `active` (a hold
# whose polls look like any pending request: queue_state active, no reason; what Spindle sends).
HOLD_STATES: tuple[QueueState, ...] = ("paused_capacity", "paused_rate_limit", "active")
ANY_KIND = "*"
# Values of these headers are never recorded, whatever the whitelist says.
SECRET_HEADERS = frozenset(
    {"authorization", "x-api-key", "modal-secret", "modal-key", "cookie", "proxy-authorization"}
    | {"cf-access-client-secret", "cf-access-client-id"}
)
DEFAULT_VALUE_HEADERS = ("x-harness-probe",)
# Fields the SDK's response types (tinker 0.25.0 `tinker/types/*`) declare optional, per request
# kind, that `--fault-omit-field KIND.FIELD` may leave out. Dotted paths go into nested objects
# and through lists. `asample.logprobs` is per sampled sequence (protobuf); `forward.logprobs` /
# `forward_backward.logprobs` is the loss output key every datum carries (protobuf).
OPTIONAL_RESPONSE_FIELDS: dict[str, frozenset[str]] = {
    "load_weights": frozenset({"path", "model_id", "type"}),  # LoadWeightsResponse
    "get_info": frozenset(  # GetInfoResponse
        {
            "type",
            "model_data.arch",
            "model_data.model_name",
            "model_data.tokenizer_id",
            "is_lora",
            "lora_rank",
            "model_name",
        }
    ),
    "optim_step": frozenset({"metrics"}),  # OptimStepResponse
    "save_weights": frozenset({"type"}),  # SaveWeightsResponse (path is required)
    "save_weights_for_sampler": frozenset({"path", "sampling_session_id", "type"}),  # ...ResponseInternal
    "get_server_capabilities": frozenset({"supported_models.model_name", "supported_models.max_context_length"}),
    "asample": frozenset({"logprobs"}),  # SampledSequence.logprobs
    "forward": frozenset({"logprobs", "metrics"}),  # LossFnOutput keys; ForwardBackwardOutput.metrics
    "forward_backward": frozenset({"logprobs", "metrics"}),
}


class FaultSpecError(ValueError):
    """A fault option that cannot be parsed; the message names the option and the problem."""


@dataclass(frozen=True)
class Reject:
    """`reject_first`: the first `amount` requests of `kind` answer HTTP `status`; `reject_for`:
    every one does for `amount` seconds from the first."""

    kind: str
    status: int
    amount: float


@dataclass(frozen=True)
class Nth:
    """`model_lost` (spindle): the `number`-th submit of `kind` (1-based, counted over every model)
    finds the trainer of the model it was sent to gone: that submit and every later one on the
    model answer HTTP 410 model_lost, and its pending futures fail."""

    kind: str
    number: int


@dataclass(frozen=True)
class CapacityFail:
    """The listed requests of `kind` (1-based, counted per kind when they execute) fail their
    future with CAPACITY_EXHAUSTED_TEXT before the engine runs them (nothing is applied)."""

    kind: str
    numbers: frozenset[int]


@dataclass(frozen=True)
class OmitField:
    """`field` (a dotted path) is left out of responses of `kind`: every one, or only the listed
    ones (1-based, counted per kind as responses are built)."""

    kind: str
    field: str
    numbers: frozenset[int] | None = None


@dataclass(frozen=True)
class QueuePause:
    """The `number`-th request of `kind` (1-based, counted when its work is queued) waits `seconds`
    (None: forever) before it runs; meanwhile its polls are answered with 408 try_again carrying
    `queue_state` and a queue_state_reason, as a shared service pauses work it has no capacity for
    (state `active`: no reason, a plain pending request; forever, a request that never completes)."""

    kind: str
    number: int
    seconds: float | None
    queue_state: QueueState = "paused_capacity"
    moving: bool = False  # the reason names a queue position that changes at every poll


@dataclass(frozen=True)
class Hold:
    """What keeps one queued request from running (see QueuePause)."""

    queue_state: QueueState  # what its polls report: paused_capacity, paused_rate_limit, or active (a hang)
    reason: str | None
    until: float | None  # time.monotonic() when it may run; None: never
    positions: Iterator[int] | None = field(default=None, compare=False)  # a moving queue position, per poll

    def remaining(self, now: float) -> float | None:
        return None if self.until is None else max(0.0, self.until - now)

    def poll_reason(self) -> str | None:
        """The reason one poll reports: with a moving position, a new text at every poll."""
        if self.positions is None or self.reason is None:
            return self.reason
        return f"{self.reason}; queue position {next(self.positions)}"


@dataclass(frozen=True)
class FaultConfig:
    reject_first: tuple[Reject, ...] = ()
    capacity_exhausted: int = 0  # first N create_model requests fail their future with CAPACITY_REFUSED
    capacity_fail: tuple[CapacityFail, ...] = ()  # ordered training calls whose future fails with capacity
    latency_ms: tuple[tuple[str, float], ...] = ()  # (kind, ms) added before handling
    queue_pause: tuple[QueuePause, ...] = ()  # k-th request of a kind paused (try_again polls)
    reject_for: tuple[Reject, ...] = ()  # every request of a kind refused for a while
    die_after: int | None = None  # exit the process when API request K+1 arrives
    retry_after_ms: int | None = None  # Retry-After-Ms header on injected 429/503
    omit_field: tuple[OmitField, ...] = ()  # optional response fields left out
    model_lost: tuple[Nth, ...] = ()  # a model's trainer dies (spindle profile)
    record_header_values: tuple[str, ...] = DEFAULT_VALUE_HEADERS

    def __post_init__(self) -> None:
        for name in self.record_header_values:
            if name.lower() in SECRET_HEADERS:
                raise FaultSpecError(f"--record-header-values: refusing to record secret header {name!r}")
        if self.capacity_exhausted < 0:
            raise FaultSpecError("--fault-capacity-exhausted must be >= 0")
        if self.die_after is not None and self.die_after < 0:
            raise FaultSpecError("--fault-die-after must be >= 0")


def _split(spec: str, option: str, parts: int) -> list[str]:
    fields = spec.split(":")
    if len(fields) != parts or not all(fields):
        raise FaultSpecError(f"{option}: expected {parts} ':'-separated fields, got {spec!r}")
    return fields


def _num(value: str, option: str, what: str, kind: type = int, least: float = 0, forever: bool = False) -> float:
    """An integer (or a number; SECONDS finite) >= `least`, or FaultSpecError naming `what`."""
    try:
        n = kind(value)
    except ValueError:
        must = "an integer" if kind is int else "a number" + (" or forever" if forever else "")
        raise FaultSpecError(f"{option}: {what} must be {must}, got {value!r}") from None
    if what == "SECONDS" and (not n >= 0 or n == float("inf")):
        raise FaultSpecError(f"{option}: SECONDS must be >= 0, got {value!r}")
    if n < least:
        raise FaultSpecError(f"{option}: {what} {'counts requests from 1' if least else 'must be >= 0'}, got {n}")
    return n


def _status(value: str, option: str) -> int:
    status = int(_num(value, option, "status"))
    if status not in REJECT_STATUSES:
        raise FaultSpecError(f"{option}: status must be one of {REJECT_STATUSES}, got {status}")
    return status


def _numbers(numbers: str, option: str, what: str) -> frozenset[int]:
    """`N1[,N2...]`, 1-based."""
    try:
        ns = frozenset(int(n) for n in numbers.split(","))
    except ValueError:
        raise FaultSpecError(f"{option}: {what} numbers must be integers, got {numbers!r}") from None
    if min(ns) < 1:
        raise FaultSpecError(f"{option}: {what} numbers start at 1, got {numbers!r}")
    return ns


def parse_reject_first(spec: str) -> Reject:
    """`KIND:STATUS:N`, e.g. `forward_backward:429:2`."""
    kind, status, count = _split(spec, "--fault-reject-first", 3)
    return Reject(kind, _status(status, "--fault-reject-first"), int(_num(count, "--fault-reject-first", "N")))


def parse_reject_for(spec: str) -> Reject:
    """`KIND:STATUS:SECONDS`, e.g. `asample:429:20`: every sample submit refused for 20 s."""
    kind, status, secs = _split(spec, "--fault-reject-for", 3)
    return Reject(kind, _status(status, "--fault-reject-for"), _num(secs, "--fault-reject-for", "SECONDS", float))


def parse_capacity_fail(spec: str) -> CapacityFail:
    """`KIND:N1[,N2...]`, e.g. `optim_step:6`: the 6th optim_step fails with capacity exhausted."""
    kind, numbers = _split(spec, "--fault-capacity-fail", 2)
    return CapacityFail(kind, _numbers(numbers, "--fault-capacity-fail", "request"))


def parse_model_lost(spec: str) -> Nth:
    """`KIND:N`, e.g. `forward_backward:6`: a model's 6th forward_backward finds its trainer gone."""
    kind, n = _split(spec, "--fault-model-lost", 2)
    return Nth(kind, int(_num(n, "--fault-model-lost", "N", least=1)))


def parse_latency(spec: str) -> tuple[str, float]:
    """`KIND:MS`, e.g. `asample:200`."""
    kind, ms = _split(spec, "--fault-latency-ms", 2)
    return kind, _num(ms, "--fault-latency-ms", "MS", float)


def parse_queue_pause(spec: str) -> QueuePause:
    """`KIND:N:SECONDS[:STATE][:moving]`, e.g. `optim_step:1:30`, `create_model:1:forever:paused_rate_limit`
    or `forward_backward:1:forever:moving` (a queue position in the reason, new at every poll)."""
    option = "--fault-queue-pause"
    fields = spec.split(":")
    moving = len(fields) > 3 and fields[-1] == "moving"
    if moving:
        fields = fields[:-1]
    if len(fields) not in (3, 4) or not all(fields):
        raise FaultSpecError(f"{option}: expected KIND:N:SECONDS[:STATE][:moving], got {spec!r}")
    name = fields[3] if len(fields) == 4 else "paused_capacity"
    state = next((s for s in HOLD_STATES if s == name), None)
    if state is None:
        raise FaultSpecError(f"{option}: STATE must be one of {HOLD_STATES}, got {name!r}")
    if moving and state == "active":
        raise FaultSpecError(f"{option}: 'moving' needs a paused STATE (an active hold has no reason), got {spec!r}")
    seconds = (
        None if fields[2].lower() in ("forever", "inf") else _num(fields[2], option, "SECONDS", float, forever=True)
    )
    return QueuePause(fields[0], int(_num(fields[1], option, "N", least=1)), seconds, state, moving)


def parse_omit_field(spec: str) -> OmitField:
    """`KIND.FIELD[:N1,N2...]`, e.g. `load_weights.path` or `get_info.model_data.model_name:2`."""
    option = "--fault-omit-field"
    target, _, numbers = spec.partition(":")
    kind, _, field_path = target.partition(".")
    if not kind or not field_path:
        raise FaultSpecError(f"{option}: expected KIND.FIELD[:N1,N2...], got {spec!r}")
    allowed = OPTIONAL_RESPONSE_FIELDS.get(kind)
    if allowed is None:
        raise FaultSpecError(
            f"{option}: no optional response fields known for kind {kind!r}; kinds: {sorted(OPTIONAL_RESPONSE_FIELDS)}"
        )
    if field_path not in allowed:
        raise FaultSpecError(
            f"{option}: {field_path!r} is not an optional field of the SDK's {kind} response; optional: {sorted(allowed)}"
        )
    return OmitField(kind, field_path, _numbers(numbers, option, "response") if numbers else None)


# The repeatable `KIND:...` fault options cli.py adds (docs/local-server.md "Faults"): (option,
# METAVAR, parser, help); each fills the FaultConfig field named after it. `--fault-model-lost` is Spindle's.
FAULT_OPTIONS: tuple[tuple[str, str, Callable[[str], object], str], ...] = (
    ("--fault-reject-first", "KIND:STATUS:N", parse_reject_first, "the first N requests of KIND ('*': any) get STATUS"),
    ("--fault-reject-for", "KIND:STATUS:SECONDS", parse_reject_for, "every request of KIND gets STATUS for SECONDS"),
    (
        "--fault-queue-pause",
        "KIND:N:SECONDS[:STATE][:moving]",
        parse_queue_pause,
        "hold the N-th request of KIND for SECONDS ('forever'); its polls say queue_state STATE "
        "(paused_capacity, paused_rate_limit, or active: the only one Spindle sends; forever:active never completes)",
    ),
    (
        "--fault-capacity-fail",
        "KIND:N1[,N2...]",
        parse_capacity_fail,
        "fail those ordered training requests of KIND (counted at execution) with 'trainer capacity exhausted'",
    ),
    ("--fault-latency-ms", "KIND:MS", parse_latency, "add MS milliseconds (non-blocking) before each request of KIND"),
    (
        "--fault-omit-field",
        "KIND.FIELD[:N1,N2...]",
        parse_omit_field,
        "leave an optional response field out of every (or the N-th) response of KIND",
    ),
    (
        "--fault-model-lost",
        "KIND:N",
        parse_model_lost,
        "spindle only: at the N-th request of KIND, the trainer of its model is gone (410 model_lost)",
    ),
)


def drop_path(obj: JsonValue, path: str) -> int:
    """Remove the dotted `path` from a JSON-like object in place (through lists); returns how many
    keys were removed."""
    head, _, rest = path.partition(".")
    if isinstance(obj, list):
        return sum(drop_path(x, path) for x in obj)
    if not isinstance(obj, dict) or head not in obj:
        return 0
    if not rest:
        del obj[head]
        return 1
    return drop_path(obj[head], rest)


@dataclass(frozen=True)
class Decision:
    """What to do with one request before handling it."""

    reject_status: int | None = None
    reject_reason: str = ""
    latency_s: float = 0.0
    die: bool = False


def _names(rule_kind: str, kind: str) -> bool:
    return rule_kind in (kind, ANY_KIND)


@dataclass
class FaultInjector:
    """Thread-safe decisions and counters; one per server."""

    config: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # kind -> requests seen (faults included)
        self.injected: Counter[str] = Counter()  # "kind:what" -> count
        self._submits_seen: Counter[str] = Counter()  # spindle submits by kind, for --fault-model-lost
        self.api_requests = 0  # counted toward die_after
        self._capacity_left = self.config.capacity_exhausted
        self.executed: Counter[str] = Counter()  # kind -> ordered calls that reached execution
        self.answered: Counter[str] = Counter()  # kind -> responses built (for --fault-omit-field numbers)
        self.queued: Counter[str] = Counter()  # kind -> requests whose work was queued
        self._reject_since: dict[str, float] = {}  # reject_for kind -> when its first request came

    def decide(self, kind: str, counts_toward_death: bool = True) -> Decision:
        cfg = self.config
        with self._lock:
            self.requests[kind] += 1
            seen = self.requests[kind]
            if counts_toward_death:
                self.api_requests += 1
                if cfg.die_after is not None and self.api_requests > cfg.die_after:
                    self.injected["*:die"] += 1
                    return Decision(die=True)
            latency = sum(ms for k, ms in cfg.latency_ms if _names(k, kind)) / 1000.0
            if latency:
                self.injected[f"{kind}:latency"] += 1
            for rule in cfg.reject_first:
                if _names(rule.kind, kind) and seen <= rule.amount:
                    self.injected[f"{kind}:{rule.status}"] += 1
                    return Decision(rule.status, f"injected {rule.status} (first {rule.amount} {rule.kind})", latency)
            for window in cfg.reject_for:
                if _names(window.kind, kind):
                    start = self._reject_since.setdefault(window.kind, time.monotonic())
                    if time.monotonic() - start < window.amount:
                        self.injected[f"{kind}:{window.status}"] += 1
                        reason = (
                            f"injected {window.status}: {kind} refused for {window.amount:g} s from the first request"
                        )
                        return Decision(window.status, reason, latency)
            return Decision(latency_s=latency)

    def take_capacity_failure(self) -> bool:
        """True while create_model should fail its future (the first `capacity_exhausted` ones)."""
        with self._lock:
            if self._capacity_left <= 0:
                return False
            self._capacity_left -= 1
            self.injected["create_model:capacity_exhausted"] += 1
            return True

    def take_call_capacity_failure(self, kind: str) -> bool:
        """For an ordered call about to execute: True if this one (by its number) must fail."""
        with self._lock:
            self.executed[kind] += 1
            if any(_names(r.kind, kind) and self.executed[kind] in r.numbers for r in self.config.capacity_fail):
                self.injected[f"{kind}:capacity_exhausted"] += 1
                return True
            return False

    def model_lost_now(self, kind: str) -> bool:
        """Counts one submit of `kind`; True if a --fault-model-lost rule kills the trainer of the
        model it was sent to here (the rule's number-th submit of its kind on this server)."""
        with self._lock:
            self._submits_seen[kind] += 1
            self._submits_seen[ANY_KIND] += 1
            for rule in self.config.model_lost:
                if _names(rule.kind, kind) and self._submits_seen[rule.kind] == rule.number:
                    self.injected[f"{kind}:model_lost"] += 1
                    return True
        return False

    def omitted_fields(self, kind: str) -> frozenset[str]:
        """Counts one response of `kind` being built; the field paths to leave out of it."""
        rules = [r for r in self.config.omit_field if r.kind == kind]
        if not rules:
            return frozenset()
        with self._lock:
            self.answered[kind] += 1
            out = frozenset(r.field for r in rules if r.numbers is None or self.answered[kind] in r.numbers)
            for f in out:
                self.injected[f"{kind}:omit:{f}"] += 1
            return out

    def omit_json(self, kind: str, payload: dict[str, JsonValue]) -> dict[str, JsonValue]:
        """`payload` (a JSON object about to be sent for `kind`) without the omitted fields."""
        for path in self.omitted_fields(kind):
            drop_path(payload, path)
        return payload

    def take_hold(self, kind: str) -> Hold | None:
        """For a request whose work is about to be queued: what holds it, if a rule names it."""
        with self._lock:
            self.queued[kind] += 1
            n = self.queued[kind]
            for pause in self.config.queue_pause:
                if _names(pause.kind, kind) and pause.number == n:
                    self.injected[f"{kind}:queue_pause"] += 1
                    how_long = "until further notice" if pause.seconds is None else f"for {pause.seconds:g} s"
                    reason = f"embedded server fault: no capacity for {kind} request {n}; paused {how_long}"
                    until = None if pause.seconds is None else time.monotonic() + pause.seconds
                    positions = itertools.count(10_000, -1) if pause.moving else None
                    return Hold(pause.queue_state, None if pause.queue_state == "active" else reason, until, positions)
            return None

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "executed": dict(self.executed),
                "requests": dict(self.requests),
                "injected": dict(self.injected),
                "api_requests": self.api_requests,
            }


@dataclass
class HeaderRecorder:
    """Counts header names of every request; keeps values only of whitelisted, non-secret names."""

    value_names: tuple[str, ...] = DEFAULT_VALUE_HEADERS

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted = {n.lower() for n in self.value_names} - SECRET_HEADERS
        self.names: Counter[str] = Counter()
        self.values: dict[str, list[str | None]] = {}

    def record(self, headers: Mapping[str, str]) -> None:
        with self._lock:
            for name in {k.lower() for k in headers}:
                self.names[name] += 1
                if name in self._wanted:
                    seen = self.values.setdefault(name, [])
                    value = headers.get(name)
                    if value not in seen and len(seen) < 100:
                        seen.append(value)

    def snapshot(self) -> dict:
        with self._lock:
            return {"names": dict(self.names), "values": {k: list(v) for k, v in self.values.items()}}

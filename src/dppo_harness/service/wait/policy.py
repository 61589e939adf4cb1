"""The service wait policy's settings, its stops (see `waiter` for how waits apply them), and the
capacity refusals raised as errors (429, 503, 'trainer capacity exhausted'), recognised from the
service's own text and retried with backoff until the capacity window closes.

The stops derive from `ServiceStopped`, a BaseException like KeyboardInterrupt, so that a stage's
own `except Exception` bookkeeping cannot turn a stopped service into a finished stage.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, TypeVar

from dppo_harness.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    from dppo_harness.service.observed import ClientRegistry

logger = logging.getLogger(__name__)
T = TypeVar("T")

CAPACITY_SCALE_VAR = "DPPO_HARNESS_CAPACITY_SCALE"
# The embedded server has no shared capacity to wait for: its capacity windows are this fraction
# of the defaults, under the same rules.
LOCAL_CAPACITY_SCALE = 0.01


class ServiceConfigError(RuntimeError):
    """The service cannot be configured; the message names the variable or option, never a value."""


def capacity_scale(env: Mapping[str, str] | None = None, backend: str = "tinker") -> float:
    """CAPACITY_SCALE_VAR, else LOCAL_CAPACITY_SCALE on the embedded server, else 1."""
    raw = (os.environ if env is None else env).get(CAPACITY_SCALE_VAR)
    if not raw:
        return LOCAL_CAPACITY_SCALE if backend == "local" else 1.0
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not 0.0 < scale <= 1.0:
        raise ServiceConfigError(f"{CAPACITY_SCALE_VAR} must be a number in (0, 1], got {raw!r}")
    return scale


@dataclass(frozen=True)
class WaitPolicy:
    """How long the harness waits on the service, for every call of every stage: a pause may last
    the capacity patience (before / after the first completed comparison step), a call with no pause
    seen the service timeout. A wait longer than `post_after_s` is posted every `post_every_s` and
    at most every `snapshot_every_s` as a journal snapshot."""

    capacity_patience_s: float = 600.0
    capacity_patience_after_steps_s: float = 1800.0
    service_timeout_s: float = 900.0
    backoff_s: tuple[float, ...] = (60.0, 120.0, 240.0)
    poll_s: float = 1.0
    post_after_s: float = 60.0
    post_every_s: float = 30.0
    snapshot_every_s: float = 300.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "backoff_s" and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ServiceConfigError(
                    f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}"
                )

    @classmethod
    def from_options(
        cls,
        *,
        capacity_patience_s: float | None = None,
        capacity_patience_after_steps_s: float | None = None,
        service_timeout_s: float | None = None,
        backend: str = "tinker",
        env: Mapping[str, str] | None = None,
    ) -> WaitPolicy:
        """Options given explicitly are used as they are; the capacity defaults (and the refusal
        backoff) are shrunk by `capacity_scale`."""
        s = capacity_scale(env, backend)
        patience = cls.capacity_patience_s * s if capacity_patience_s is None else capacity_patience_s
        after = cls.capacity_patience_after_steps_s * s
        timeout = cls.service_timeout_s if service_timeout_s is None else service_timeout_s
        # Waits are watched (and posted) at a grain that fits the shortest window.
        shortest = min(patience, timeout)
        return cls(
            capacity_patience_s=patience,
            capacity_patience_after_steps_s=after
            if capacity_patience_after_steps_s is None
            else capacity_patience_after_steps_s,
            service_timeout_s=timeout,
            backoff_s=tuple(b * s for b in cls.backoff_s),
            poll_s=min(1.0, max(0.05, shortest / 20)),
            post_after_s=min(60.0, max(0.2, shortest / 5)),
            post_every_s=min(30.0, max(0.2, shortest / 5)),
            snapshot_every_s=min(300.0, max(1.0, shortest)),
        )

    def capacity_window(self, steps_completed: int) -> float:
        return self.capacity_patience_after_steps_s if steps_completed > 0 else self.capacity_patience_s

    def backoff(self, attempt: int) -> float:
        """The wait before retrying a refused call (1, 2, 4 minutes, then 4 again, scaled)."""
        return self.backoff_s[min(attempt, len(self.backoff_s) - 1)]

    def as_evidence(self) -> JsonObject:
        return {
            k: getattr(self, k) for k in ("capacity_patience_s", "capacity_patience_after_steps_s", "service_timeout_s")
        }


STOPPED_FIELDS: JsonObject = {"status": "failed", "verdict": "inconclusive", "outcome_reason": "incomplete_execution"}


class ServiceStopped(BaseException):
    """The wait policy stopped the stage. `line` is the one line shown; `details` what the service
    said, for result.json's service_wait.stopped (beside kind and line); `result_fields()` the
    result.json fields of the stopped run (STOPPED_FIELDS, plus what stopped it)."""

    kind = "stopped"

    def __init__(self, line: str, **details: JsonValue):
        super().__init__(line)
        self.line, self.details = line, details

    def result_fields(self) -> JsonObject:
        return dict(STOPPED_FIELDS)


@dataclass(frozen=True)
class CapacityBlock:
    error: str  # the exact error text or queue_state_reason the service sent
    comparison_steps_completed: int
    released_clients: bool

    def as_dict(self) -> JsonObject:
        return asdict(self)

    def result_fields(self) -> JsonObject:
        return {**STOPPED_FIELDS, "capacity_block": self.as_dict()}


class CapacityExhausted(ServiceStopped):
    """The service kept refusing or pausing work for the whole capacity window."""

    kind = "capacity"

    def __init__(self, block: CapacityBlock, waited_s: float, attempts: int, line: str | None = None):
        super().__init__(
            line
            or (
                f"service capacity refused for {waited_s:.0f}s over {attempts} attempts; giving up "
                f"(comparison steps completed: {block.comparison_steps_completed}, "
                f"clients released: {block.released_clients}): {block.error}"
            )
        )
        self.block, self.waited_s, self.attempts = block, waited_s, attempts

    def result_fields(self) -> JsonObject:
        return self.block.result_fields()


class WallBudgetSpent(ServiceStopped):
    """A call was still waiting when the plan's wall budget ran out (the comparison sets the budget
    its waits may use); the patience windows alone could outlast it."""

    kind = "wall_budget"

    def __init__(self, call: str, client: str, waited_s: float):
        super().__init__(
            f"{call} on {client}: the plan's wall budget ran out after {int(waited_s)} s of waiting on the service"
        )


class ServiceDied(ServiceStopped):
    """The service process itself exited while the run used it (the embedded server: its exit code
    and the last lines of its log); the SDK alone would re-poll a vanished server for minutes."""

    kind = "server_died"

    def __init__(self, what: str, exit_code: int | None, log_tail: str):
        super().__init__(
            f"{what} exited (exit code {exit_code}) while the run was using it; "
            "its last log lines are in result.json service_wait.stopped.log_tail",
            exit_code=exit_code,
            log_tail=log_tail,
        )
        self.exit_code = exit_code


class ModelLost(ServiceStopped):
    """The service lost a model: Spindle answers every later submit on a model whose trainer died
    410 `model_lost`, and fails the model's pending futures ("engine terminated before producing a
    result") (control_plane/http.py, service.py). The model does not come back; the only way on is a
    new client loaded from a saved checkpoint."""

    kind = "model_lost"

    def __init__(self, call: str, client: str, model_id: str | None, text: str):
        named = f"{client} (model {model_id})" if model_id and model_id not in client else client
        super().__init__(
            f"{call} on {named}: the service lost the model ({text}); it does not come back, "
            "a new client must be loaded from a saved checkpoint",
            call=call,
            client=client,
            model_id=model_id,
            error=text,
        )
        self.call, self.client, self.model_id, self.text = call, client, model_id, text


class ServiceHang(ServiceStopped):
    """A request with no pause seen gave no answer for the whole service timeout."""

    kind = "no_answer"

    def __init__(self, call: str, client: str, waited_s: float, queue_state: str | None):
        super().__init__(
            f"{call} on {client}: no answer for {int(waited_s)} s"
            f" (queue state {queue_state or 'never reported'}; --service-timeout-s)"
        )


@dataclass
class CapacityTracker:
    """Completed comparison steps (the capacity window switches from 10 to 30 minutes after the first)."""

    comparison_steps_completed: int = 0

    def step_done(self) -> None:
        self.comparison_steps_completed += 1

    def __call__(self) -> int:
        return self.comparison_steps_completed


CAPACITY_MARKERS = ("capacity exhausted", "capacity_exhausted")
_QUOTED_RE = re.compile(r"'[^']*'|\"[^\"]*\"")
_STATUS_IN_TEXT_RE = re.compile(r"(?<![\w-])(?:429|503)(?![\w-])|too many requests|service unavailable")


_SDK_FAILED_RE = re.compile(r"^Request failed: (.*) for self\.request_id=.*$", re.DOTALL)


def error_text(exc: BaseException) -> str:
    """The service's own error text: a failed future's server message without the SDK's
    'Request failed: ... for self.request_id=...' wrapper; otherwise the exception's message."""
    text = getattr(exc, "message", None) or str(exc)
    m = _SDK_FAILED_RE.match(text)
    return m.group(1) if m else text


# A lost trainer, in Spindle's words: 410 `model_lost` on a submit, and the text its pending futures
# fail with (control_plane/http.py, service.py). 410 `request_lost` is not one: the SDK resends.
MODEL_LOST_CODE = "model_lost"
ENGINE_TERMINATED_TEXT = "engine terminated before producing a result"


def model_lost_error(exc: BaseException) -> str | None:
    """The service's words when `exc` says the model is gone (410 model_lost, or a pending future
    failed because its engine terminated); None for anything else."""
    import tinker  # the SDK's error types: the plugin imports this module at start-up, the SDK loads late

    if isinstance(exc, tinker.APIStatusError) and exc.status_code == 410:
        body = exc.body if isinstance(exc.body, dict) else {}
        if body.get("error") == MODEL_LOST_CODE:
            return f"410 {MODEL_LOST_CODE}: {body.get('message') or error_text(exc)}"
        return None
    text = error_text(exc)
    if ENGINE_TERMINATED_TEXT in text or (isinstance(exc, tinker.RequestFailedError) and MODEL_LOST_CODE in text):
        return text
    return None


def is_capacity_error(exc: BaseException) -> bool:
    """429, 503, or a 'trainer capacity exhausted' message, from creation or any call."""
    import tinker  # the SDK's error types: the plugin imports this module at start-up, the SDK loads late

    if isinstance(exc, tinker.RateLimitError):
        return True
    status = getattr(exc, "status_code", None)
    if isinstance(exc, tinker.APIStatusError) and status in (429, 503):
        return True
    # Quoted names (checkpoints, models) are the caller's, not the service's words: a checkpoint
    # saved at 00:45:03 is named '...T004503Z-...'.
    text = _QUOTED_RE.sub("''", error_text(exc).lower())
    if any(m in text for m in CAPACITY_MARKERS):
        return True
    # A failed future carries only a message; the server's status may be inside it.
    return isinstance(exc, tinker.RequestFailedError) and bool(_STATUS_IN_TEXT_RE.search(text))


def call_with_capacity_retry(
    fn: Callable[[], T],
    *,
    policy: WaitPolicy | None = None,
    steps_completed: int | Callable[[], int] = 0,
    registry: ClientRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call fn; on a capacity refusal, back off and retry until the policy's window (re-read on every
    refusal) closes; then release the registry's clients and raise CapacityExhausted. Other errors
    propagate at once. `fn` should bound its own wait: the SDK retries 429/5xx for minutes itself."""
    policy = policy or WaitPolicy()
    started: float | None = None
    attempt = 0
    while True:
        attempt_start = clock()
        try:
            return fn()
        except Exception as exc:
            if not is_capacity_error(exc):
                raise
            # The window opens when the first refused attempt began: time the SDK already spent
            # retrying 429/503 internally before raising counts as waiting on the service.
            started = attempt_start if started is None else started
            elapsed = clock() - started
            steps = steps_completed() if callable(steps_completed) else steps_completed
            window = policy.capacity_window(steps)
            if elapsed >= window:
                released = registry.release_all("errored") if registry is not None else False
                block = CapacityBlock(error_text(exc), int(steps), released)
                raise CapacityExhausted(block, elapsed, attempt + 1) from exc
            wait = min(policy.backoff(attempt), window - elapsed)
            logger.warning(
                "capacity refusal (attempt %d, %.0fs elapsed); retrying in %.0fs: %s",
                attempt + 1,
                elapsed,
                wait,
                error_text(exc),
            )
            sleep(wait)
            attempt += 1

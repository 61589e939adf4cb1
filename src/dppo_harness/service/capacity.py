"""Capacity refusals raised as errors (429, 503, 'trainer capacity exhausted'): recognised from the
service's own text, and retried with backoff until the capacity window closes."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import tinker

from dppo_harness.service.wait.policy import CapacityBlock, CapacityExhausted, WaitPolicy

if TYPE_CHECKING:
    from dppo_harness.service.release import ClientRegistry

logger = logging.getLogger(__name__)
T = TypeVar("T")

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


@dataclass
class CapacityEvent:
    attempt: int
    elapsed_s: float
    sleep_s: float
    error: str


def call_with_capacity_retry(
    fn: Callable[[], T],
    *,
    policy: WaitPolicy | None = None,
    steps_completed: int | Callable[[], int] = 0,
    registry: ClientRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[CapacityEvent], None] | None = None,
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
            event = CapacityEvent(attempt + 1, elapsed, wait, error_text(exc))
            logger.warning("capacity refusal (attempt %d, %.0fs elapsed); retrying in %.0fs: %s", *vars(event).values())
            if on_retry is not None:
                on_retry(event)
            sleep(wait)
            attempt += 1

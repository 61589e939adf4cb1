"""Errors of the evidence bundle (SecretLeakError comes from secrets_scan)."""

from __future__ import annotations


class EvidenceError(RuntimeError):
    """Bad input to the bundle; nothing was written."""


class LimitError(EvidenceError):
    """A file, the file count or the run's total bytes would exceed the bundle's limits."""


class ImmutableNameError(EvidenceError):
    """A registered name was offered different bytes or a different kind."""


class ResultShapeError(EvidenceError):
    """result.json would not have the structured-output shape (`result.ResultModel`)."""


class UnwritableEvidenceError(EvidenceError):
    """The evidence directory refused a write (disk full, read-only, permission denied); nothing of
    that write landed. Its message is the one line a user sees."""

"""The JSON blocks the diagnostic's steps hand each other and write as evidence, typed: the
deterministic self-test's report and the sentinels' summary. They stay dicts (the evidence files
are these dicts, key for key); the TypedDicts say which keys each one has."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class SelftestCase(TypedDict):
    """One must-fire / must-not-fire case through the real packed loss."""

    expected: list[int]
    recorded: list[int]
    loss_reported: list[int]
    expected_counts: dict[str, int]
    grads: list[float]
    passed: bool
    problems: list[str]


class SelftestReport(TypedDict):
    """diagnostic-selftest.json: every case, and whether all passed."""

    passed: bool
    loss_config: dict[str, Any]  # dataclasses.asdict of the loss's LossConfig
    cases: dict[str, SelftestCase]
    note: str


class SentinelPoint(TypedDict):
    """The sentinels measured once: after which update, when, and the drift summary."""

    after_update: int
    elapsed_s: float
    summary: dict[str, Any]  # instrumentation.sentinel_summary
    logprobs: NotRequired[list[float]]  # in the evidence file only


class SentinelSummary(TypedDict):
    """The sentinels as the analysis reads them (no raw logprobs); `at_init` is the first point's
    summary, `last` the last point when there are two or more. A run that never chose sentinels
    has only `points`, `at_init` and `last`."""

    sequence_indices: NotRequired[list[int]]
    selection_rule: NotRequired[str]
    tokens: NotRequired[int]
    after_updates: NotRequired[list[int]]
    points: list[SentinelPoint]
    at_init: dict[str, Any] | None
    last: SentinelPoint | None


class SentinelEvidence(SentinelSummary):
    """diagnostic-sentinels.json: the summary with every point's raw logprobs, the sampler's and the mask."""

    sampler_logprobs: list[float]
    mask: list[float]


class DiagnosticFinal(TypedDict):
    """The outcome the diagnostic proposes for result.json's `final` block."""

    status: str
    verdict: str
    outcome_reason: str


class DiagnosticResultFields(TypedDict):
    """What the diagnostic contributes to result.json (numbers only under `metrics`)."""

    metrics: dict[str, float]
    summary: str
    activation_calibration: dict[str, Any]  # {"values", "note", "evidence_ref"}
    final: DiagnosticFinal

"""What a resumed comparison must reproduce of an uninterrupted run's step rows (the resume
tests' comparison): token-derived fields exactly, logprob-derived floats within a tolerance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from dppo_harness.stages.comparison.step_rows import StepRowJson, number

TIMING_KEYS = ("seconds", "sample_seconds", "rollout_seconds", "sampler_checkpoint", "retries")


def comparable(row: StepRowJson) -> StepRowJson:
    """A step row without wall times and paths (what must match between a resumed and an
    uninterrupted run): `TIMING_KEYS` left out."""
    return cast(StepRowJson, {k: v for k, v in row.items() if k not in TIMING_KEYS})


# What the sampled tokens decide must match exactly between a resumed and an uninterrupted run;
# logprob-derived floats only to the embedded server's run-to-run float noise (its batched CPU
# kernels are not bitwise reproducible between two runs, resumed or not).
TOKEN_FIELDS = (
    "reward_mean",
    "format_rate",
    "correct_rate",
    "response_tokens",
    "loss_tokens",
    "updates",
    "loss",
    "truncated_frac",
    "no_answer_frac",
    "mean_response_tokens",
    "responses",
    "max_tokens",
    "cookbook_env",
)
RESUME_FLOAT_ATOL = 2e-3


def row_differences(got_row: StepRowJson, want_row: StepRowJson, atol: float = RESUME_FLOAT_ATOL) -> list[str]:
    """Why two comparable step rows of the same arm and step differ (empty: they match)."""
    got: Mapping[str, object] = got_row  # every field, by name
    want: Mapping[str, object] = want_row
    where = f"{got['arm']} step {got['step']}"
    out = [f"{where}: {k} {got.get(k)!r} != {want.get(k)!r}" for k in TOKEN_FIELDS if got.get(k) != want.get(k)]
    out += [
        f"{where}: {k} {got[k]!r} vs {want[k]!r}"
        for k in sorted(set(want) - set(TOKEN_FIELDS) - {"arm", "step"})
        if abs(number(got_row, k) - number(want_row, k)) > atol
    ]
    return out

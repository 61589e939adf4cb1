"""Truncation and answer yield of a set of sampled responses (rollouts or greedy evaluation).

The `qwen3_5` renderer prefills every generation prompt with `<think>\\n`, so a response starts
inside a reasoning block; one cut off at `max_tokens` before its `\\boxed{}` answer scores 0
(-0.1 in training). Both arms are then pulled toward zero, so every batch and every scored model
says how often that happened (`DEFINITIONS`). Truncation is the sampler's own word (its
stop_reason), never inferred from lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dppo_harness.json_types import JsonObject

TRUNCATED_STOP_REASON = "length"


@dataclass(frozen=True)
class ResponseYield:
    n: int  # responses
    truncated: int  # stop_reason "length"
    no_answer: int  # no \boxed{} answer in the parsed text
    response_tokens: int  # summed over the responses
    max_tokens: int | None = None  # the sampling limit, when known

    @property
    def truncated_frac(self) -> float:
        return self.truncated / self.n

    @property
    def no_answer_frac(self) -> float:
        return self.no_answer / self.n

    @property
    def mean_response_tokens(self) -> float:
        return self.response_tokens / self.n

    def as_dict(self) -> JsonObject:
        return {
            "n": self.n,
            "truncated": self.truncated,
            "truncated_frac": self.truncated_frac,
            "no_answer": self.no_answer,
            "no_answer_frac": self.no_answer_frac,
            "mean_response_tokens": self.mean_response_tokens,
            "max_tokens": self.max_tokens,
            "definitions": {**DEFINITIONS},
        }


DEFINITIONS = {
    "truncated": "sampler stop_reason == 'length' (stopped at max_tokens)",
    "no_answer": "tinker_cookbook math_grading.extract_boxed finds no \\boxed{} in the parsed response text",
    "mean_response_tokens": "sampled tokens per response (stop token included when sampled)",
}


def response_yield(
    stop_reasons: Sequence[str], answers_found: Sequence[bool], lengths: Sequence[int], *, max_tokens: int | None = None
) -> ResponseYield:
    """The yield of one set of responses; the three sequences are per response, in the same order."""
    n = len(stop_reasons)
    if n == 0:
        raise ValueError("no responses: truncation and answer yield are undefined")
    return ResponseYield(
        n=n,
        truncated=sum(str(s) == TRUNCATED_STOP_REASON for s in stop_reasons),
        no_answer=sum(not bool(a) for a in answers_found),
        response_tokens=int(sum(lengths)),
        max_tokens=max_tokens,
    )


def pooled(yields: Sequence[ResponseYield]) -> ResponseYield:
    """Several sets as one (counts summed, so fractions are per response over all sets)."""
    if not yields:
        raise ValueError("nothing to pool")
    limits = {y.max_tokens for y in yields}
    return ResponseYield(
        n=sum(y.n for y in yields),
        truncated=sum(y.truncated for y in yields),
        no_answer=sum(y.no_answer for y in yields),
        response_tokens=sum(y.response_tokens for y in yields),
        max_tokens=limits.pop() if len(limits) == 1 else None,
    )

"""The correctness-preflight paths this harness implements, by the id a spec names them with.

A spec's ``correctness_preflight.paths[*]`` names each path it requires; the harness checks only
paths it implements, so a spec naming another id (or another kind) is refused at load rather
than run with a check it did not ask for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImplementedPath:
    id: str
    kind: str
    what: str  # what the harness checks under this id, for the refusal line and the docs


IMPLEMENTED_PATHS: dict[str, ImplementedPath] = {
    p.id: p
    for p in (
        ImplementedPath(
            "grpo_dppo_custom_loss",
            "loss",
            "both registered losses through forward_backward_custom against the pinned golden values",
        ),
    )
}
DEFAULT_PATH_ID = "grpo_dppo_custom_loss"  # the CLI's block when no spec is given


def implemented_list() -> str:
    return ", ".join(f"{p.id} (kind {p.kind}: {p.what})" for p in IMPLEMENTED_PATHS.values())

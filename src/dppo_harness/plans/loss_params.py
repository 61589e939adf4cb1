"""What a spec says about its losses, checked against what the harness implements: the
correctness-preflight paths it names. A spec is refused at load, in one line naming the field,
when it names a path the harness does not run."""

from __future__ import annotations

from dppo_harness.loss.correctness_paths import IMPLEMENTED_PATHS, implemented_list
from dppo_harness.plans.models import ExperimentSpec, PlanError


def check_correctness_paths(spec: ExperimentSpec) -> tuple[str, ...]:
    """The spec's correctness path ids, each one the harness implements with the kind the spec
    gives it, each named once, at least one when the preflight is required; else PlanError."""
    block = spec.correctness_preflight
    if block.required and not block.paths:
        raise PlanError(f"correctness_preflight.paths: the spec requires a correctness preflight but names no path "
                        f"(implemented: {implemented_list()})")
    seen: set[str] = set()
    for i, path in enumerate(block.paths):
        at = f"correctness_preflight.paths[{i}]"
        known = IMPLEMENTED_PATHS.get(path.id)
        if known is None:
            raise PlanError(f"{at}.id: {path.id!r} is not a correctness path this harness implements "
                            f"(implemented: {implemented_list()})")
        if path.kind != known.kind:
            raise PlanError(f"{at}.kind: {path.kind!r}, but the harness's path {path.id!r} is of kind {known.kind!r}")
        if path.id in seen:
            raise PlanError(f"{at}.id: {path.id!r} is named twice")
        seen.add(path.id)
    return tuple(p.id for p in block.paths)

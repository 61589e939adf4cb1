"""The stages of the gated experiment, listed once, and the rules read from that list: run order,
prerequisites, a test's stage from its folder or marker, `-m` selection.

The list is read by the plugin's hooks, the evidence's test manifest (`evidence.session`) and,
through a unit test that holds them equal, the launch block's Literal of authorizable stages
(`plans.models.Launch`, which pydantic needs spelled out).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePath

from dppo_harness.project import REHEARSAL_PLAN


@dataclass(frozen=True)
class Stage:
    name: str
    folder: str  # its tests' folder below `tests/`
    prerequisites: tuple[str, ...]  # stages that must pass first, in run order
    authorizable: bool  # trains beyond setup: on a service a plan's launch block must authorize it


# In run order.
STAGE_LIST: tuple[Stage, ...] = (
    Stage("unit", "unit", (), authorizable=False),
    Stage("preflight", "preflight", ("unit",), authorizable=False),
    Stage("gate", "gates", ("unit", "preflight"), authorizable=True),
    Stage("diagnostic", "diagnostic", ("unit", "preflight"), authorizable=True),
    Stage("comparison", "comparison", ("unit", "preflight", "gate"), authorizable=True),
)

STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_LIST)
PREREQUISITES: dict[str, tuple[str, ...]] = {s.name: s.prerequisites for s in STAGE_LIST}
AUTHORIZABLE: tuple[str, ...] = tuple(s.name for s in STAGE_LIST if s.authorizable)

# Tests of stage "unit" that are not part of "unit parity" when unit runs only as a prerequisite.
INTEGRATION_FOLDER = "integration"

FOLDER_STAGE: dict[str, str] = {s.folder: s.name for s in STAGE_LIST} | {INTEGRATION_FOLDER: "unit"}
# Folders whose test files the evidence's manifest flags as stage tests (every stage but unit's).
STAGE_TEST_FOLDERS: tuple[str, ...] = tuple(s.folder for s in STAGE_LIST if s.name != "unit")

_STAGE_EXPR = re.compile(r"^\s*\w+(\s+or\s+\w+)*\s*$")


def stage_index(stage: str) -> int:
    return STAGES.index(stage)


TESTS_FOLDER = "tests"


def stage_from_path(path: PurePath) -> str | None:
    """The stage of a test file from its folder below the innermost `tests/` whose child on the way
    to the file is a stage folder; None outside one. Read from the file's own path, so it does not
    depend on pytest's rootdir or the current directory."""
    parts = path.parts
    for i in range(len(parts) - 3, -1, -1):
        if parts[i] == TESTS_FOLDER and parts[i + 1] in FOLDER_STAGE:
            return FOLDER_STAGE[parts[i + 1]]
    return None


def stage_of(marker_names: Iterable[str], path: PurePath) -> str:
    """An explicit stage marker wins; else the folder decides; else the test is a unit test."""
    marked = {m for m in marker_names if m in STAGES}
    if len(marked) > 1:
        raise ValueError(f"{path}: a test may carry one stage marker, got {sorted(marked)}")
    return marked.pop() if marked else stage_from_path(path) or "unit"


def parse_stage_selection(markexpr: str) -> tuple[str, ...] | None:
    """Stages named by a plain `-m a or b` expression; None when the expression is anything else."""
    if not markexpr or not _STAGE_EXPR.match(markexpr):
        return None
    names = list(re.split(r"\s+or\s+", markexpr.strip()))
    if not all(n in STAGES for n in names):
        return None
    return tuple(sorted(set(names), key=stage_index))


def expand_selection(selected: Sequence[str]) -> dict[str, bool]:
    """Stages to run in run order, each flagged True when it was selected itself (False: only a prerequisite)."""
    run: dict[str, bool] = {}
    for stage in selected:
        for pre in PREREQUISITES[stage]:
            run.setdefault(pre, False)
        run[stage] = True
    return {s: run[s] for s in sorted(run, key=stage_index)}


def default_plan_name(stages: Iterable[str], backend: str = "tinker") -> str:
    """The diagnostic runs the requester's revised plan. Every other stage runs the saved spec on a
    service, and the declared rehearsal (plans/rehearsal/) on the local backend: the stand-in cannot
    run the spec within its budget (its feasibility says so), and a run there never pretends to
    rehearse the spec at a size it does not run."""
    run = set(stages)
    if "diagnostic" in run:
        return "exp_e6b0965af3-diagnostic-r1.json"
    if backend == "local" and run & {"preflight", "gate", "comparison"}:
        return REHEARSAL_PLAN
    return "exp_e6b0965af3.json"

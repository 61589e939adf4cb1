"""Where the harness's own files live: the project tree the installed package came from.

Default plans (`plans/`), the stage test folders (`tests/`), the code archive's roots and the
default evidence root are resolved from this package's location, never from the current
directory or pytest's rootdir (which pytest derives from whatever command-line arguments exist as
paths, option values included). The package ships in a src layout, `<project>/src/dppo_harness`,
and is installed editable (`pip install -e <project>`), so the project is two folders up; the
vendored data sits inside the package itself (`dppo_harness/data`). A package installed without
its project cannot run the stages, and says so in one line.
"""

from __future__ import annotations

import functools
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SPEC_PLAN = "exp_e6b0965af3.json"  # the saved spec every stage derives from
REHEARSAL_PLAN = "rehearsal/comparison-local.json"  # the declared local comparison rehearsal


class ProjectNotFound(RuntimeError):
    """The package is not inside its project tree (the message is one line)."""


@functools.cache
def project_root() -> Path:
    """The project the package came from: the folder holding pyproject.toml and plans/."""
    root = PACKAGE_DIR.parents[1]
    if (root / "pyproject.toml").is_file() and (root / "plans" / SPEC_PLAN).is_file():
        return root
    raise ProjectNotFound(
        f"dppo_harness at {PACKAGE_DIR} is not inside its project (no {root / 'plans' / SPEC_PLAN}); "
        f"install the project itself with `pip install -e <project>`"
    )


def plans_dir() -> Path:
    return project_root() / "plans"


def plan_file(name: str) -> Path:
    """A plan of the project by its path under plans/ (e.g. REHEARSAL_PLAN)."""
    return plans_dir() / name


def default_evidence_dir() -> Path:
    return project_root() / "evidence"

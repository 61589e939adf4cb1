"""Second runs on the project itself, typed as a user types them: the same `--evidence-dir DIR`
(space form) once DIR exists, and `--plan PATH` for a plan copied outside the project.

pytest takes an existing value of a harness option for a test path while it picks its rootdir and
config file, before the harness's options are known; the session must still see every setting of
the project's config (pythonpath, addopts, markers, testpaths) as a first run does. Collection is
where a missing setting shows (the tests import their helpers through `pythonpath`), so each run
here collects the project's own stages and must collect exactly what the `--opt=VALUE` form does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_env import harness_env

ROOT = Path(__file__).resolve().parents[2]


def _collect(args: list[str], cwd: Path = ROOT) -> tuple[int, list[str], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args],
        cwd=cwd,
        env=harness_env(PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    return proc.returncode, [ln for ln in proc.stdout.splitlines() if "::" in ln], out


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """What `-m STAGE --evidence-dir=DIR` collects from the project's root with DIR not existing
    yet, as a first run (the `=` form is never taken for a test path): once per stage for the file."""
    collected: dict[str, list[str]] = {}

    def of(stage: str) -> list[str]:
        if stage not in collected:
            evidence = tmp_path_factory.mktemp("first") / "ev"
            rc, got, out = _collect(["-m", stage, f"--evidence-dir={evidence}"])
            assert rc == 0 and got, out[-3000:]
            collected[stage] = got
        return collected[stage]

    return of


def test_existing_evidence_dir_in_the_space_form_collects_as_the_first_run(tmp_path, first_run):
    """One stage stands for all: the rootdir and config are picked before any marker is read."""
    evidence = tmp_path / "ev"
    evidence.mkdir()  # what the first real run leaves behind
    rc, again, out = _collect(["-m", "preflight", "--evidence-dir", str(evidence)])
    assert rc == 0 and again == first_run("preflight"), out[-3000:]


def test_existing_evidence_dir_from_another_directory_collects_as_from_the_root(tmp_path, first_run):
    """From another directory the project is named as the test path; DIR exists from the first run."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    evidence = tmp_path / "ev"
    evidence.mkdir()  # a missing DIR is never taken for a test path: the existing one is the case
    rc, got, out = _collect([str(ROOT), "-m", "preflight", "--evidence-dir", str(evidence)], cwd=elsewhere)
    assert rc == 0 and got, out[-3000:]
    # node ids are relative to the rootdir, which must be the project's
    from_root = first_run("preflight")
    assert got == from_root, (got[:3], from_root[:3])


def test_plan_copied_outside_the_project_collects_as_the_project_plan(tmp_path):
    outside = tmp_path / "plans"
    outside.mkdir()
    plan = outside / "exp_e6b0965af3-diagnostic-r1.json"
    shutil.copy(ROOT / "plans" / plan.name, plan)
    shutil.copy(ROOT / "plans" / "exp_e6b0965af3.json", outside / "exp_e6b0965af3.json")
    shutil.copy(ROOT / "plans" / "exp_e6b0965af3.json.resolution.json", outside)
    rc, eq_form, out = _collect(["-m", "preflight", f"--plan={plan}"])
    assert rc == 0 and eq_form, out[-3000:]
    rc, space_form, out = _collect(["-m", "preflight", "--plan", str(plan)])
    assert rc == 0 and space_form == eq_form, out[-3000:]

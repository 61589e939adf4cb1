"""Shared by the integration tests: embedded servers for the tests whose behaviour does not depend
on having a server of their own (no faults, default profile, nothing read from server-wide counters
or logs): each starts once per session, when a test first asks for it, and is stopped (and checked
gone) at the end; tests that inject faults, need a profile, or count requests start their own. And
the README's commands, read from the README itself."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from child_pids import live_child_pids
from run_env import harness_env, is_run_variable

from dppo_harness.local_server.http import handlers
from dppo_harness.local_server.process import LocalServerProcess

README = Path(__file__).resolve().parents[2] / "README.md"
# The files that take minutes, longest first (CPU seconds each, measured alone:
# docs/benchmarks.md). `.ci/run` hands whole files to two workers in collection order (`--dist
# loadfile --no-loadscope-reorder`), each worker holding one file ahead; started first, none of
# them is left to run alone at the end.
LONGEST_FIRST = (
    "test_spindle_profile.py",
    "test_real_looking_service.py",
    "test_comparison_kill_resume.py",
    "test_comparison_resume.py",
    "test_launch_scope.py",
    "test_second_runs.py",
    "test_server_death.py",
    "test_diagnostic_overflow.py",
    "test_service_waits.py",
    "test_must_fire.py",
    "test_local_server_spindle.py",
    "test_local_server_faults.py",
    "test_optional_fields_local.py",
    "test_stop_leaves_nothing.py",
    "test_restoration_failures.py",
    "test_comparison_lost_arm.py",
    "test_engine_parity.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest integration files first (a stable sort: every other test keeps its place; the
    stage plugin's own sort, which runs after this one, is stable too)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _without_run_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The integration tests check the harness against servers they start themselves, never the
    service the launching shell names (tests/support/run_env.py)."""
    for name in [k for k in os.environ if is_run_variable(k)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@pytest.fixture
def short_unload_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process server's unload waits 1 s, not 10, for a request a fault holds forever: the
    unload still frees the model after its drain, and the tests that hold a request do not sleep
    through the server's 10 s at every release."""
    monkeypatch.setattr(handlers, "UNLOAD_DRAIN_S", 1.0)


def _shared(tmp_path_factory: pytest.TempPathFactory, name: str, model: str | None) -> Iterator[LocalServerProcess]:
    server = LocalServerProcess(run_dir=tmp_path_factory.mktemp(name), model=model, env=harness_env()).start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.alive() and server.pid not in live_child_pids()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory) -> Iterator[LocalServerProcess]:
    """The default, warm-started stand-in (what the stages train)."""
    yield from _shared(tmp_path_factory, "shared-server", None)


@pytest.fixture(scope="session")
def shared_random_server(tmp_path_factory) -> Iterator[LocalServerProcess]:
    """The small random-init preset: for protocol and plumbing checks that do not need the weights."""
    yield from _shared(tmp_path_factory, "shared-random-server", "tiny-qwen3-random")


def readme_command(heading: str, starts_with: str) -> str:
    """The command in the README's section `heading` whose first line starts with `starts_with`,
    its continuation lines joined, exactly as a user pastes it into bash."""
    text = README.read_text()
    marker = f"\n## {heading}\n"
    if marker not in text:
        raise LookupError(f"README.md has no section '## {heading}'")
    section = text.split(marker, 1)[1].split("\n## ", 1)[0]
    for block in section.split("```bash\n")[1:]:
        lines = block.split("```", 1)[0].splitlines()
        for i, line in enumerate(lines):
            if line.startswith(starts_with):
                parts = []
                for cont in lines[i:]:
                    parts.append(cont.strip().removesuffix("\\").strip())
                    if not cont.rstrip().endswith("\\"):
                        return " ".join(parts)
    raise LookupError(f"README.md section '## {heading}' has no command starting with {starts_with!r}")


@pytest.fixture(scope="session")
def readme() -> Callable[[str, str], str]:
    return readme_command

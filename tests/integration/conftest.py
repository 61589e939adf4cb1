"""Embedded servers shared by the integration tests whose behaviour does not depend on having a
server of their own (no faults, default profile, nothing read from server-wide counters or logs):
each starts once per session, when a test first asks for it, and is stopped (and checked gone) at
the end. Tests that inject faults, need a profile, or count requests start their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dppo_harness.local_server.process import LocalServerProcess, live_child_pids


def _shared(tmp_path_factory: pytest.TempPathFactory, name: str, model: str | None) -> Iterator[LocalServerProcess]:
    server = LocalServerProcess(run_dir=tmp_path_factory.mktemp(name), model=model).start()
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

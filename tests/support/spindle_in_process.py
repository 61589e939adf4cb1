"""The embedded server's spindle profile in the test process, for the integration tests that run the
harness as its own process against it and test what the harness does, not the server's process:
its command-line options are parsed as `python -m dppo_harness.local_server --profile spindle`
parses them, and the same app serves. Starting no server process saves its interpreter and torch
start-up (about 3 CPU-s per server on the CI machine, docs/benchmarks.md); a test of the server's
own exit or death starts a `LocalServerProcess` instead."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dppo_harness.local_server.cli import build_parser, checked
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.process import InProcessServer
from dppo_harness.local_server.profiles import make_profile


class SpindleInProcess:
    """`--profile spindle` with `server_args` (faults, capacity settings), its expected credentials
    read from `credentials`; the default warm-started stand-in, as a server process serves it."""

    def __init__(self, run_dir: Path, credentials: Mapping[str, str], *server_args: str) -> None:
        args = build_parser(None).parse_args(["--profile", "spindle", *server_args])
        _, faults, settings = checked(args)
        engine = Engine(run_dir, num_threads=args.threads)
        self._server = InProcessServer(engine, faults=faults, profile=make_profile("spindle", credentials, settings))

    def start(self) -> SpindleInProcess:
        self._server.start()
        return self

    @property
    def base_url(self) -> str:
        return self._server.base_url

    def stats(self) -> dict[str, Any]:
        """What GET /_harness/stats answers."""
        assert self._server.state is not None
        return self._server.state.stats()

    def alive(self) -> bool:
        thread = self._server._thread
        return thread is not None and thread.is_alive()

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> SpindleInProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The embedded server in the test process, started from the same command-line options as
`python -m dppo_harness.local_server` (parsed and checked by its own parser, the engine built as
it builds it, the same app), for the integration tests that test what the harness does against
the server, not the server's process. Starting no server process saves its interpreter and torch
start-up (about 3 CPU-s per server on the CI machine, docs/benchmarks.md); the tests of the
server's own exit and death start a `LocalServerProcess`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dppo_harness.local_server.cli import build_parser, checked
from dppo_harness.local_server.engine.engine import DEFAULT_PRESET, Engine
from dppo_harness.local_server.process import InProcessServer
from dppo_harness.local_server.profiles import make_profile


class ServerInProcess:
    """The server `server_args` ask for (`--profile`, `--model`, faults, capacity settings); the
    spindle profile reads its expected credentials from `credentials`, as the server process reads
    them from its environment."""

    def __init__(self, run_dir: Path, *server_args: str, credentials: Mapping[str, str] | None = None) -> None:
        args = build_parser(None).parse_args(list(server_args))
        _, faults, settings = checked(args)
        self.run_dir = Path(run_dir)
        engine = Engine(self.run_dir, args.model or DEFAULT_PRESET, num_threads=args.threads)
        profile = make_profile(args.profile, credentials or {}, settings)
        self._server = InProcessServer(engine, faults=faults, profile=profile)

    def start(self) -> ServerInProcess:
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

    def __enter__(self) -> ServerInProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

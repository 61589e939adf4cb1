"""The embedded server in the test process, started from the same command-line options as
`python -m dppo_harness.local_server` (parsed and checked by its own parser, the engine built as
it builds it, the same app), for the integration tests that test what the harness does against
the server, not the server's process. Starting no server process saves its interpreter and torch
start-up (about 3 CPU-s per server on the CI machine, docs/benchmarks.md); the tests of the
server's own exit and death start a `LocalServerProcess`."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from dppo_harness.local_server.cli import build_parser, checked
from dppo_harness.local_server.engine.engine import DEFAULT_PRESET, Engine
from dppo_harness.local_server.faults import FaultConfig, FaultInjector, HeaderRecorder
from dppo_harness.local_server.http.app import listening_socket, start_site
from dppo_harness.local_server.http.state import ServerState
from dppo_harness.local_server.profiles import Profile, make_profile


class InProcessServer:
    """The same app on a background event loop in this process, sharing `engine` with the caller.

    Tests use it to compare what crossed HTTP with the engine's own tensors
    (`engine_reads.get_parameter_grads(engine, server.state.models[training_client.model_id].engine_id)`).
    """

    def __init__(self, engine: Engine, faults: FaultConfig | None = None, profile: Profile | None = None) -> None:
        self.engine = engine
        self._faults = faults or FaultConfig()
        if self._faults.die_after is not None:  # it would end this process
            raise ValueError("--fault-die-after needs a server process (LocalServerProcess)")
        self._profile = profile or Profile()
        self.state: ServerState | None = None
        self.base_url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def start(self) -> InProcessServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-server-inprocess", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._setup(), self._loop).result()
        return self

    async def _setup(self) -> None:
        self.state = ServerState(
            self.engine,
            FaultInjector(self._faults),
            HeaderRecorder(self._faults.record_header_values),
            profile=self._profile,
        )
        sock = listening_socket("127.0.0.1", 0)
        self._runner = await start_site(self.state, sock)
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            if self._runner is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self._loop.close()
        if self.state is not None:
            self.state.shutdown()

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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

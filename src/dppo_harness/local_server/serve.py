"""The embedded server's running stack: the engine, the aiohttp app over it and the socket that
serves it.

`run_server` is the CLI's whole server; `start_site` serves an app for the in-process server too.

Importing this module loads torch, transformers, aiohttp and the SDK's types, so it is imported
late and once: by `__main__.main` after its OpenMP settings and argument checks, and by
`process.InProcessServer` when one starts (the pytest plugin imports process.py at start-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import time
from pathlib import Path

from aiohttp import web

from dppo_harness.local_server.engine.engine import DEFAULT_PRESET, Engine
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.faults import FaultConfig, FaultInjector, HeaderRecorder
from dppo_harness.local_server.http.app import SHUTDOWN_GRACE_S, build_app
from dppo_harness.local_server.http.state import ServerState
from dppo_harness.local_server.profiles import Profile

STATS_FILE = "server_stats.json"
log = logging.getLogger("dppo_harness.local_server")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` (port 0: a free one) and listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


async def start_site(state: ServerState, sock: socket.socket) -> web.AppRunner:
    """The app over `state`, serving on the listening `sock`; the runner's cleanup stops it."""
    # auto_decompress=False: request bodies reach the handlers as sent. aiohttp's own parser would
    # inflate a `Content-Encoding: zstd` body only with backports.zstd installed (400 otherwise);
    # forward_backward inflates SDK 0.25's zstd bodies itself (codecs.decode_fwdbwd_request).
    runner = web.AppRunner(
        build_app(state),
        access_log=None,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        auto_decompress=False,
    )
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


def _log_ready(engine: Engine, seconds: float, profile: Profile, run_dir: Path) -> None:
    log.info(
        "engine %s ready in %.1fs (warm-start cache hit: %s); profile %s; run dir %s",
        engine.model_name,
        seconds,
        engine.base_info.get("cache_hit"),
        profile.name,
        run_dir,
    )


async def _until_signalled() -> None:
    """Wait for SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def run_server(args: argparse.Namespace, faults: FaultConfig, run_dir: Path, profile: Profile) -> None:
    """Build the engine, serve it until SIGTERM/SIGINT, then write the stats file and shut down.
    The ready line goes to stdout once the socket accepts connections."""
    t0 = time.perf_counter()
    try:
        engine = await asyncio.to_thread(Engine, run_dir, args.model or DEFAULT_PRESET, num_threads=args.threads)
    except UserError as exc:  # an unknown --model
        raise SystemExit(str(exc)) from None
    state = ServerState(
        engine=engine,
        faults=FaultInjector(faults),
        headers=HeaderRecorder(faults.record_header_values),
        profile=profile,
        stats_path=run_dir / STATS_FILE,
    )
    sock = listening_socket(args.host, args.port)
    runner = await start_site(state, sock)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if sock.family == socket.AF_INET6 else args.host
    _log_ready(engine, time.perf_counter() - t0, profile, run_dir)
    print(f"listening on http://{host}:{port}", flush=True)
    await _until_signalled()
    (run_dir / STATS_FILE).write_text(json.dumps(state.stats(), indent=1))
    await runner.cleanup()
    state.shutdown()

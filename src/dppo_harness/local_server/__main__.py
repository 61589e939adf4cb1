"""CLI: `python -m dppo_harness.local_server --host 127.0.0.1 --port PORT [options]`.

Prints exactly one line `listening on http://127.0.0.1:PORT` on stdout once the engine is
loaded and the socket accepts connections; logs go to stderr (one line per request: method, path,
status, milliseconds). SIGTERM/SIGINT shut it down.

`--profile spindle` behaves like Spindle, Modal's Tinker-compatible service, as its source shows it
(modal-projects/spindle; docs/local-server.md "Spindle profile"): it reads TINKER_API_KEY,
MODAL_PROXY_TOKEN_ID and MODAL_PROXY_TOKEN_SECRET from its own environment (exit code 2, naming
the variable, if one is unset); Spindle checks X-API-Key, the research exchange's front door in
front of it checks Modal-Key / Modal-Secret.

The fault options rehearse what a shared service does and the SDK knows (docs/service.md): capacity
pauses as `paused_capacity` try_again polls (`--fault-queue-pause`, default profile; Spindle only
ever says `active`), a request that never completes (`--fault-never-complete`), a 429 at sample
submit for a while (`--fault-reject-for asample:429:S`), a trainer that dies (`--fault-model-lost`,
spindle profile).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from dppo_harness.local_server.cli import build_parser, checked
from dppo_harness.local_server.profiles import MissingCredential, make_profile

USAGE_EXIT_CODE = 2


PARENT_GONE_EXIT = 75


def exit_with_parent(pid: int, every_s: float = 0.5) -> threading.Thread:
    """A daemon thread that ends the process once `pid` is no longer its parent (reparented: the
    parent died). Started before the engine builds, so a harness killed during the build leaves no server."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(every_s)
        print(f"local server: parent process {pid} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(PARENT_GONE_EXIT)

    t = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> None:
    # Before torch (and its OpenMP runtime) loads: idle OpenMP threads sleep instead of spinning at
    # every barrier, which on a machine shared with the harness or other jobs burns the CPU time the
    # other thread is waiting for (docs/benchmarks.md: several times the CPU per update under load).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser(__doc__).parse_args(argv)
    if args.exit_with_parent is not None:
        exit_with_parent(args.exit_with_parent)
    args.host, faults, settings = checked(args)
    try:
        profile = make_profile(args.profile, os.environ, settings)
    except MissingCredential as exc:
        print(f"local server: {exc}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT_CODE)
    # The server's stack (torch, aiohttp, the engine, the app) loads once, here: after OMP_WAIT_POLICY
    # is set and the arguments are checked.
    from dppo_harness.local_server import serve

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("dppo_harness.local_server").info(
        "starting (pid %d, %d engine threads)", os.getpid(), args.threads
    )
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="dppo-local-server-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(serve.run_server(args, faults, run_dir, profile))
    sys.stdout.flush()
    sys.stderr.flush()
    # Engine worker threads cannot be interrupted mid-call; do not wait for them at exit.
    os._exit(0)


if __name__ == "__main__":
    main()

"""CLI: `python -m dppo_harness.local_server --host 127.0.0.1 --port PORT [options]` (docs/local-server.md).

One stdout line `listening on http://127.0.0.1:PORT` once the engine is loaded and the socket
accepts connections; logs on stderr; SIGTERM/SIGINT shut it down. `--profile spindle` reads
TINKER_API_KEY, MODAL_PROXY_TOKEN_ID and MODAL_PROXY_TOKEN_SECRET from its environment (exit code
2, naming the variable, if one is unset).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

# Nothing here imports torch, aiohttp or the engine at module level: the CLI refuses a bad argument
# in a blink, and torch loads only after `main` set its OpenMP settings.
from dppo_harness.local_server.faults import DEFAULT_VALUE_HEADERS, FAULT_OPTIONS, FaultConfig
from dppo_harness.local_server.profiles import (
    DEFAULT_SESSION_IDLE_TIMEOUT_S,
    DEFAULT_SWEEP_INTERVAL_S,
    DEFAULT_TRAINER_SLOTS,
    PROFILES,
    MissingCredential,
    SpindleSettings,
    make_profile,
)

USAGE_EXIT_CODE = 2
PARENT_GONE_EXIT = 75
PROG = "python -m dppo_harness.local_server"

# Spindle's capacity and sweep options (control_plane/service.py); None by default so that a use
# on the default profile is told apart.
SPINDLE_ONLY_OPTIONS = (
    ("cold_start_s", "--cold-start-s"),
    ("trainer_slots", "--trainer-slots"),
    ("sweep_interval_s", "--sweep-interval-s"),
)


def build_parser(description: str | None = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=description)
    p.add_argument("--host", default="127.0.0.1", help="loopback address only (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the ready line)")
    p.add_argument("--profile", choices=PROFILES, default="default", help="spindle: answer as Spindle does")
    p.add_argument("--model", default=None, help="tiny preset to serve (default: the engine's default)")
    p.add_argument("--run-dir", default=None, help="checkpoints and logs (default: a new temp dir)")
    p.add_argument("--exit-with-parent", type=int, metavar="PID", help="exit once PID is no longer the parent")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the engine (default 1)")
    g = p.add_argument_group("Spindle's capacity and sweep (--profile spindle only)")
    g.add_argument("--cold-start-s", type=float, metavar="N", help="the first creation pends N s (default 0)")
    g.add_argument(
        "--trainer-slots",
        type=int,
        metavar="K",
        help=f"LoRA slots of the trainer (default {DEFAULT_TRAINER_SLOTS}; 0: every creation waits forever)",
    )
    g.add_argument(
        "--sweep-interval-s",
        type=float,
        metavar="S",
        help=f"idle-session sweep interval (default {DEFAULT_SWEEP_INTERVAL_S:g}; idle after "
        f"{DEFAULT_SESSION_IDLE_TIMEOUT_S:g} s)",
    )
    g = p.add_argument_group("fault injection (counted; see GET /_harness/stats)")
    for option, metavar, _, text in FAULT_OPTIONS:
        g.add_argument(option, action="append", default=[], metavar=metavar, help=text)
    g.add_argument(
        "--fault-capacity-exhausted",
        type=int,
        default=0,
        metavar="N",
        help="the first N creations fail: 'engine refused work: trainer capacity exhausted'",
    )
    g.add_argument("--fault-die-after", type=int, default=None, metavar="K", help="exit (code 75) at API request K+1")
    g.add_argument(
        "--fault-retry-after-ms", type=int, default=None, metavar="MS", help="Retry-After-Ms on injected 429/503"
    )
    g.add_argument(
        "--record-header-values",
        default=",".join(DEFAULT_VALUE_HEADERS),
        metavar="NAMES",
        help="comma-separated header names whose values are recorded (never secrets)",
    )
    return p


def fault_config(args: argparse.Namespace) -> FaultConfig:
    repeated = {
        option.removeprefix("--fault-").replace("-", "_"): tuple(
            map(parse, getattr(args, option[2:].replace("-", "_")))
        )
        for option, _, parse, _ in FAULT_OPTIONS
    }
    return FaultConfig(
        **repeated,  # type: ignore[arg-type]
        capacity_exhausted=args.fault_capacity_exhausted,
        die_after=args.fault_die_after,
        retry_after_ms=args.fault_retry_after_ms,
        record_header_values=tuple(n.strip() for n in args.record_header_values.split(",") if n.strip()),
    )


def spindle_settings(args: argparse.Namespace) -> SpindleSettings:
    """The spindle options as settings (defaults filled in); ValueError naming a bad value."""
    given = {name: getattr(args, name) for name, _ in SPINDLE_ONLY_OPTIONS if getattr(args, name) is not None}
    return SpindleSettings(**given)


def check_profile_options(args: argparse.Namespace, faults: FaultConfig) -> str | None:
    """One line refusing an option the chosen profile cannot honour, else None. Spindle never sends a
    paused queue state, so `--fault-queue-pause` with one is refused under --profile spindle; the
    spindle capacity/sweep options and faults are refused on the default profile."""
    if args.profile == "spindle":
        paused = [p for p in faults.queue_pause if p.queue_state != "active"]
        if paused:
            return (
                f"--fault-queue-pause: Spindle never sends queue_state {paused[0].queue_state} (every pending poll is "
                f"'active' with no reason); under --profile spindle give STATE active, e.g. {paused[0].kind}:"
                f"{paused[0].number}:{'forever' if paused[0].seconds is None else f'{paused[0].seconds:g}'}:active"
            )
        return None
    used = [flag for name, flag in SPINDLE_ONLY_OPTIONS if getattr(args, name) is not None]
    if args.fault_model_lost:
        used.append("--fault-model-lost")
    if used:
        return f"{', '.join(used)}: only with --profile spindle (Spindle's capacity, sweep and trainer faults)"
    return None


def checked(args: argparse.Namespace) -> tuple[str, FaultConfig, SpindleSettings]:
    """The numeric loopback host, the faults and the spindle settings the arguments ask for;
    SystemExit with one line at the first bad one."""
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    try:
        faults = fault_config(args)
        refusal = check_profile_options(args, faults)
        if refusal is not None:
            raise SystemExit(refusal)
        return loopback_host(args.host), faults, spindle_settings(args)
    except ValueError as exc:  # FaultSpecError included
        raise SystemExit(str(exc)) from None


def loopback_host(host: str) -> str:
    """The numeric loopback address for `host`; anything else is refused."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise SystemExit(f"--host {host!r}: not an IP address; the local server binds loopback only") from None
    if not addr.is_loopback:
        raise SystemExit(f"--host {host!r}: not a loopback address; the local server binds loopback only")
    return str(addr)


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
    args = build_parser().parse_args(argv)
    if args.exit_with_parent is not None:
        exit_with_parent(args.exit_with_parent)
    args.host, faults, settings = checked(args)
    try:
        profile = make_profile(args.profile, os.environ, settings)
    except MissingCredential as exc:
        print(f"local server: {exc}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT_CODE)
    # The server's stack (torch, aiohttp, the engine, the app) loads once, here.
    from dppo_harness.local_server.http import app

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("dppo_harness.local_server").info(
        "starting (pid %d, %d engine threads)", os.getpid(), args.threads
    )
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="dppo-local-server-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(app.run_server(args, faults, run_dir, profile))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # engine worker threads cannot be interrupted mid-call; do not wait for them at exit

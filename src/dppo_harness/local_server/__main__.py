"""CLI: `python -m dppo_harness.local_server --host 127.0.0.1 --port PORT [options]`.

Prints exactly one line `listening on http://127.0.0.1:PORT` on stdout once the engine is
loaded and the socket accepts connections; logs go to stderr (one line per request: method, path,
status, milliseconds). SIGTERM/SIGINT shut it down.

`--profile spindle` behaves like the shared Spindle service: it reads TINKER_API_KEY,
MODAL_PROXY_TOKEN_ID and MODAL_PROXY_TOKEN_SECRET from its own environment (exit code 2, naming
the variable, if one is unset) and requires them as X-API-Key / Modal-Key / Modal-Secret.

The fault options rehearse what a shared service does and the SDK knows (docs/service.md): capacity
pauses as `paused_capacity` try_again polls (`--fault-queue-pause`), a request that never completes
(`--fault-never-complete`), a 429 at sample submit for a while (`--fault-reject-for asample:429:S`).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from dppo_harness.local_server.faults import (
    DEFAULT_VALUE_HEADERS,
    FaultConfig,
    FaultInjector,
    FaultSpecError,
    HeaderRecorder,
    parse_capacity_fail,
    parse_latency,
    parse_never_complete,
    parse_omit_field,
    parse_queue_pause,
    parse_reject_first,
    parse_reject_for,
    parse_reject_prob,
)
from dppo_harness.local_server.profiles import PROFILES, MissingCredential, Profile, make_profile

STATS_FILE = "server_stats.json"
USAGE_EXIT_CODE = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dppo_harness.local_server", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="loopback address only (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the ready line)")
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="default",
        help="spindle: require the Spindle credential headers and serve the plan's base model by name",
    )
    p.add_argument("--model", default=None, help="engine model name (default: the engine's default)")
    p.add_argument("--run-dir", default=None, help="checkpoints and logs (default: a new temp dir)")
    p.add_argument(
        "--exit-with-parent",
        type=int,
        default=None,
        metavar="PID",
        help="exit as soon as this process is no longer the server's parent (the harness that "
        "started it died, even by SIGKILL): no orphan server",
    )
    p.add_argument(
        "--sampler-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="sampler precision (default: float32 for the presets, the checkpoint dtype for "
        "--model-path); bfloat16 rehearses trainer/sampler mismatch",
    )
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    p.add_argument("--sample-workers", type=int, default=64, help="threads running sample requests")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the engine (default 2)")
    h = p.add_argument_group("Hugging Face checkpoint backend (instead of the tiny presets)")
    h.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="local Qwen3 / Qwen3.5 checkpoint (config.json + weights); nothing is downloaded",
    )
    h.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="with --model-path")
    h.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="with --model-path (default: bfloat16 on CUDA, float32 on CPU)",
    )
    h.add_argument(
        "--served-name", default=None, help="with --model-path: name to serve it under (default: the checkpoint's name)"
    )
    h.add_argument(
        "--linear-attention",
        choices=("auto", "torch"),
        default="auto",
        help="with --model-path: Qwen3.5's linear-attention layers run the kernels transformers picked "
        "(auto) or its torch fallback (torch)",
    )
    h.add_argument(
        "--decode-mode",
        choices=("auto", "dynamic", "static", "graph"),
        default="auto",
        help="sampler decode step: auto = the CUDA graph of the whole step on CUDA, eager on CPU",
    )
    f = p.add_argument_group("fault injection (seeded and counted; see GET /_harness/stats)")
    f.add_argument("--fault-seed", type=int, default=0)
    f.add_argument(
        "--fault-reject-first",
        action="append",
        default=[],
        metavar="KIND:STATUS:N",
        help="answer the first N requests of KIND ('*' = any) with HTTP STATUS (429|503)",
    )
    f.add_argument(
        "--fault-reject-prob",
        action="append",
        default=[],
        metavar="KIND:STATUS:P",
        help="answer each request of KIND with HTTP STATUS with probability P",
    )
    f.add_argument(
        "--fault-reject-for",
        action="append",
        default=[],
        metavar="KIND:STATUS:SECONDS",
        help="answer every request of KIND with HTTP STATUS for SECONDS from the first one (asample:429:S "
        "is a sample submit the SDK retries without limit)",
    )
    f.add_argument(
        "--fault-queue-pause",
        action="append",
        default=[],
        metavar="KIND:N:SECONDS[:STATE][:moving]",
        help="hold the N-th request of KIND (create_model, forward_backward, optim_step, save_weights, "
        "asample, ...) for SECONDS ('forever': never) before it runs; its polls answer 408 try_again "
        "with queue_state STATE (paused_capacity, default, or paused_rate_limit) and a reason; "
        "'moving': the reason names a queue position that changes at every poll",
    )
    f.add_argument(
        "--fault-never-complete",
        action="append",
        default=[],
        metavar="KIND:N",
        help="accept the N-th request of KIND and never complete it (its polls say queue_state active)",
    )
    f.add_argument(
        "--fault-sample-use-retrieve-futures",
        action="store_true",
        help="client config sets sample_use_retrieve_futures: samples wait on the SDK's session poller "
        "(POST /api/v1/retrieve_futures), a path that sends no queue state",
    )
    f.add_argument(
        "--fault-capacity-exhausted",
        type=int,
        default=0,
        metavar="N",
        help="fail the first N create_model requests with 'trainer capacity exhausted'",
    )
    f.add_argument(
        "--fault-capacity-mode",
        choices=("future", "http"),
        default="future",
        help="future: failed future (SDK raises RequestFailedError, category server); "
        "http: HTTP 503 (the SDK's own retries absorb it)",
    )
    f.add_argument(
        "--fault-capacity-fail",
        action="append",
        default=[],
        metavar="KIND:N1[,N2...]",
        help="fail the N-th ordered training request of KIND (forward_backward, optim_step, ...; "
        "counted when it executes) with 'trainer capacity exhausted' before it runs",
    )
    f.add_argument(
        "--fault-latency-ms",
        action="append",
        default=[],
        metavar="KIND:MS",
        help="add MS milliseconds (non-blocking) before handling each request of KIND",
    )
    f.add_argument(
        "--fault-die-after",
        type=int,
        default=None,
        metavar="K",
        help="exit (code 75) when API request K+1 arrives (healthz not counted)",
    )
    f.add_argument(
        "--fault-retry-after-ms",
        type=int,
        default=None,
        metavar="MS",
        help="send Retry-After-Ms with injected 429/503 (the SDK honours it)",
    )
    f.add_argument(
        "--fault-omit-field",
        action="append",
        default=[],
        metavar="KIND.FIELD[:N1,N2...]",
        help="leave an optional response field out (every response of KIND, or the N-th ones), "
        "e.g. load_weights.path or get_info.model_data.model_name",
    )
    f.add_argument(
        "--record-header-values",
        default=",".join(DEFAULT_VALUE_HEADERS),
        metavar="NAMES",
        help="comma-separated header names whose values are recorded (never secrets)",
    )
    return p.parse_args(argv)


def fault_config(args: argparse.Namespace) -> FaultConfig:
    return FaultConfig(
        seed=args.fault_seed,
        reject_first=tuple(parse_reject_first(s) for s in args.fault_reject_first),
        reject_prob=tuple(parse_reject_prob(s) for s in args.fault_reject_prob),
        capacity_exhausted=args.fault_capacity_exhausted,
        capacity_mode=args.fault_capacity_mode,
        capacity_fail=tuple(parse_capacity_fail(s) for s in args.fault_capacity_fail),
        latency_ms=tuple(parse_latency(s) for s in args.fault_latency_ms),
        queue_pause=tuple(parse_queue_pause(s) for s in args.fault_queue_pause),
        never_complete=tuple(parse_never_complete(s) for s in args.fault_never_complete),
        reject_for=tuple(parse_reject_for(s) for s in args.fault_reject_for),
        die_after=args.fault_die_after,
        retry_after_ms=args.fault_retry_after_ms,
        omit_fields=tuple(parse_omit_field(s) for s in args.fault_omit_field),
        record_header_values=tuple(n.strip() for n in args.record_header_values.split(",") if n.strip()),
        sample_use_retrieve_futures=args.fault_sample_use_retrieve_futures,
    )


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


def check_model_path_args(args: argparse.Namespace) -> None:
    """--model-path problems exit with one line before anything heavy is imported or loaded."""
    if not args.model_path:
        if args.served_name or args.dtype or args.linear_attention != "auto":
            raise SystemExit("--served-name, --dtype and --linear-attention need --model-path")
        return
    if args.model:
        raise SystemExit("--model (a tiny preset) and --model-path are exclusive")
    # torch loads here, after main() set OMP_WAIT_POLICY (and only for a --model-path)
    from dppo_harness.local_server.engine.hf_model import CheckpointError, check_checkpoint_dir, resolve_device

    try:
        check_checkpoint_dir(args.model_path)
        resolve_device(args.device)
    except CheckpointError as exc:
        raise SystemExit(str(exc)) from None


async def serve(args: argparse.Namespace, faults: FaultConfig, run_dir: Path, profile: Profile) -> None:
    # The server's stack loads once the arguments are checked; torch after main() set OMP_WAIT_POLICY.
    from aiohttp import web  # after the arguments are checked

    from dppo_harness.local_server.engine.engine import Engine  # torch: after OMP_WAIT_POLICY is set
    from dppo_harness.local_server.engine.hf_model import CheckpointError, kernel_summary  # torch, likewise
    from dppo_harness.local_server.http.app import SHUTDOWN_GRACE_S, ServerState, build_app  # the app, likewise

    t0 = time.perf_counter()
    engine_kwargs = {
        "sampler_dtype": args.sampler_dtype,
        "seed": args.seed,
        "num_threads": args.threads,
        "decode_mode": args.decode_mode,
    }
    if args.model:
        engine_kwargs["model_name"] = args.model
    if args.model_path:
        engine_kwargs.update(
            model_path=args.model_path,
            device=args.device,
            dtype=args.dtype,
            served_name=args.served_name,
            linear_attention=args.linear_attention,
        )
    try:
        engine = await asyncio.to_thread(Engine, run_dir, **engine_kwargs)
    except CheckpointError as exc:
        raise SystemExit(str(exc)) from None
    state = ServerState(
        engine=engine,
        faults=FaultInjector(faults),
        headers=HeaderRecorder(faults.record_header_values),
        sample_workers=args.sample_workers,
        profile=profile,
        stats_path=run_dir / STATS_FILE,
    )
    runner = web.AppRunner(build_app(state), access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(512)
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    base_info = getattr(engine, "base_info", {}) or {}
    logging.getLogger("dppo_harness.local_server").info(
        "engine %s ready in %.1fs (warm-start cache hit: %s); profile %s; run dir %s",
        getattr(engine, "model_name", "?"),
        time.perf_counter() - t0,
        base_info.get("cache_hit"),
        profile.name,
        run_dir,
    )
    if getattr(engine, "kernels", None):
        logging.getLogger("dppo_harness.local_server").info("kernels: %s", kernel_summary(engine.kernels))
    print(f"listening on http://{host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    (run_dir / STATS_FILE).write_text(json.dumps(state.stats(), indent=1))
    await runner.cleanup()
    state.shutdown()


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
    args = parse_args(argv)
    if args.exit_with_parent is not None:
        exit_with_parent(args.exit_with_parent)
    args.host = loopback_host(args.host)
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    check_model_path_args(args)
    try:
        faults = fault_config(args)
    except FaultSpecError as exc:
        raise SystemExit(str(exc)) from None
    try:
        profile = make_profile(args.profile, os.environ)
    except MissingCredential as exc:
        print(f"local server: {exc}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT_CODE)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("dppo_harness.local_server").info(
        "starting (pid %d, %d engine threads)", os.getpid(), args.threads
    )
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="dppo-local-server-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(serve(args, faults, run_dir, profile))
    sys.stdout.flush()
    sys.stderr.flush()
    # Engine worker threads cannot be interrupted mid-call; do not wait for them at exit.
    os._exit(0)


if __name__ == "__main__":
    main()

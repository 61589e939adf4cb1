"""The embedded server's command line: its argument parser, built one option group at a time, and
the checks of its values that need no heavy import.

Nothing here imports torch, aiohttp or the engine: the CLI refuses a bad argument in a blink, and
torch loads only after `__main__.main` set its OpenMP settings.
"""

from __future__ import annotations

import argparse
import ipaddress

from dppo_harness.local_server.faults import (
    DEFAULT_VALUE_HEADERS,
    FaultConfig,
    parse_capacity_fail,
    parse_latency,
    parse_model_lost,
    parse_never_complete,
    parse_omit_field,
    parse_queue_pause,
    parse_reject_first,
    parse_reject_for,
)
from dppo_harness.local_server.profiles import (
    DEFAULT_SESSION_IDLE_TIMEOUT_S,
    DEFAULT_SWEEP_INTERVAL_S,
    DEFAULT_TRAINER_SLOTS,
    PROFILES,
    SpindleSettings,
)

PROG = "python -m dppo_harness.local_server"


def build_parser(description: str | None) -> argparse.ArgumentParser:
    """The server's parser: the general options, then Spindle's and the faults' groups (in this
    order in `--help`)."""
    p = argparse.ArgumentParser(prog=PROG, description=description)
    _add_server_options(p)
    _add_spindle_options(p.add_argument_group("Spindle's capacity and sweep (--profile spindle only)"))
    faults = p.add_argument_group("fault injection (counted; see GET /_harness/stats)")
    _add_rejection_faults(faults)
    _add_held_request_faults(faults)
    _add_capacity_faults(faults)
    _add_timing_faults(faults)
    _add_response_faults(faults)
    return p


def _add_server_options(p: argparse.ArgumentParser) -> None:
    """Where it listens, what it serves and how many threads the engine runs."""
    p.add_argument("--host", default="127.0.0.1", help="loopback address only (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the ready line)")
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="default",
        help="spindle: behave like Spindle, Modal's Tinker-compatible service, as its source shows it "
        "(X-API-Key checked by Spindle, Modal-Key/Modal-Secret by the research exchange's front door; "
        "the plan's base model by name; Spindle's routes, errors and futures; docs/local-server.md)",
    )
    p.add_argument("--model", default=None, help="tiny preset to serve (default: the engine's default)")
    p.add_argument("--run-dir", default=None, help="checkpoints and logs (default: a new temp dir)")
    p.add_argument(
        "--exit-with-parent",
        type=int,
        default=None,
        metavar="PID",
        help="exit as soon as this process is no longer the server's parent (the harness that "
        "started it died, even by SIGKILL): no orphan server",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the engine (default 2)")


def _add_spindle_options(g: argparse._ArgumentGroup) -> None:
    """A trainer that starts cold, its LoRA slots, and the idle-session sweep (Spindle's
    control_plane/service.py); refused without --profile spindle. Defaults are None here so that
    an explicit use on the default profile is told apart."""
    g.add_argument(
        "--cold-start-s",
        type=float,
        default=None,
        metavar="N",
        help="the first model creation (create_model, or load_weights creating from a checkpoint) stays "
        "pending N seconds before it runs, like a trainer starting cold; its polls say queue_state "
        "active, no reason (default 0)",
    )
    g.add_argument(
        "--trainer-slots",
        type=int,
        default=None,
        metavar="K",
        help=f"LoRA slots of the one trainer (Spindle's max_lora_slots, default {DEFAULT_TRAINER_SLOTS}): a "
        "creation stays pending (active, no reason) while K models hold slots; unload_model or the idle "
        "sweep frees one at once; 0: every creation stays pending forever",
    )
    g.add_argument(
        "--sweep-interval-s",
        type=float,
        default=None,
        metavar="S",
        help=f"how often the idle sweep runs: a session with no heartbeat (or other request) for "
        f"{DEFAULT_SESSION_IDLE_TIMEOUT_S:g} s is reclaimed with its models, their slots freed "
        f"(default {DEFAULT_SWEEP_INTERVAL_S:g})",
    )
    g.add_argument(
        "--fault-model-lost",
        action="append",
        default=[],
        metavar="KIND:N",
        help="at the N-th request of KIND this server receives (forward_backward, forward, optim_step, "
        "save_weights, load_weights, save_weights_for_sampler, '*'), the trainer of the model it was sent "
        "to is gone: every submit on that model "
        "answers 410 model_lost and its pending futures fail with 'engine terminated before producing a result'",
    )
    g.add_argument(
        "--fault-trainer-full-refuse",
        action="store_true",
        default=False,
        help="a creation that would wait for a free slot fails instead with 'engine refused work: trainer "
        "capacity exhausted' (category server), as Spindle does with autoscaling at its maximum",
    )


SPINDLE_ONLY_OPTIONS = (
    ("cold_start_s", "--cold-start-s"),
    ("trainer_slots", "--trainer-slots"),
    ("sweep_interval_s", "--sweep-interval-s"),
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
    if args.fault_trainer_full_refuse:
        used.append("--fault-trainer-full-refuse")
    if used:
        return f"{', '.join(used)}: only with --profile spindle (Spindle's capacity, sweep and trainer faults)"
    return None


def _add_rejection_faults(f: argparse._ArgumentGroup) -> None:
    """HTTP rejections (429/503 and the other statuses a service answers)."""
    f.add_argument(
        "--fault-reject-first",
        action="append",
        default=[],
        metavar="KIND:STATUS:N",
        help="answer the first N requests of KIND ('*' = any) with HTTP STATUS (429|503); under --profile "
        "spindle in Spindle's shape (429: {error: saturated, message: 'engine refused work: operation buffer full'})",
    )
    f.add_argument(
        "--fault-reject-for",
        action="append",
        default=[],
        metavar="KIND:STATUS:SECONDS",
        help="answer every request of KIND with HTTP STATUS for SECONDS from the first one (asample:429:S "
        "is a sample submit the SDK retries without limit)",
    )


def _add_held_request_faults(f: argparse._ArgumentGroup) -> None:
    """Accepted requests whose futures stay pending: a paused queue and a request that never
    completes."""
    f.add_argument(
        "--fault-queue-pause",
        action="append",
        default=[],
        metavar="KIND:N:SECONDS[:STATE][:moving]",
        help="hold the N-th request of KIND (create_model, forward_backward, optim_step, save_weights, "
        "asample, ...) for SECONDS ('forever': never) before it runs; its polls answer 408 try_again "
        "with queue_state STATE (paused_capacity, default, or paused_rate_limit) and a reason, or STATE "
        "active with no reason (the only form --profile spindle takes: Spindle never sends a paused "
        "state); 'moving': the reason names a queue position that changes at every poll",
    )
    f.add_argument(
        "--fault-never-complete",
        action="append",
        default=[],
        metavar="KIND:N",
        help="accept the N-th request of KIND and never complete it (its polls say queue_state active)",
    )


def _add_capacity_faults(f: argparse._ArgumentGroup) -> None:
    """'trainer capacity exhausted' at model creation or on ordered training requests."""
    f.add_argument(
        "--fault-capacity-exhausted",
        type=int,
        default=0,
        metavar="N",
        help="fail the first N create_model futures with 'trainer capacity exhausted' (the SDK raises "
        "RequestFailedError, category server)",
    )
    f.add_argument(
        "--fault-capacity-fail",
        action="append",
        default=[],
        metavar="KIND:N1[,N2...]",
        help="fail the N-th ordered training request of KIND (forward_backward, optim_step, ...; "
        "counted when it executes) with 'trainer capacity exhausted' before it runs",
    )


def _add_timing_faults(f: argparse._ArgumentGroup) -> None:
    """Added latency, the server's death after K requests, and the retry delay it asks for."""
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


def _add_response_faults(f: argparse._ArgumentGroup) -> None:
    """Optional response fields left out, and which request headers are recorded."""
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


def fault_config(args: argparse.Namespace) -> FaultConfig:
    return FaultConfig(
        reject_first=tuple(parse_reject_first(s) for s in args.fault_reject_first),
        capacity_exhausted=args.fault_capacity_exhausted,
        capacity_fail=tuple(parse_capacity_fail(s) for s in args.fault_capacity_fail),
        latency_ms=tuple(parse_latency(s) for s in args.fault_latency_ms),
        queue_pause=tuple(parse_queue_pause(s) for s in args.fault_queue_pause),
        never_complete=tuple(parse_never_complete(s) for s in args.fault_never_complete),
        reject_for=tuple(parse_reject_for(s) for s in args.fault_reject_for),
        die_after=args.fault_die_after,
        retry_after_ms=args.fault_retry_after_ms,
        omit_fields=tuple(parse_omit_field(s) for s in args.fault_omit_field),
        model_lost=tuple(parse_model_lost(s) for s in args.fault_model_lost),
        trainer_full_refuse=args.fault_trainer_full_refuse,
        record_header_values=tuple(n.strip() for n in args.record_header_values.split(",") if n.strip()),
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

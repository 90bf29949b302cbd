"""`prism demo`: its flags, checked here so that an out-of-range value is a usage error rather than clamped."""

from __future__ import annotations

import argparse
import sys

from ._run import DEFAULT_DURATION_S, DEFAULT_LOAD, DEFAULT_NODES, DEFAULT_REQUESTS, Options, run
from ._window import BATCH_WINDOWS, DEFAULT_BATCH_WINDOW


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="a brain, agents, emulated engines and a router on loopback, replaying a trace, live",
        description="Start a brain, one emulated inference engine and one agent per node, and a router; replay "
        "the Mooncake conversation trace (time-compressed, requests shrunk) through the router with a live view; "
        "kill one node half-way; print a summary. Bounded to two minutes; pinned to --cpus CPUs.",
    )
    p.add_argument(
        "--requests", type=int, default=DEFAULT_REQUESTS, help=f"trace requests to replay ({DEFAULT_REQUESTS})"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_S,
        help=f"seconds the replay lasts, 5..90 ({DEFAULT_DURATION_S:g})",
    )
    p.add_argument(
        "--load",
        type=float,
        default=DEFAULT_LOAD,
        help=f"offered prefill load over the prefill capacity, sets the engines' time_scale ({DEFAULT_LOAD:g})",
    )
    p.add_argument(
        "--nodes",
        default=",".join(DEFAULT_NODES),
        help=f"GPU class of each node, comma-separated ({','.join(DEFAULT_NODES)})",
    )
    p.add_argument(
        "--batch-window",
        choices=BATCH_WINDOWS,
        default=DEFAULT_BATCH_WINDOW,
        help="how every engine admits requests into its batch: through the adaptive window, after a fixed 200 ms "
        f"window, or on arrival ({DEFAULT_BATCH_WINDOW})",
    )
    p.add_argument("--no-kill", action="store_true", help="do not kill a node half-way")
    p.add_argument("--no-ebpf", action="store_true", help="run the agents without the eBPF probe")
    p.add_argument("--cpus", type=int, default=2, help="pin the demo and its processes to this many CPUs, 0 = off (2)")
    p.add_argument("--plain", action="store_true", help="line output even on a terminal")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs after a clean run")
    p.set_defaults(func=_run)


def options(args: argparse.Namespace) -> Options:
    """The demo's options from its parsed flags; ValueError names a flag out of range."""
    if args.requests < 2:
        raise ValueError("--requests must be at least 2")
    if not 0 < args.load <= 2:
        raise ValueError("--load must be in (0, 2]")
    if not 5 <= args.duration <= 90:  # the demo is bounded to two minutes of wall time
        raise ValueError(f"--duration must be within 5..90 seconds, got {args.duration:g}")
    return Options(
        requests=args.requests,
        duration_s=args.duration,
        load=args.load,
        gpus=tuple(g.strip().lower() for g in args.nodes.split(",") if g.strip()),
        kill=not args.no_kill,
        ebpf=not args.no_ebpf,
        cpus=args.cpus,
        live=False if args.plain else None,
        keep_logs=args.keep_logs,
        batch_window=args.batch_window,
    )


def _run(args: argparse.Namespace) -> int:
    try:
        chosen = options(args)
    except ValueError as exc:
        print(f"prism demo: {exc}", file=sys.stderr)
        return 2
    return run(chosen)

"""`prism agent`: run the node agent, print its BPF program, or check what this host supports."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from prismlb.service import setup_logging, stop_on_signals
from prismlb.wire import ConfigError

from ._agent import Agent
from ._config import SETTINGS, resolve_config
from ._conntrack import ConnectionTracer
from ._ebpf import check

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the `agent` subcommand: a flag for each of the agent's settings (`SETTINGS`), then its own
    options."""
    parser = subparsers.add_parser(
        "agent",
        help="report this node's vector to the brain",
        description="Sample this node (eBPF connection tracing, CPU, memory), join OTLP spans to connections, "
        "and push a node vector to the brain every period. A flag beats its environment variable, which beats "
        "the TOML file (--config), which beats the default.",
    )
    SETTINGS.add_arguments(parser)
    parser.add_argument("--log-level", type=str.upper, choices=_LOG_LEVELS, help="log level (default: INFO)")
    parser.add_argument("--print-bpf", action="store_true", help="print the BPF program and exit")
    parser.add_argument("--check", action="store_true", help="print what works on this host and exit")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.print_bpf:
        print(ConnectionTracer.program_text(), end="")
        return 0
    if args.check:
        rows = check()
        width = max(len(name) for name, _ok, _detail in rows)
        for name, ok, detail in rows:
            print(f"{'ok' if ok else 'no':<3} {name:<{width}} {detail}")
        return 0
    try:
        config = resolve_config(args, os.environ)
    except ConfigError as exc:  # a setting refused: a usage error
        print(f"prism agent: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level or "INFO")
    stop = threading.Event()
    stop_on_signals(stop)
    try:
        Agent(config).run(stop)
    except ConfigError as exc:  # the agent could not start: a port taken, an OTLP upstream it cannot use
        print(f"prism agent: {exc}", file=sys.stderr)
        return 1
    return 0

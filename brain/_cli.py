"""`prism brain`: run the cluster service."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from prismlb.service import setup_logging, stop_on_signals
from prismlb.wire import ConfigError

from ._config import SETTINGS, resolve_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `brain` subcommand: a flag for each of the brain's settings (`SETTINGS`), and its log level."""
    p = subparsers.add_parser(
        "brain",
        help="run the brain: ingest node vectors, publish routing tables",
        description="Run the brain: ingest the agents' node vectors and KV events, predict each node's tail latency, "
        "publish weighted routing tables, the KV stream and the routers' shared load. A flag beats its environment "
        "variable, which beats the default.",
    )
    SETTINGS.add_arguments(p)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        config = resolve_config(args, os.environ)
    except ConfigError as exc:
        print(f"prism brain: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
    stop = threading.Event()
    stop_on_signals(stop)
    from ._brain import Brain  # torch loads here, not for every `prism` command

    Brain(config).run(stop)
    return 0

"""`prism brain`: run the cluster service."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from prismlb.wire import ConfigError, setup_logging, stop_on_signals

from ._config import resolve_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "brain",
        help="run the brain: ingest node vectors, publish routing tables",
        description="Run the brain: ingest the agents' node vectors and KV events, predict each node's tail latency, "
        "publish weighted routing tables, the KV stream and the routers' shared load.",
    )
    p.add_argument("--ingest", help="bind address for node vectors (env PRISM_BRAIN_INGEST; tcp://127.0.0.1:5555)")
    p.add_argument("--updates", help="bind address for table updates (env PRISM_BRAIN_UPDATES; tcp://127.0.0.1:5556)")
    p.add_argument(
        "--snapshot", help="bind address for table snapshots (env PRISM_BRAIN_SNAPSHOT; tcp://127.0.0.1:5557)"
    )
    p.add_argument("--stale-periods", help="missed periods before a node is dropped (3)")
    p.add_argument("--heartbeat-s", help="seconds between heartbeats (1)")
    p.add_argument("--state-dir", help="folder for the persisted epoch (env PRISM_BRAIN_STATE_DIR)")
    p.add_argument("--curve-secret", help="brain's CURVE secret key file (env PRISM_CURVE_SECRET)")
    p.add_argument("--curve-clients", help="folder of authorised agent public keys (env PRISM_CURVE_CLIENTS)")
    p.add_argument(
        "--curve-routers", help="folder of authorised router public keys, needed with CURVE (env PRISM_CURVE_ROUTERS)"
    )
    p.add_argument(
        "--allow-plaintext",
        action="store_true",
        default=None,
        help="CURVE off on a non-loopback bind without the warning (env PRISM_BRAIN_ALLOW_PLAINTEXT=1)",
    )
    p.add_argument("--metrics-port", help="Prometheus /metrics port, 0 = off (env PRISM_BRAIN_METRICS_PORT)")
    p.add_argument("--metrics-addr", help="address for /metrics (env PRISM_BRAIN_METRICS_ADDR; 0.0.0.0)")
    p.add_argument(
        "--admin-port", help="admin API port for prism ctl / top, 0 = off (env PRISM_BRAIN_ADMIN_PORT; 9470)"
    )
    p.add_argument(
        "--admin-addr", help="admin API address; non-loopback needs a token (env PRISM_BRAIN_ADMIN_ADDR; 127.0.0.1)"
    )
    p.add_argument(
        "--admin-token-file",
        help="file (mode 600) with the admin bearer token every request then needs (env PRISM_BRAIN_ADMIN_TOKEN_FILE)",
    )
    p.add_argument("--admin-public-reads", action="store_true", help="with a token file: GET requests need no token")
    p.add_argument(
        "--admin-insecure", action="store_true", help="without a token file: allow drain/experiment changes on loopback"
    )
    p.add_argument(
        "--admin-allowed-hosts",
        help="extra Host names the admin API answers, comma-separated (env PRISM_BRAIN_ADMIN_ALLOWED_HOSTS)",
    )
    p.add_argument("--scale-hook", help="command or http(s):// webhook run on scale-up (env PRISM_SCALE_HOOK)")
    p.add_argument("--train-budget-s", help="CPU seconds of predictor training per 5 s (0.5; 0 = no training)")
    p.add_argument(
        "--ingest-workers", help="processes decoding node vectors for the brain, for large fleets (0; not with CURVE)"
    )
    p.add_argument("--brain-id", help="this brain's name in tables (env PRISM_BRAIN_ID; host name/updates endpoint)")
    p.add_argument(
        "--priority",
        help="routers follow the live brain of highest priority, -1000..1000 (env PRISM_BRAIN_PRIORITY; 0)",
    )
    p.add_argument(
        "--holddown-s",
        help="longest wait for the nodes the last run knew before the first table (env PRISM_BRAIN_HOLDDOWN_S; 10)",
    )
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

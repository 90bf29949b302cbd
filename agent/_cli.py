"""`prism agent`: run the node agent, print its BPF program, or check what this host supports."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from prismlb.wire import ConfigError, setup_logging, stop_on_signals

from ._agent import Agent
from ._config import DEFAULT_BRAIN, DEFAULT_METRICS_ADDR, DEFAULT_PERIOD_S, resolve_config
from ._conntrack import ConnectionTracer
from ._ebpf import check

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the `agent` subcommand; every setting flag defaults to None so PRISM_* variables apply."""
    parser = subparsers.add_parser(
        "agent",
        help="report this node's vector to the brain",
        description="Sample this node (eBPF connection tracing, CPU, memory), join OTLP spans to connections, "
        "and push a node vector to the brain every period. A flag beats its environment variable, which beats "
        "the default.",
    )
    parser.add_argument("--node-id", help="node id (PRISM_NODE_ID; default: hostname)")
    parser.add_argument("--host", help="host name reported (default: hostname)")
    parser.add_argument(
        "--endpoint", help="inference server URL this node serves (PRISM_ENDPOINT; default: http://HOSTNAME:8000)"
    )
    parser.add_argument(
        "--brain",
        help=f"brain ingest endpoint; several, comma-separated, for an HA group (PRISM_BRAIN_INGEST; {DEFAULT_BRAIN})",
    )
    parser.add_argument("--zone", help="zone (PRISM_ZONE; default: none)")
    parser.add_argument(
        "--label", action="append", metavar="KEY=VALUE", help="a label, repeatable (PRISM_LABELS=k=v,k=v)"
    )
    parser.add_argument(
        "--period",
        type=float,
        metavar="SECONDS",
        help=f"reporting period (PRISM_PERIOD_S; default: {DEFAULT_PERIOD_S})",
    )
    parser.add_argument(
        "--no-ebpf",
        dest="ebpf",
        action="store_false",
        default=None,
        help="do not load the eBPF program (no connection tracing, no connect() count, no TCP health)",
    )
    parser.add_argument("--curve-secret", metavar="FILE", help="our CURVE secret key file (PRISM_CURVE_SECRET)")
    parser.add_argument("--brain-public", metavar="FILE", help="the brain's CURVE public key file (PRISM_BRAIN_PUBLIC)")
    parser.add_argument(
        "--metrics-port", type=int, help="port for Prometheus /metrics (PRISM_AGENT_METRICS_PORT; default: 0, off)"
    )
    parser.add_argument("--metrics-addr", help=f"address for /metrics (default: {DEFAULT_METRICS_ADDR})")
    parser.add_argument("--otlp-host", help="address the OTLP receiver listens on (PRISM_OTLP_HOST; 127.0.0.1)")
    parser.add_argument("--otlp-grpc-port", help="OTLP/gRPC port, 0 = off (PRISM_OTLP_GRPC_PORT; 4317)")
    parser.add_argument("--otlp-http-port", help="OTLP/HTTP port, 0 = off (PRISM_OTLP_HTTP_PORT; 4318)")
    parser.add_argument(
        "--trace-port", action="append", help="trace only connections on this port, repeatable (PRISM_TRACE_PORTS)"
    )
    parser.add_argument(
        "--trace-pid", action="append", help="trace only connections of this pid, repeatable (PRISM_TRACE_PIDS)"
    )
    parser.add_argument("--join-delay", help="seconds spans wait for kernel events before the join (0.25)")
    parser.add_argument("--engine-url", help="the inference engine's Prometheus /metrics URL (PRISM_ENGINE_URL)")
    parser.add_argument("--kv-events", help="the engine's KV-event ZeroMQ publisher, tcp://HOST:PORT (PRISM_KV_EVENTS)")
    parser.add_argument("--kv-replay", help="the engine's KV-event replay endpoint (PRISM_KV_REPLAY)")
    parser.add_argument(
        "--kv-dp-ranks",
        help="the engine's data-parallel ranks on this node; rank r publishes on the --kv-events (and --kv-replay) "
        "port + r (1; PRISM_KV_DP_RANKS)",
    )
    parser.add_argument(
        "--kv-full-every",
        help="seconds between sends of the node's whole KV block set to the brain (60; PRISM_KV_FULL_EVERY_S)",
    )
    parser.add_argument(
        "--config", help="TOML settings file; flags and PRISM_* variables override it (PRISM_AGENT_CONFIG)"
    )
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

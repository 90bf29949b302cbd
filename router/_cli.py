"""`prism route`: print where keys go on the brain's current table, or render it as nginx upstreams and print
where nginx sends keys there. `prism gateway`: run the router as an HTTP reverse proxy (`Gateway`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from dataclasses import replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from prismlb.service import (
    BRAIN_PUBLIC,
    BRAIN_SNAPSHOT,
    BRAIN_UPDATES,
    CURVE_SECRET,
    ResolvedSettings,
    Setting,
    SettingTable,
    client_curve,
    parse_listen_address,
    parse_number,
    parse_port,
    parse_positive,
    parse_text,
    sd_notify,
    setup_logging,
    stop_on_signals,
    watchdog_interval_s,
)
from prismlb.wire import BrainAddress, ClientCurve, ConfigError, NoRouteError, RoutingTable

from ._gateway import TOKENIZE_SOURCES, Gateway, GatewayConfig, WorkerWatch, static_table, tokenize_problem
from ._nginx import DEFAULT_HASH, check_nginx_settings, nginx_choices, render_nginx
from ._router import Router
from ._settings import Settings

_SETTINGS = SettingTable("route", [BRAIN_UPDATES, BRAIN_SNAPSHOT])
"""The brain's endpoints, under the brain's own flags and variables."""


def _worker_urls(raw: object) -> tuple[str, ...]:
    """Worker URLs from repeated flags, a comma-separated variable or a list; checked as `static_table` takes them."""
    items = raw if isinstance(raw, list) else [raw]
    urls = tuple(url.strip() for item in items for url in parse_text(item).split(",") if url.strip())
    static_table(urls)
    return urls


def _slo_scale(raw: object) -> float:
    """A TTFT SLO scale, as `Settings.slo_scale` takes it."""
    value = float(parse_number(raw, float, f"{raw!r} is not a number"))
    Settings(slo_scale=value)  # its check, in one place
    return value


def _tokenize_source(raw: object) -> str:
    """`GatewayConfig.tokenize`: engine or text."""
    value = parse_text(raw).lower()
    if value not in TOKENIZE_SOURCES:
        raise ValueError(tokenize_problem(raw))
    return value


GATEWAY_SETTINGS = SettingTable(
    "gateway",
    [
        Setting(
            "host",
            "address to listen on",
            parse_listen_address,
            GatewayConfig.host,
            flag="--host",
            metavar="ADDRESS",
            variable="PRISM_GATEWAY_HOST",
        ),
        Setting(
            "port",
            "port to listen on (0: a free one, logged)",
            parse_port("port"),
            GatewayConfig.port,
            flag="--port",
            metavar="PORT",
            variable="PRISM_GATEWAY_PORT",
        ),
        Setting(
            "worker_urls",
            "an engine to relay to without a brain (repeatable, or comma-separated): a fixed table of equal "
            "weights, each engine's prefill speed from the gateway's own first tokens, then from its /metrics, "
            "placement from the gateway's own placements and load",
            _worker_urls,
            flag="--worker-url",
            variable="PRISM_GATEWAY_WORKER_URLS",
            action="append",
            metavar="URL",
        ),
        BRAIN_UPDATES,
        BRAIN_SNAPSHOT,
        replace(CURVE_SECRET, help="the gateway's CURVE secret key file; needs --brain-public"),
        BRAIN_PUBLIC,
        Setting(
            "max_connections",
            "callers' connections open at once (a thread each); more are answered 503",
            parse_positive(int),
            GatewayConfig.max_connections,
            flag="--max-connections",
            metavar="N",
            variable="PRISM_GATEWAY_MAX_CONNECTIONS",
        ),
        Setting(
            "max_body_bytes",
            "largest request body taken (413 beyond)",
            parse_positive(int),
            GatewayConfig.max_body_bytes,
            flag="--max-body-bytes",
            metavar="BYTES",
            variable="PRISM_GATEWAY_MAX_BODY_BYTES",
        ),
        Setting(
            "read_timeout_s",
            "seconds a request may take to arrive, and an idle connection stays open",
            parse_positive(float),
            GatewayConfig.read_timeout_s,
            flag="--read-timeout",
            metavar="SECONDS",
            variable="PRISM_GATEWAY_READ_TIMEOUT_S",
        ),
        Setting(
            "connect_timeout_s",
            "seconds to connect to an engine before the next is tried",
            parse_positive(float),
            GatewayConfig.connect_timeout_s,
            flag="--connect-timeout",
            metavar="SECONDS",
            variable="PRISM_GATEWAY_CONNECT_TIMEOUT_S",
        ),
        Setting(
            "slo_scale",
            "the service's TTFT SLO as a multiple of a prompt's prefill alone (at least the slice's τ0): the order "
            "in which requests held for room go",
            _slo_scale,
            Settings().slo_scale,
            flag="--slo-scale",
            metavar="TIMES",
            variable="PRISM_SLO_SCALE",
        ),
        Setting(
            "tokenize",
            "where a text request's block hashes come from: engine (the token ids an engine's /tokenize gives, which "
            "match the engines' KV events) or text (its text blocks, no round trip first)",
            _tokenize_source,
            GatewayConfig.tokenize,
            flag="--tokenize",
            metavar="SOURCE",
            variable="PRISM_GATEWAY_TOKENIZE",
        ),
        Setting(
            "upstream_timeout_s",
            "seconds to wait for an engine's next bytes (a long prompt's prefill comes first)",
            parse_positive(float),
            GatewayConfig.upstream_timeout_s,
            flag="--upstream-timeout",
            metavar="SECONDS",
            variable="PRISM_GATEWAY_UPSTREAM_TIMEOUT_S",
        ),
    ],
)
"""`prism gateway`'s settings: where it listens, the brain it follows, and `GatewayConfig`'s bounds."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `prism route` and `prism gateway`."""
    _add_gateway_parser(subparsers)
    parser = subparsers.add_parser(
        "route",
        help="print where keys go on the brain's current table, or render it for nginx",
        description="Fetch the brain's current routing table and print the node a Prism router sends each key to. "
        "With --nginx, print the table as nginx upstream blocks instead, or with keys the server nginx's "
        "`hash ... consistent` picks for each in those blocks (its ring is not the router's: the two choose "
        "differently).",
    )
    _SETTINGS.add_arguments(parser)
    parser.add_argument(
        "--slice", help="slice to route in or render (default: the text slice, else 'default'; --nginx: every slice)"
    )
    parser.add_argument("--curve-secret", type=Path, metavar="FILE", help="our CURVE secret key file")
    parser.add_argument("--brain-public", type=Path, metavar="FILE", help="the brain's CURVE public key file")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a table (default: %(default)s)")
    parser.add_argument(
        "--nginx",
        action="store_true",
        help="print the table as nginx upstream blocks instead, or with keys where nginx sends them there",
    )
    parser.add_argument("--max-fails", type=int, default=1, help="nginx max_fails per server (default: %(default)s)")
    parser.add_argument(
        "--fail-timeout", type=float, default=10.0, help="nginx fail_timeout in seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--nginx-hash",
        default=DEFAULT_HASH,
        help="nginx variable to hash on, '' for weighted round robin (default: %(default)s)",
    )
    parser.add_argument(
        "--nginx-listen",
        metavar="[HOST:]PORT",
        help="with --nginx: add a server block on this address proxying to the slice's upstream (needs --slice "
        "when the table has several slices)",
    )
    parser.add_argument(
        "keys", nargs="*", help="affinity keys (with --nginx: values of the --nginx-hash variable) to route"
    )
    parser.set_defaults(func=_run)


def _fail_as(command: str, message: str, status: int) -> int:
    """`status` after one line on stderr: 2 for a usage error, 1 for a failure."""
    print(f"prism {command}: {message}", file=sys.stderr)
    return status


def _fail(message: str, status: int) -> int:
    return _fail_as("route", message, status)


def _run(args: argparse.Namespace) -> int:
    if not args.keys and not args.nginx:
        return _fail("give keys to route, or --nginx", 2)
    if (args.curve_secret is None) != (args.brain_public is None):
        return _fail("--curve-secret and --brain-public must be given together", 2)
    if not args.timeout > 0:
        return _fail(f"--timeout must be positive, got {args.timeout:g}", 2)
    if args.nginx_listen is not None and (args.keys or not args.nginx):
        return _fail("--nginx-listen adds a server block to --nginx's config: give it with --nginx and no keys", 2)
    if args.nginx and args.keys and not args.nginx_hash:
        return _fail("with --nginx-hash '' nginx balances round robin, so a key has no server of its own", 2)
    try:
        check_nginx_settings(args.max_fails, args.fail_timeout, args.nginx_hash, args.nginx_listen)
    except ValueError as exc:
        return _fail(str(exc), 2)
    curve = None if args.curve_secret is None else ClientCurve(args.curve_secret, args.brain_public)
    try:
        brain = _SETTINGS.resolve(args, os.environ)
        router = Router.connect(BrainAddress(brain["updates"], brain["snapshot"]), curve=curve)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    with router:
        router.wait_for_table(args.timeout)
    # Closed: the router stops following the brain and keeps this table, so every key uses the same one.
    table = router.table
    if table is None:
        return _fail(f"no routing table from {brain['updates']} / {brain['snapshot']} within {args.timeout:g} s", 1)
    names = sorted(s.name for s in table.slices)
    if args.slice is not None and args.slice not in names:
        return _fail(
            f"no slice {args.slice!r} in table epoch {table.epoch} version {table.version} (slices: "
            f"{', '.join(names) or 'none'})",
            2,
        )
    if args.nginx and not args.keys:
        try:
            text = render_nginx(
                table,
                slice_name=args.slice,
                max_fails=args.max_fails,
                fail_timeout_s=args.fail_timeout,
                hash_key=args.nginx_hash,
                listen=args.nginx_listen,
            )
        except ValueError as exc:
            return _fail(str(exc), 2)
        print(text, end="")
        return 0
    try:
        taken = router.slice_of(args.slice)
        if args.nginx:
            return _print_nginx_choices(table, args.slice or taken, args.keys, args.nginx_hash)
        where = f"slice {taken!r}" if taken == (args.slice or taken) else f"slice {taken!r} ({args.slice!r} is empty)"
        print(f"table epoch {table.epoch} version {table.version}, {where}")
        for key in args.keys:
            endpoint = router.route(key, args.slice)
            print(f"{key} -> {endpoint.node_id} {endpoint.address}")
    except NoRouteError as exc:
        return _fail(str(exc), 1)
    return 0


def _print_nginx_choices(table: RoutingTable, slice_name: str, keys: list[str], hash_key: str) -> int:
    """Where nginx, with the upstream `--nginx` renders for `slice_name`, sends a request whose `hash_key` is each
    key: the node ids at that server and the server."""
    try:
        choices = nginx_choices(table, keys, slice_name)
    except ValueError as exc:
        return _fail(str(exc), 1)
    upstream = choices[0].upstream
    print(f"table epoch {table.epoch} version {table.version}, nginx upstream {upstream} (hash {hash_key} consistent)")
    for key, choice in zip(keys, choices, strict=True):
        if choice.server is None:
            print(f"{key!r} -> round robin (nginx hashes no empty key)")
        else:
            print(f"{key} -> {','.join(choice.node_ids)} {choice.server}")
    return 0


def _add_gateway_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="run the router as an HTTP reverse proxy in front of the engines",
        description="Follow the brain's routing tables and KV stream as an embedded router does, and relay every "
        "HTTP request to the engine the router places it on, streamed answers as they arrive: for callers that "
        "cannot embed the router. GET /health and /metrics are the gateway's own. A flag beats its environment "
        "variable, which beats the default.",
    )
    GATEWAY_SETTINGS.add_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=_run_gateway)


def gateway_config(settings: ResolvedSettings) -> GatewayConfig:
    """The `GatewayConfig` of resolved `GATEWAY_SETTINGS`."""
    return settings.build(GatewayConfig)


def gateway_routing(settings: ResolvedSettings) -> Settings:
    """The gateway's router `Settings` of resolved `GATEWAY_SETTINGS`: the library's, but for the service's SLO."""
    return Settings(slo_scale=settings["slo_scale"])


def _run_gateway(args: argparse.Namespace) -> int:
    try:
        settings = GATEWAY_SETTINGS.resolve(args, os.environ)
        config = gateway_config(settings)
        routing = gateway_routing(settings)
        curve = client_curve(settings)
    except ConfigError as exc:
        return _fail_as("gateway", str(exc), 2)
    setup_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relayed request: /metrics counts them
    stop = threading.Event()
    stop_on_signals(stop)
    registry = CollectorRegistry()
    workers = settings["worker_urls"]
    try:
        if workers and (settings.given("updates") or settings.given("snapshot") or curve is not None):
            raise ConfigError("--worker-url runs without a brain: give it, or the brain's endpoints and keys, not both")
        if workers:
            router = Router.from_table(static_table(workers), settings=routing, registry=registry)
            watch: WorkerWatch | None = WorkerWatch(router, workers)
        else:
            watch = None
            address = BrainAddress(settings["updates"], settings["snapshot"])
            router = Router.connect(address, curve=curve, settings=routing, registry=registry)
    except ConfigError as exc:
        return _fail_as("gateway", str(exc), 2)
    with router:
        try:
            gateway = Gateway(router, config, registry=registry)
        except ConfigError as exc:
            return _fail_as("gateway", str(exc), 1)
        with gateway, watch if watch is not None else contextlib.nullcontext():
            sd_notify("READY=1")
            ping_s = watchdog_interval_s()
            while not stop.wait(ping_s):
                sd_notify("WATCHDOG=1")  # only with a watchdog: without one the wait ends with the stop alone
            sd_notify("STOPPING=1")
    return 0

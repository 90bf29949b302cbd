"""`prism route`: print where keys go on the brain's current table, or render it as nginx upstreams."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prismlb.wire import BrainAddress, ClientCurve, ConfigError, NoRouteError

from ._nginx import DEFAULT_HASH, render_nginx
from ._router import Router


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "route",
        help="print where keys go on the brain's current table, or render it for nginx",
        description="Fetch the brain's current routing table and print the node each key routes to, or (--nginx) "
        "print it as nginx upstream blocks.",
    )
    parser.add_argument(
        "--updates",
        default=os.environ.get("PRISM_BRAIN_UPDATES", "tcp://127.0.0.1:5556"),
        help="the brain's table PUB endpoint (env PRISM_BRAIN_UPDATES; default: %(default)s)",
    )
    parser.add_argument(
        "--snapshot",
        default=os.environ.get("PRISM_BRAIN_SNAPSHOT", "tcp://127.0.0.1:5557"),
        help="the brain's snapshot endpoint (env PRISM_BRAIN_SNAPSHOT; default: %(default)s)",
    )
    parser.add_argument(
        "--slice", help="slice to route in or render (default: the text slice, else 'default'; --nginx: every slice)"
    )
    parser.add_argument("--curve-secret", type=Path, metavar="FILE", help="our CURVE secret key file")
    parser.add_argument("--brain-public", type=Path, metavar="FILE", help="the brain's CURVE public key file")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a table (default: %(default)s)")
    parser.add_argument("--nginx", action="store_true", help="print the table as nginx upstream blocks instead")
    parser.add_argument("--max-fails", type=int, default=1, help="nginx max_fails per server (default: %(default)s)")
    parser.add_argument(
        "--fail-timeout", type=float, default=10.0, help="nginx fail_timeout in seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--nginx-hash",
        default=DEFAULT_HASH,
        help="nginx variable to hash on, '' for weighted round robin (default: %(default)s)",
    )
    parser.add_argument("keys", nargs="*", help="affinity keys to route")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not args.keys and not args.nginx:
        print("prism route: give keys to route, or --nginx", file=sys.stderr)
        return 2
    if (args.curve_secret is None) != (args.brain_public is None):
        print("prism route: --curve-secret and --brain-public must be given together", file=sys.stderr)
        return 2
    curve = None if args.curve_secret is None else ClientCurve(args.curve_secret, args.brain_public)
    try:
        router = Router.connect(BrainAddress(args.updates, args.snapshot), curve=curve)
    except ConfigError as exc:
        print(f"prism route: {exc}", file=sys.stderr)
        return 2
    with router:
        router.wait_for_table(args.timeout)
    # Closed: the router stops following the brain and keeps this table, so every key uses the same one.
    table = router.table
    if table is None:
        print(
            f"prism route: no routing table from {args.updates} / {args.snapshot} within {args.timeout:g} s",
            file=sys.stderr,
        )
        return 1
    if args.nginx:
        try:
            print(
                render_nginx(
                    table,
                    slice_name=args.slice,
                    max_fails=args.max_fails,
                    fail_timeout_s=args.fail_timeout,
                    hash_key=args.nginx_hash,
                ),
                end="",
            )
        except ValueError as exc:
            print(f"prism route: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        taken = router.slice_of(args.slice)
        where = f"slice {taken!r}" if taken == (args.slice or taken) else f"slice {taken!r} ({args.slice!r} is empty)"
        print(f"table epoch {table.epoch} version {table.version}, {where}")
        for key in args.keys:
            endpoint = router.route(key, args.slice)
            print(f"{key} -> {endpoint.node_id} {endpoint.address}")
    except NoRouteError as exc:
        print(f"prism route: {exc}", file=sys.stderr)
        return 1
    return 0

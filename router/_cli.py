"""`prism route`: print where keys go on the brain's current table."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prismlb.wire import BrainAddress, ClientCurve, ConfigError, NoRouteError

from ._router import Router


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "route",
        help="print where keys go on the brain's current table",
        description="Fetch the brain's current routing table and print the node each key routes to.",
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
    parser.add_argument("--slice", default="default", help="modality slice to route in (default: %(default)s)")
    parser.add_argument("--curve-secret", type=Path, metavar="FILE", help="our CURVE secret key file")
    parser.add_argument("--brain-public", type=Path, metavar="FILE", help="the brain's CURVE public key file")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a table (default: %(default)s)")
    parser.add_argument("keys", nargs="+", help="affinity keys to route")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
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
    print(f"table epoch {table.epoch} version {table.version}, slice {args.slice!r}")
    try:
        for key in args.keys:
            endpoint = router.route(key, args.slice)
            print(f"{key} -> {endpoint.node_id} {endpoint.address}")
    except NoRouteError as exc:
        print(f"prism route: {exc}", file=sys.stderr)
        return 1
    return 0
